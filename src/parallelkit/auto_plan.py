"""``strategy=auto``'s planner entry point: :func:`choose_layout` for a composed ``train`` config.

The cost model, the search and the hardware profiles live in :mod:`parallelkit.planner` (docs/planner.md);
this module turns the run's config and ``strategy=auto``'s options into a workload and search options, and keeps
the names earlier callers import (``Hardware``, ``Candidate``, ``AutoPlan``, ``format_ranking``, ``layouts``,
``crosses_nodes``).
"""

from __future__ import annotations

from typing import Any

from parallelkit.distributed.parallel_dims import DEFAULT_MESH_ORDER, DP, PP, SHARDING, TP
from parallelkit.planner.hardware import Hardware, Link, load_profile, resolve_hardware
from parallelkit.planner.layout import Layout
from parallelkit.planner.layout import crosses_nodes as _crosses_nodes
from parallelkit.planner.report import format_ranking
from parallelkit.planner.search import AutoPlan, Candidate, SearchOptions, degree_sets, search
from parallelkit.planner.workload import Runtime, Workload, workload_from_config

__all__ = ["AutoPlan", "Candidate", "Hardware", "Link", "choose_layout", "crosses_nodes", "format_ranking", "layouts",
           "load_profile", "resolve_hardware", "search_options", "workload_of"]


def layouts(world_size: int) -> list[dict[str, int]]:
    """Every ``(dp, sharding, tp, pp)`` whose product is ``world_size``."""
    return [{DP: dp, SHARDING: sh, TP: tp, PP: pp} for dp, sh, tp, pp, _ in degree_sets(world_size)]


def crosses_nodes(dims: Any, axis: str, devices_per_node: int) -> bool:
    """Whether some group of ``axis`` of ``dims`` (a :class:`ParallelDims`) spans two nodes."""
    layout = Layout(dims.dp, dims.sharding, dims.tp, dims.pp, dims.ep, mesh_order=tuple(dims.mesh_order))
    return _crosses_nodes(layout, axis, devices_per_node)


def search_options(cfg: Any, strategy_kwargs: dict[str, Any], *, max_microbatches: int | None = None,
                   search_accumulate: bool = True, allow_tp_across_nodes: bool = False,
                   allow_ep_across_nodes: bool = False) -> SearchOptions:
    """The search space ``strategy=auto`` may explore for this run (hybrid4d's options fixed by the config)."""
    clip = cfg.trainer.get("gradient_clip_val")
    return SearchOptions(
        schedule=strategy_kwargs.get("schedule", "1f1b"), virtual_stages=strategy_kwargs.get("virtual_stages"),
        max_microbatches=max_microbatches, search_accumulate=search_accumulate,
        mesh_order=tuple(strategy_kwargs.get("mesh_order") or DEFAULT_MESH_ORDER),
        reshard_after_forward=strategy_kwargs.get("reshard_after_forward"),
        allow_tp_across_nodes=allow_tp_across_nodes, allow_ep_across_nodes=allow_ep_across_nodes,
        norm_clipping=bool(clip) and (cfg.trainer.get("gradient_clip_algorithm") or "norm") == "norm",
    )


def workload_of(cfg: Any, strategy_kwargs: dict[str, Any] | None = None, datamodule: Any = None) -> Workload:
    """The run's :class:`Workload` (parallelkit's runtime: dp averaged after backward, FSDP2 overlapped)."""
    kwargs = strategy_kwargs or {}
    return workload_from_config(cfg, datamodule=datamodule, sequence_parallel=bool(kwargs.get("sequence_parallel", False)),
                                runtime=Runtime())


def choose_layout(cfg: Any, world_size: int, hardware: Hardware, *, max_microbatches: int | None = None,
                  strategy_kwargs: dict[str, Any] | None = None, datamodule: Any = None, search_accumulate: bool = True,
                  allow_tp_across_nodes: bool = False, allow_ep_across_nodes: bool = False) -> AutoPlan:
    """Rank every layout of ``world_size`` ranks for the run ``cfg`` describes on ``hardware``.

    Args:
        cfg: the composed ``train`` config (model, data, optim, trainer, recompute).
        world_size: ranks of the job.
        hardware: the machine (:class:`Hardware`; :func:`resolve_hardware` builds one from ``strategy.hardware``).
        max_microbatches: upper bound on pipeline micro-batches (None: any divisor of the per-rank batch).
        strategy_kwargs: hybrid4d's options for the chosen layout (schedule, mesh_order, sequence_parallel, ...).
        datamodule: the run's data module if already built (else only built if the vocabulary needs it).
        search_accumulate: let the planner choose gradient accumulation (pp = 1).
        allow_tp_across_nodes / allow_ep_across_nodes: let tp / ep groups span nodes.

    Returns:
        The :class:`AutoPlan`; ``plan.chosen`` is the best layout. Raises :class:`ConfigError` if none fits.
    """
    kwargs = dict(strategy_kwargs or {})
    workload = workload_of(cfg, kwargs, datamodule)
    opts = search_options(cfg, kwargs, max_microbatches=max_microbatches, search_accumulate=search_accumulate,
                          allow_tp_across_nodes=allow_tp_across_nodes, allow_ep_across_nodes=allow_ep_across_nodes)
    return search(workload, hardware, world_size, opts)
