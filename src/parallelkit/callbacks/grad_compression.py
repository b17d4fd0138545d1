"""``callbacks=[grad_compression]``: PyTorch's DDP gradient compression hooks (fp16, bf16, PowerSGD), counted."""

from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
from typing_extensions import override

from parallelkit.callbacks.comm_hook import CommHookCallback
from parallelkit.callbacks.replica_state import ReplicaState
from parallelkit.callbacks.run_summary import log_step_metrics
from parallelkit.distributed.comm_hooks import COMPRESSION_METHODS, GRAD_ALLREDUCE, GRAD_HOOK_INPUT, POWERSGD_ALLREDUCE, build_compression_hook
from parallelkit.errors import ConfigError

OWNER = "callbacks=[grad_compression]"
_KINDS = (GRAD_ALLREDUCE, POWERSGD_ALLREDUCE, GRAD_HOOK_INPUT)


class GradCompression(ReplicaState, CommHookCallback):
    """Compress the DDP gradient all-reduce with ``method``:

    - ``fp16``: gradients travel in fp16 (half the bytes; every backend);
    - ``bf16``: torch's ``bf16_compress_hook`` — NCCL only: gloo has no bfloat16 all-reduce, so on CPU the
      callback raises at setup;
    - ``powersgd``: torch's PowerSGD (Vogels et al., NeurIPS 2019): rank-``powersgd_rank`` factors of each
      matrix gradient, with error feedback; plain all-reduce for the first ``start_iter`` steps. Its
      all-reduces are counted exactly (``powersgd_allreduce``).

    Needs a DDP strategy (``strategy=ddp``); others, ``single`` included, are refused at setup.

    PowerSGD's state goes into checkpoints: every rank's own error feedback (gathered to rank 0 at save time:
    :mod:`parallelkit.callbacks.replica_state`), its warm-start factors, step counter and random state, per
    parameter (:mod:`parallelkit.distributed.powersgd_state`), so a resumed run continues exactly. Resumed on
    another number of ranks, the error feedback restarts from zero (one line says so). fp16 and bf16 keep no state.

    Args:
        method: ``fp16``, ``bf16`` or ``powersgd``.
        powersgd_rank: PowerSGD's matrix approximation rank.
        start_iter: PowerSGD's ``start_powerSGD_iter`` (plain all-reduce before it; torch requires > 1
            with error feedback or warm start).
        min_compression_rate: compress a matrix only if this saves at least this factor.
        use_error_feedback / warm_start: PowerSGD's options.

    Example::

        python train.py callbacks=[grad_compression] callbacks.grad_compression.method=powersgd trainer.devices=2
    """

    owner = OWNER

    def __init__(self, method: str = "fp16", powersgd_rank: int = 1, start_iter: int = 10, min_compression_rate: float = 2.0,
                 use_error_feedback: bool = True, warm_start: bool = True) -> None:
        if method not in COMPRESSION_METHODS:
            raise ConfigError(f"callbacks.grad_compression.method should be one of {list(COMPRESSION_METHODS)}. Got {method!r}.")
        if not isinstance(powersgd_rank, int) or isinstance(powersgd_rank, bool) or powersgd_rank < 1:
            raise ConfigError(f"callbacks.grad_compression.powersgd_rank should be an int >= 1. Got {powersgd_rank!r}.")
        if not isinstance(start_iter, int) or start_iter < 0 or ((use_error_feedback or warm_start) and start_iter <= 1 and method == "powersgd"):
            raise ConfigError(f"callbacks.grad_compression.start_iter should be an int > 1 with error feedback or warm start "
                              f"(torch's PowerSGD requires it). Got {start_iter!r}.")
        super().__init__()
        self.method = method
        self.powersgd = {"matrix_approximation_rank": powersgd_rank, "start_powerSGD_iter": start_iter,
                         "min_compression_rate": min_compression_rate, "use_error_feedback": use_error_feedback,
                         "warm_start": warm_start}
        self._last = (0.0, 0.0)
        self._params: dict[str, Any] = {}  # name -> parameter: PowerSGD's state is saved per parameter name

    @override
    def build_hook(self, strategy: Any) -> tuple[Callable, Any]:
        try:
            return build_compression_hook(self.method, strategy.data_parallel_group, strategy.comm_stats,
                                          **(self.powersgd if self.method == "powersgd" else {}))
        except ValueError as err:  # e.g. bf16 on gloo: torch's own words, named after the option that chose it
            raise ConfigError(f"callbacks.grad_compression.method={self.method}: {err}.") from None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._params = dict(pl_module.named_parameters())
        self.restore_replicas(trainer)

    # ---------------------------------------------------------------- per-replica state (callbacks.replica_state)
    @override
    def shared_state(self) -> dict[str, Any]:
        return {"method": self.method}

    @override
    def replica_entry(self, trainer: pl.Trainer) -> dict[str, Any]:
        if self.method != "powersgd":
            return {}
        return self.state.layout.state_by_param(self.state.inner_state, {p: name for name, p in self._params.items()})

    @override
    def restore_entry(self, trainer: pl.Trainer, entry: dict[str, Any]) -> None:
        if self.method == "powersgd" and entry:
            self.state.layout.load_by_param(self.state.inner_state, entry, self._params)

    @override
    def reset_replicas(self, trainer: pl.Trainer, replicas: list) -> str:
        if self.method == "powersgd" and replicas and replicas[0]:
            # rank 0's entry: the factors, counter and random state are the same on every rank, the error is not
            self.state.layout.load_by_param(self.state.inner_state, replicas[0], self._params, keep_error=False)
            return "PowerSGD's error feedback restarts from zero (its warm-start factors and step counter carry over)."
        return "PowerSGD's state restarts from zero."

    @override
    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() if self.method == "powersgd" else {}

    def _bytes(self, trainer: pl.Trainer) -> tuple[float, float]:
        stats = trainer.strategy.comm_stats
        return float(sum(stats.bytes(k) for k in _KINDS)), self.state.dense_bytes

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._finished_step(trainer) is None:
            return
        now = self._bytes(trainer)
        sent, dense = now[0] - self._last[0], now[1] - self._last[1]
        self._last = now
        log_step_metrics(trainer, {"grad_compression_bytes_sent": sent, "grad_compression_ratio": dense / sent if sent else 0.0})

    def summary_metrics(self, trainer: pl.Trainer) -> dict[str, Any]:
        steps = max(self._steps, 1)
        sent, dense = self._bytes(trainer) if self.state else (0.0, 0.0)
        return {"grad_compression": {
            "method": self.method,
            **({k: v for k, v in self.powersgd.items()} if self.method == "powersgd" else {}),
            "bytes_sent_per_step": sent / steps,
            "dense_bytes_per_step": dense / steps,
            "compression_ratio": dense / sent if sent else None,
            "sync_steps": self._steps,
        }}
