"""What every parallelkit strategy offers on top of Lightning's: planned degrees, a mesh, counted traffic.

A strategy *plans* before any process starts (``plan(world_size, accelerator)`` validates the degrees
and returns :class:`ParallelDims`), and builds its mesh once the process group exists. Callbacks and
``parallelkit.run`` ask these capabilities, never the strategy's type.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from typing_extensions import override

from parallelkit.capabilities import DDP_COMM_HOOK, LIGHTNING_BACKWARD, REPLICATED_PARAMS, SERVER_TABLES, SPARSE_GRADIENTS, require_capabilities
from parallelkit.distributed.comm_counting import counting
from parallelkit.process_stats import model_state_bytes, os_bytes_written  # noqa: F401 - model_state_bytes: strategies import it from here
from parallelkit.distributed.comm_stats import REPORT, TRAIN, VALIDATION, CommStats
from parallelkit.distributed.parallel_dims import ParallelDims
from parallelkit.errors import ConfigError
from parallelkit.strategy_protocol import StrategyProtocol

# The capabilities moved to parallelkit.capabilities (callbacks import them without importing the strategies);
# they stay importable from here for code written against this module.
__all__ = ["DDP_COMM_HOOK", "LIGHTNING_BACKWARD", "METRICS", "REPLICATED_PARAMS", "SERVER_TABLES", "SPARSE_GRADIENTS",
           "ParallelKitStrategyMixin", "model_state_bytes", "require_capabilities"]

METRICS = "metrics"


class ParallelKitStrategyMixin(StrategyProtocol):
    """Mixed into each parallelkit strategy before its Lightning base class: the run protocol
    (:class:`~parallelkit.strategy_protocol.StrategyProtocol`), planned degrees, capabilities, counted traffic."""

    # The methods Lightning's Strategy also has (reduce, all_gather, on_train_start, ...) carry no @override: they
    # override the Lightning class that follows this mixin in each strategy's bases, not a base of the mixin.

    #: the name used by ``strategy=NAME`` and written to ``summary.json``.
    strategy_name: str = "?"
    #: the largest world the strategy can use (None: any).
    max_world_size: int | None = None
    #: what callbacks may rely on (the names in :mod:`parallelkit.capabilities`).
    capabilities: frozenset[str] = frozenset({LIGHTNING_BACKWARD})

    def save_directory_atomically(self, filepath: Any, write: Callable[[Path], None]) -> None:
        """Write a checkpoint directory (shards of every rank) under a temporary name, then swap it in.

        A failed write (a full disk) or a process killed while writing leaves the previous checkpoint of that
        name intact: ``write(NAME.tmp)`` runs on every rank, and only after a barrier does rank 0 rename
        ``NAME.tmp`` to ``NAME`` (the old one moved aside first, removed after). A partial ``NAME.tmp`` is
        removed, by rank 0, when the write fails there or before the next write.
        """
        final = Path(self.broadcast(str(filepath)))
        tmp = final.with_name(final.name + ".tmp")
        if self.is_global_zero and tmp.exists():
            shutil.rmtree(tmp)  # a previous writer died here
        self.barrier()
        try:
            write(tmp)
        except BaseException:
            if self.is_global_zero:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.barrier()
        if self.is_global_zero:
            old = final.with_name(final.name + ".old")
            if final.exists():
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old) if final.is_dir() else final.replace(old)
            tmp.rename(final)
            if old.is_dir():
                shutil.rmtree(old)
            elif old.exists():
                old.unlink()
        self.barrier()

    def _init_parallelkit(self) -> None:
        if self._checkpoint_io is None:  # a checkpoint file is renamed into place whole (a full disk leaves the old one)
            from parallelkit.run_dir import AtomicCheckpointIO

            self._checkpoint_io = AtomicCheckpointIO()
        self.comm_stats = CommStats()
        self._first_step = 0
        self._parallel_dims: ParallelDims | None = None
        self.device_mesh = None

    # ---------------------------------------------------------------- planning (before launch)
    @override
    def plan(self, world_size: int) -> ParallelDims:
        """Validate the requested degrees for ``world_size`` processes (raises :class:`ConfigError`)."""
        if self.max_world_size is not None and world_size > self.max_world_size:
            raise ConfigError(
                f"strategy={self.strategy_name} runs at most {self.max_world_size} process(es), but "
                f"trainer.devices × trainer.num_nodes = {world_size}. Use trainer.devices=1, or a distributed "
                "strategy such as strategy=ddp."
            )
        return self._requested_dims(world_size)

    def _requested_dims(self, world_size: int) -> ParallelDims:
        return ParallelDims.from_degrees(world_size, dp=-1)

    @property
    def parallel_dims(self) -> ParallelDims:
        if self._parallel_dims is None:
            self._parallel_dims = self.plan(self.world_size)
        return self._parallel_dims

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data is sharded by the data-parallel rank (tensor/pipeline peers read the same batch), not the global rank."""
        dims = self.parallel_dims
        return {"num_replicas": dims.data_parallel_size, "rank": dims.data_parallel_rank(self.global_rank)}

    # ---------------------------------------------------------------- run-time capabilities
    def supports(self, capability: str) -> bool:
        """Whether this strategy (as configured) offers ``capability`` (a name in :mod:`parallelkit.capabilities`)."""
        return capability in self.capabilities

    def global_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mean of a per-rank metric over all ranks (counted as ``metrics`` traffic)."""
        return self._counted_reduce(tensor, "mean")

    def global_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Max over all ranks (counted as ``metrics`` traffic: periodic checkpoints agree through it while training)."""
        return self._counted_reduce(tensor, "max")

    def _counted_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return self.reduce(tensor.clone(), reduce_op=op)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Lightning's reduce (``self.log(..., sync_dist=True)``, the metrics above), counted: a barrier, then an all-reduce."""
        if isinstance(tensor, torch.Tensor) and self.world_size > 1:
            group = group if group is not None else self.report_group
        with counting(self.comm_stats, METRICS):
            return super().reduce(tensor, group, reduce_op)

    @property
    def report_group(self) -> Any:
        """The ranks that train and report together (``None``: all of them; the parameter server: its workers)."""
        return None

    # ---------------------------------------------------------------- validation is not training traffic
    def on_train_start(self) -> None:
        self._first_step = self.lightning_module.trainer.global_step  # a resumed run starts at its checkpoint's step
        super().on_train_start()

    def on_validation_start(self) -> None:
        self.comm_stats.phase = VALIDATION  # Lightning calls this around every validation (and sanity) pass
        super().on_validation_start()

    def on_validation_end(self) -> None:
        super().on_validation_end()
        self.comm_stats.phase = TRAIN

    @override
    def summary_metrics(self, trainer: Any) -> dict[str, Any]:
        """``comm_by_rank`` and ``comm_validation`` (see :meth:`comm_report`); subclasses add their own entries."""
        return self.comm_report(trainer)

    def comm_report(self, trainer: Any) -> dict[str, Any]:
        """Per rank: the training traffic counted and the bytes its process handed to the kernel; validation apart.

        ``comm.bytes_sent_per_step`` in ``summary.json`` is rank 0's count; ranks differ (pipeline stages, group
        leaders), and ``os_bytes_written`` (a max over ranks) cannot say whose. This gathers both per rank, so a
        run can be checked against what each process really wrote (tests/integration/test_wire_traffic.py).
        """
        import torch.distributed as dist


        stats = self.comm_stats
        steps = max(getattr(trainer, "global_step", 0) - self._first_step, 1)  # this process's steps, as RunSummary divides
        local = torch.tensor([stats.bytes(), stats.calls(), stats.bytes(phase=VALIDATION), stats.calls(phase=VALIDATION),
                              float(os_bytes_written())], dtype=torch.float64)
        group = self.report_group
        rows = [local]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            rows = [torch.zeros_like(local) for _ in range(dist.get_world_size(group))]
            with stats.counting_as(REPORT), counting(stats, METRICS):
                dist.all_gather(rows, local, group=group)
        validation = stats.totals(VALIDATION)
        return {
            "comm_by_rank": {
                "steps": steps,
                "bytes_sent_per_step": [float(r[0]) / steps for r in rows],
                "collectives_per_step": [float(r[1]) / steps for r in rows],
                "validation_bytes_sent": [int(r[2]) for r in rows],
                "os_bytes_written": [int(r[4]) for r in rows],  # whole process life so far (RunSummary's os_bytes_written is their max)
            },
            # Validation passes of this run, rank 0 (not in comm.bytes_sent_per_step: that is a training step's).
            "comm_validation": {"bytes_sent": validation["bytes"], "collectives": validation["collectives"], "by_kind": validation["by_kind"]},
        }

    def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Lightning's ``all_gather`` (stacked over ranks); without gradients through :func:`gather_stacked`."""
        import torch.distributed as dist

        from parallelkit.distributed.collectives import gather_stacked

        if sync_grads or not isinstance(tensor, torch.Tensor) or not (dist.is_available() and dist.is_initialized()):
            return super().all_gather(tensor, group, sync_grads)
        return gather_stacked(tensor, group)

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state that this rank holds right now."""
        return model_state_bytes(self.lightning_module, self.optimizers)

