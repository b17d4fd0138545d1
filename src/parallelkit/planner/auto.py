"""``strategy=auto``'s entry into the planner: :func:`choose_layout` for a composed ``train`` config.

The cost model, the search and the hardware profiles are the rest of :mod:`parallelkit.planner` (docs/planner.md);
this module turns the run's config and ``strategy=auto``'s options into a workload and search options, for
:class:`~parallelkit.strategies.auto.AutoStrategy` and for ``python -m parallelkit.plan`` (which ranks without
instantiating the strategy: :func:`auto_plan_from_config`, or estimates one fixed layout:
:func:`estimate_fixed_layout`).
"""

from __future__ import annotations

from typing import Any

from parallelkit.distributed.parallel_dims import DEFAULT_MESH_ORDER, DP, PP, SHARDING, TP, ParallelDims
from parallelkit.planner.hardware import Hardware, host_memory_per_rank, load_profile, resolve_hardware
from parallelkit.planner.layout import MULTI_STAGE, Layout
from parallelkit.planner.layout import crosses_nodes as _crosses_nodes
from parallelkit.planner.report import format_ranking
from parallelkit.planner.search import AutoPlan, SearchOptions, degree_sets, evaluate, search
from parallelkit.planner.workload import Runtime, Workload, workload_from_config

#: strategy=auto's own options: the rest of ``cfg.strategy`` is hybrid4d's, fixed for the chosen layout.
AUTO_OPTIONS = ("_target_", "hardware", "max_microbatches", "search_accumulate", "allow_tp_across_nodes",
                "allow_ep_across_nodes", "top", "max_cp")


def layouts(world_size: int) -> list[dict[str, int]]:
    """Every ``(dp, sharding, tp, pp)`` whose product is ``world_size`` (without context parallelism)."""
    return [{DP: dp, SHARDING: sh, TP: tp, PP: pp} for dp, sh, _, tp, pp, _ in degree_sets(world_size)]


def crosses_nodes(dims: ParallelDims, axis: str, devices_per_node: int) -> bool:
    """Whether some group of ``axis`` of ``dims`` spans two nodes."""
    return _crosses_nodes(dims, axis, devices_per_node)


def search_options(cfg: Any, strategy_kwargs: dict[str, Any], *, max_microbatches: int | None = None,
                   search_accumulate: bool = True, allow_tp_across_nodes: bool = False,
                   allow_ep_across_nodes: bool = False, max_cp: int | None = None) -> SearchOptions:
    """The search space ``strategy=auto`` may explore for this run (hybrid4d's options fixed by the config)."""
    clip = cfg.trainer.get("gradient_clip_val")
    sequence_parallel = strategy_kwargs.get("sequence_parallel")
    return SearchOptions(
        schedule=strategy_kwargs.get("schedule", "1f1b"), virtual_stages=strategy_kwargs.get("virtual_stages"),
        max_microbatches=max_microbatches, search_accumulate=search_accumulate,
        mesh_order=tuple(strategy_kwargs.get("mesh_order") or DEFAULT_MESH_ORDER),
        reshard_after_forward=strategy_kwargs.get("reshard_after_forward"),
        allow_tp_across_nodes=allow_tp_across_nodes, allow_ep_across_nodes=allow_ep_across_nodes,
        norm_clipping=bool(clip) and (cfg.trainer.get("gradient_clip_algorithm") or "norm") == "norm",
        sequence_parallel=None if sequence_parallel is None else bool(sequence_parallel),
        cp_mode=strategy_kwargs.get("cp_mode"), max_cp=max_cp,
    )


def workload_of(cfg: Any, datamodule: Any = None) -> Workload:
    """The run's :class:`Workload` (parallelkit's runtime: dp averaged after backward, FSDP2 overlapped)."""
    return workload_from_config(cfg, datamodule=datamodule, runtime=Runtime())


def choose_layout(cfg: Any, world_size: int, hardware: Hardware, *, max_microbatches: int | None = None,
                  strategy_kwargs: dict[str, Any] | None = None, datamodule: Any = None, search_accumulate: bool = True,
                  allow_tp_across_nodes: bool = False, allow_ep_across_nodes: bool = False, max_cp: int | None = None) -> AutoPlan:
    """Rank every layout of ``world_size`` ranks for the run ``cfg`` describes on ``hardware``.

    Args:
        cfg: the composed ``train`` config (model, data, optim, trainer, recompute).
        world_size: ranks of the job.
        hardware: the machine (:class:`Hardware`; :func:`resolve_hardware` builds one from ``strategy.hardware``).
        max_microbatches: upper bound on pipeline micro-batches (None: any divisor of the per-rank batch).
        strategy_kwargs: hybrid4d's options for the chosen layout (schedule, mesh_order, ...); ``sequence_parallel``
            fixes it (absent: the search tries both; ``plan.chosen.layout.sequence_parallel`` says which it chose), and
            ``cp_mode`` context parallelism's attention (absent or null: searched; ``plan.chosen.layout.cp_mode``).
        datamodule: the run's data module if already built (else only built if the vocabulary needs it).
        search_accumulate: let the planner choose gradient accumulation (pp = 1).
        allow_tp_across_nodes / allow_ep_across_nodes: let tp / ep groups span nodes.
        max_cp: the largest context-parallel degree searched (None: any the sequence and the model allow; 1: none).

    Returns:
        The :class:`AutoPlan`; ``plan.chosen`` is the best layout. Raises :class:`ConfigError` if none fits.
    """
    kwargs = dict(strategy_kwargs or {})
    workload = workload_of(cfg, datamodule)
    opts = search_options(cfg, kwargs, max_microbatches=max_microbatches, search_accumulate=search_accumulate,
                          allow_tp_across_nodes=allow_tp_across_nodes, allow_ep_across_nodes=allow_ep_across_nodes, max_cp=max_cp)
    return search(workload, hardware, world_size, opts)


def auto_plan_from_config(cfg: Any) -> AutoPlan:
    """What ``strategy=auto`` would rank for this config, without instantiating the strategy (no torch, no Lightning)."""
    strategy = dict(cfg.strategy)
    devices = cfg.trainer.get("devices") or 2
    nodes = cfg.trainer.get("num_nodes") or 1
    accelerator = "gpu" if cfg.trainer.get("accelerator") == "gpu" else "cpu"
    hardware = resolve_hardware(strategy.get("hardware"), accelerator=accelerator, devices_per_node=devices,
                                memory_default=host_memory_per_rank(devices) if accelerator == "cpu" else None)
    kwargs = {k: v for k, v in strategy.items() if k not in AUTO_OPTIONS}
    return choose_layout(cfg, devices * nodes, hardware, max_microbatches=strategy.get("max_microbatches"),
                         strategy_kwargs=kwargs, search_accumulate=strategy.get("search_accumulate", True),
                         allow_tp_across_nodes=bool(strategy.get("allow_tp_across_nodes", False)),
                         allow_ep_across_nodes=bool(strategy.get("allow_ep_across_nodes", False)),
                         max_cp=strategy.get("max_cp"))


def estimate_fixed_layout(cfg: Any, hardware_spec: str, dims: ParallelDims) -> str:
    """The cost model's estimate of the layout a fixed strategy trains with: ``dims`` as the strategy resolved them
    (its :class:`ParallelDims`, e.g. the dry run's), the batch cut and options from ``cfg.strategy``."""
    hw = load_profile(hardware_spec)
    s = cfg.strategy
    w = workload_of(cfg)
    batch = w.global_batch // dims.data_parallel_size
    m = s.get("microbatches", 1) if dims.pp > 1 else 1
    accumulate = cfg.trainer.get("accumulate_grad_batches", 1) if dims.pp == 1 else 1
    schedule = s.get("schedule", "1f1b")
    layout = Layout(dims, zero_stage=3 if dims.sharding > 1 else 0, micro_batch=batch // (m * accumulate), microbatches=m,
                    accumulate=accumulate, schedule=schedule,
                    virtual_stages=s.get("virtual_stages") or (2 if schedule in MULTI_STAGE and dims.pp > 1 else 1),
                    reshard_after_forward=dims.pp == 1 if s.get("reshard_after_forward") is None else bool(s.get("reshard_after_forward")),
                    sequence_parallel=bool(s.get("sequence_parallel", False)) and dims.tp > 1,
                    cp_mode=s.get("cp_mode") or "ring")
    candidate = evaluate(w, hw, layout)
    text = format_ranking(AutoPlan(dims.world_size, hw, w, [candidate]), top=1)
    return text.replace("strategy=auto:", "the cost model's estimate of this layout:", 1).replace("chosen: ", "estimate: ")
