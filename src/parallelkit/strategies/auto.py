"""``strategy=auto``: pick ``dp × sharding × tp × pp`` for this model and machine, then train with hybrid4d.

The choice needs the model, the batch and the world size, which the strategy's own config does not hold,
so :class:`AutoStrategy` is resolved by ``parallelkit.run`` once the world size is known and before any
process starts: :meth:`AutoStrategy.resolve` runs :func:`parallelkit.auto_plan.choose_layout`, prints
its ranking on rank 0, and returns the ``strategy=hybrid4d`` strategy for the chosen degrees (the pipeline
or the plain variant, which is why this is a delegation rather than a subclass). Every rank resolves
the same way from the same inputs, so all agree on the layout without communicating; for that reason the
hardware description is read from the config (or fixed per-machine defaults), never measured.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from parallelkit.auto_plan import AutoPlan, Hardware, choose_layout, format_ranking
from parallelkit.errors import ConfigError
from parallelkit.strategies.hybrid4d import hybrid4d
from parallelkit.strategies.protocol import StrategyProtocol

STRATEGY_NAME = "auto"

# Rough figures for the machines parallelkit runs on, used where strategy.hardware leaves a value null.
# CPU: gloo over loopback between processes of one host, ~one core of fp32 per rank, 10 GbE between hosts.
# GPU: NVLink-class links inside a node, InfiniBand-class (200 Gb/s) between nodes, fp32/TF32 matmuls.
DEFAULTS = {
    "cpu": dict(intra_node_bandwidth=2e9, inter_node_bandwidth=1.25e9, intra_node_latency=1e-4,
                inter_node_latency=2e-4, flops_per_device=2e10),
    "gpu": dict(intra_node_bandwidth=1.5e11, inter_node_bandwidth=2.5e10, intra_node_latency=1e-5,
                inter_node_latency=2e-5, flops_per_device=5e13),
}


def machine_memory(accelerator: str, devices_per_node: int) -> float:
    """Bytes one rank may use by default: the GPU's memory, or this host's RAM shared by its ranks."""
    if accelerator == "gpu" and torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / devices_per_node


class AutoStrategy(StrategyProtocol):
    """Chooses the degrees with the cost model of :mod:`parallelkit.auto_plan`, then runs ``strategy=hybrid4d``.

    Args:
        hardware: ``devices_per_node``, ``memory_per_device`` (bytes), ``intra_node_bandwidth``,
            ``inter_node_bandwidth`` (bytes/s), ``intra_node_latency``, ``inter_node_latency`` (s),
            ``flops_per_device``; a null value takes this machine's default.
        max_microbatches: upper bound on pipeline micro-batches per rank and step.
        top: how many layouts the printed ranking shows.
        **hybrid4d_kwargs: passed to ``hybrid4d`` for the chosen layout (``mesh_order``, ``schedule``, ...).

    Example::

        python train.py strategy=auto trainer.devices=8 strategy.hardware.memory_per_device=2e9
    """

    strategy_name = STRATEGY_NAME

    def __init__(self, hardware: dict[str, Any] | None = None, max_microbatches: int = 8, top: int = 8,
                 **hybrid4d_kwargs: Any) -> None:
        known = set(Hardware.__dataclass_fields__)
        unknown = sorted(set(hardware or {}) - known)
        if unknown:
            raise ConfigError(f"strategy.hardware has no {unknown}; it takes {sorted(known)}.")
        for name in ("dp", "sharding", "tp", "pp", "ep", "microbatches"):
            if name in hybrid4d_kwargs:
                raise ConfigError(
                    f"strategy=auto chooses strategy.{name} itself; drop strategy.{name}={hybrid4d_kwargs[name]!r}, "
                    "or use strategy=hybrid4d to set the degrees by hand."
                )
        if not isinstance(max_microbatches, int) or isinstance(max_microbatches, bool) or max_microbatches < 1:
            raise ConfigError(f"strategy.max_microbatches should be an int greater than 0. Got {max_microbatches!r}.")
        self.hardware = dict(hardware or {})
        self.max_microbatches = max_microbatches
        self.top = top
        self.hybrid4d_kwargs = hybrid4d_kwargs
        self.accelerator = "cpu"
        self.auto_plan: AutoPlan | None = None

    def default_devices(self, accelerator: str) -> int:
        return max(torch.cuda.device_count(), 1) if accelerator == "gpu" else 2

    def bind_accelerator(self, accelerator: str) -> None:
        self.accelerator = accelerator

    def resolve_hardware(self, devices_per_node: int) -> Hardware:
        values = {k: v for k, v in self.hardware.items() if v is not None}
        values.setdefault("devices_per_node", devices_per_node)
        for key, value in DEFAULTS["gpu" if self.accelerator == "gpu" else "cpu"].items():
            values.setdefault(key, value)
        values.setdefault("memory_per_device", machine_memory(self.accelerator, values["devices_per_node"]))
        values = {k: float(v) if k != "devices_per_node" else v for k, v in values.items()}
        return Hardware(**values)

    def resolve(self, cfg: Any, devices: int, num_nodes: int) -> Any:
        """The hybrid4d strategy for the layout the cost model picks for ``devices × num_nodes`` ranks."""
        plan = choose_layout(cfg, devices * num_nodes, self.resolve_hardware(devices),
                             max_microbatches=self.max_microbatches, strategy_kwargs=self.hybrid4d_kwargs)
        rank_zero_info(format_ranking(plan, self.top))
        self.auto_plan = plan
        chosen = plan.chosen
        strategy = hybrid4d(**chosen.degrees, microbatches=chosen.microbatches, **self.hybrid4d_kwargs)
        record = {"strategy": STRATEGY_NAME, **plan.as_dict()}
        own = strategy.summary_metrics
        # summary.json records what was chosen and estimated next to what was measured (instance-level, so
        # the pipeline strategy's own summary entries stay).
        strategy.summary_metrics = lambda trainer: {**own(trainer), "auto_plan": record}
        return strategy
