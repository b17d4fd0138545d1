"""``callbacks=[hierarchical_allreduce]``: reduce inside nodes, all-reduce among node leaders, broadcast."""

from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
from typing_extensions import override

from parallelkit.callbacks.comm_hook import CommHookCallback
from parallelkit.callbacks.run_summary import log_step_metrics
from parallelkit.distributed.comm_stats import collective_bytes
from parallelkit.distributed.hierarchical_allreduce import INTER, INTRA, build_hierarchical_state, hierarchical_allreduce_hook
from parallelkit.errors import ConfigError

OWNER = "callbacks=[hierarchical_allreduce]"


class HierarchicalAllReduce(CommHookCallback):
    """Average gradients in three stages over groups of ``local_size`` ranks (simulated nodes on one machine).

    Installs :func:`~parallelkit.distributed.hierarchical_allreduce.hierarchical_allreduce_hook` as the
    DDP comm hook (``strategy=ddp``; other strategies, ``single`` included, are refused at setup).
    ``summary.json`` reports the bytes each rank sends inside its group and across groups.

    Args:
        local_size: ranks per group (per node); must divide the data-parallel size.

    Example::

        python train.py callbacks=[hierarchical_allreduce] callbacks.hierarchical_allreduce.local_size=2 trainer.devices=4
    """

    owner = OWNER

    def __init__(self, local_size: int = 2) -> None:
        if not isinstance(local_size, int) or isinstance(local_size, bool) or local_size < 1:
            raise ConfigError(f"callbacks.hierarchical_allreduce.local_size should be an int >= 1 (ranks per node). Got {local_size!r}.")
        super().__init__()
        self.local_size = local_size
        self._grad_bytes = 0
        self._last = (0, 0)

    @override
    def check_degrees(self, dims: Any) -> None:
        if dims.data_parallel_size % self.local_size:
            raise ConfigError(
                f"callbacks.hierarchical_allreduce.local_size={self.local_size} does not divide the {dims.data_parallel_size} "
                "data-parallel ranks into equal groups; use a divisor of it (e.g. local_size=2 with trainer.devices=4)."
            )

    @override
    def dims_at_setup(self, strategy: Any) -> Any:
        return strategy.parallel_dims

    @override
    def build_hook(self, strategy: Any) -> tuple[Callable, Any]:
        return hierarchical_allreduce_hook, build_hierarchical_state(self.local_size, strategy.data_parallel_group, strategy.comm_stats)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._grad_bytes = sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad)
        # What one rank writes in a flat all-reduce of every gradient, on the same backend (framing included).
        self._flat_bytes = collective_bytes(self._grad_bytes, "all_reduce", trainer.strategy.data_parallel_group)

    def _bytes(self, trainer: pl.Trainer) -> tuple[int, int]:
        stats = trainer.strategy.comm_stats
        return stats.bytes(INTRA), stats.bytes(INTER)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._finished_step(trainer) is None:
            return
        now = self._bytes(trainer)
        intra, inter = now[0] - self._last[0], now[1] - self._last[1]
        self._last = now
        log_step_metrics(trainer, {"hierarchical_intra_bytes": intra, "hierarchical_inter_bytes": inter})

    def summary_metrics(self, trainer: pl.Trainer) -> dict[str, Any]:
        import torch

        steps = max(self._steps, 1)
        state = self.state
        world, groups = (state.world_size, state.num_groups) if state else (1, 1)
        intra, inter = self._bytes(trainer)
        # Inter-group traffic of the whole job (summed over ranks): only leaders send across groups.
        totals = trainer.strategy.global_mean(torch.tensor([float(intra), float(inter)], dtype=torch.float64)) * trainer.world_size
        flat = self._flat_bytes
        # A flat ring over consecutive ranks crosses groups on `groups` of its links, each carrying what a
        # rank sends (2(n-1)/n of the gradients); the leaders' ring sends 2(G-1)/G of them per leader.
        flat_inter = groups * flat if groups > 1 else 0.0
        return {"hierarchical_allreduce": {
            "local_size": self.local_size,
            "groups": groups,
            "bytes_sent_per_step": (intra + inter) / steps,  # this (writing) rank, a leader
            "intra_group_bytes_per_step": intra / steps,
            "inter_group_bytes_per_step": inter / steps,
            "job_inter_group_bytes_per_step": float(totals[1]) / steps,
            "flat_ring_job_inter_group_bytes_per_step": flat_inter,
            "dense_bytes_per_step": flat,  # what one rank sends in a flat ring all-reduce
            "compression_ratio": flat_inter * steps / float(totals[1]) if float(totals[1]) else None,  # inter-group only
            "inter_group_ring_steps": 2 * (groups - 1),  # latency terms: slow-link steps per all-reduce
            "flat_ring_steps": 2 * (world - 1),
            "sync_steps": self._steps,
        }}
