"""``strategy=auto``: pick ``dp × sharding × cp × tp × pp`` and the batch cut for this model and machine, then train with hybrid4d.

The choice needs the model, the batch and the world size, which the strategy's own config does not hold,
so :class:`AutoStrategy` is resolved by ``parallelkit.run`` once the world size is known and before any
process starts: :meth:`AutoStrategy.resolve` runs :func:`parallelkit.planner.auto.choose_layout` (the cost model of
:mod:`parallelkit.planner`), prints its ranking on rank 0, and returns the ``strategy=hybrid4d`` strategy for the
chosen degrees and micro-batches (the pipeline or the plain variant, which is why this is a delegation rather than a
subclass); without a pipeline the chosen gradient accumulation becomes ``trainer.accumulate_grad_batches``. Every
rank resolves the same way from the same inputs, so all agree on the layout without communicating; for that reason
the hardware is a profile read from the config (a named or calibrated profile, or rough defaults), never measured
at launch. hybrid4d's own checks (``check_model``, ``check_workload``) then run on the chosen layout as for any run.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from parallelkit.errors import ConfigError
from parallelkit.planner.auto import choose_layout
from parallelkit.planner.hardware import Hardware, host_memory_per_rank, resolve_hardware
from parallelkit.planner.report import format_ranking
from parallelkit.planner.search import AutoPlan
from parallelkit.strategies.hybrid4d import Hybrid4DStrategy
from parallelkit.strategy_protocol import StrategyProtocol

STRATEGY_NAME = "auto"


def machine_memory(accelerator: str, devices_per_node: int) -> float:
    """Bytes one rank may use by default: the GPU's memory, or this host's RAM shared by its ranks."""
    import torch

    if accelerator == "gpu" and torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return host_memory_per_rank(devices_per_node)


class AutoStrategy(StrategyProtocol):
    """Chooses the degrees with the cost model of :mod:`parallelkit.planner`, then runs ``strategy=hybrid4d``.

    Args:
        hardware: a profile name (``a100_80gb_8x``, ``h100_80gb_8x``) or the path of a calibrated profile; or a
            mapping with ``profile`` (a name or path, null: rough defaults for this accelerator) and overrides
            ``devices_per_node``, ``memory_per_device`` (bytes), ``intra_node_bandwidth``, ``inter_node_bandwidth``
            (bytes/s), ``intra_node_latency``, ``inter_node_latency`` (s), ``flops_per_device``,
            ``memory_bandwidth``, ``memory_reserved``; null values keep the profile's.
        max_microbatches: upper bound on pipeline micro-batches per rank and step (None: any).
        search_accumulate: choose ``trainer.accumulate_grad_batches`` for layouts without a pipeline.
        allow_tp_across_nodes / allow_ep_across_nodes: let tensor- / expert-parallel groups span nodes.
        max_cp: the largest context-parallel degree searched (None: any the sequence and the model allow; 1: none).
        top: how many layouts the printed ranking shows.
        **hybrid4d_kwargs: passed to ``hybrid4d`` for the chosen layout (``mesh_order``, ``schedule``, ...);
            ``sequence_parallel`` and ``cp_mode`` fix those choices (absent or null: searched).

    Example::

        python train.py strategy=auto trainer.devices=8 strategy.hardware=hardware_myhost.yaml
    """

    strategy_name = STRATEGY_NAME

    def __init__(self, hardware: Any = None, max_microbatches: int | None = None, search_accumulate: bool = True,
                 allow_tp_across_nodes: bool = False, allow_ep_across_nodes: bool = False, top: int = 8,
                 max_cp: int | None = None, **hybrid4d_kwargs: Any) -> None:
        for name in ("dp", "sharding", "cp", "tp", "pp", "ep", "microbatches", "virtual_stages"):
            if name in hybrid4d_kwargs and not (name == "virtual_stages" and hybrid4d_kwargs[name] is None):
                raise ConfigError(
                    f"strategy=auto chooses strategy.{name} itself; drop strategy.{name}={hybrid4d_kwargs[name]!r}, "
                    "or use strategy=hybrid4d to set the degrees by hand."
                )
        if max_microbatches is not None and (not isinstance(max_microbatches, int) or isinstance(max_microbatches, bool) or max_microbatches < 1):
            raise ConfigError(f"strategy.max_microbatches should be an int greater than 0 (or null). Got {max_microbatches!r}.")
        if max_cp is not None and (not isinstance(max_cp, int) or isinstance(max_cp, bool) or max_cp < 1):
            raise ConfigError(f"strategy.max_cp should be an int greater than 0 (or null). Got {max_cp!r}.")
        if not (hardware is None or isinstance(hardware, str) or hasattr(hardware, "items")):
            raise ConfigError(f"strategy.hardware should be a profile name, a path or a mapping of overrides. Got {hardware!r}.")
        self.hardware = hardware if isinstance(hardware, str) else dict(hardware or {})
        if isinstance(self.hardware, dict):
            resolve_hardware(self.hardware, accelerator="cpu", devices_per_node=1, memory_default=1.0)  # bad keys fail now
        self.max_microbatches = max_microbatches
        self.search_accumulate = bool(search_accumulate)
        self.allow_tp_across_nodes = bool(allow_tp_across_nodes)
        self.allow_ep_across_nodes = bool(allow_ep_across_nodes)
        self.top = top
        self.max_cp = max_cp
        self.hybrid4d_kwargs = {k: v for k, v in hybrid4d_kwargs.items() if not (k == "virtual_stages" and v is None)}
        self.accelerator = "cpu"
        self.auto_plan: AutoPlan | None = None

    @override
    def default_devices(self, accelerator: str) -> int:
        import torch

        return max(torch.cuda.device_count(), 1) if accelerator == "gpu" else 2

    @override
    def bind_accelerator(self, accelerator: str) -> None:
        self.accelerator = accelerator

    def resolve_hardware(self, devices_per_node: int) -> Hardware:
        return resolve_hardware(self.hardware, accelerator=self.accelerator, devices_per_node=devices_per_node,
                                memory_default=machine_memory(self.accelerator, devices_per_node))

    @override
    def resolve(self, cfg: Any, devices: int, num_nodes: int) -> Any:
        """The hybrid4d strategy for the layout the cost model picks for ``devices × num_nodes`` ranks."""
        plan = choose_layout(cfg, devices * num_nodes, self.resolve_hardware(devices), max_microbatches=self.max_microbatches,
                             strategy_kwargs=self.hybrid4d_kwargs, search_accumulate=self.search_accumulate,
                             allow_tp_across_nodes=self.allow_tp_across_nodes, allow_ep_across_nodes=self.allow_ep_across_nodes,
                             max_cp=self.max_cp)
        rank_zero_info(format_ranking(plan, self.top))
        self.auto_plan = plan
        chosen = plan.chosen.layout
        kwargs = dict(self.hybrid4d_kwargs)
        if chosen.pp > 1 and kwargs.get("schedule", "1f1b") in ("interleaved_1f1b", "zero_bubble", "zbv"):
            kwargs["virtual_stages"] = chosen.virtual_stages
        record = {"strategy": STRATEGY_NAME, **plan.as_dict()}
        # An ordinary hybrid4d strategy for the chosen layout: its gradient accumulation (run.py cuts the batch and
        # builds the Trainer after binding it) and the plan, written to summary.json beside what was measured.
        accumulate = chosen.accumulate if chosen.pp == 1 and self.search_accumulate else None
        kwargs.update(sequence_parallel=chosen.sequence_parallel, cp_mode=chosen.cp_mode, mesh_order=list(chosen.mesh_order))
        strategy = Hybrid4DStrategy(**chosen.degrees, ep=chosen.ep, microbatches=chosen.microbatches,
                                    accumulate_grad_batches=accumulate, auto_plan=record, **kwargs)
        return strategy
