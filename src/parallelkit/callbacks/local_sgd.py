"""``callbacks=[local_sgd]``: Local SGD (fixed period, post-local, adaptive) on a DDP strategy."""

from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from parallelkit.callbacks.comm_hook import CommHookCallback
from parallelkit.callbacks.replica_state import ReplicaState
from parallelkit.callbacks.run_summary import log_step_metrics
from parallelkit.capabilities import DDP_COMM_HOOK, REPLICATED_PARAMS
from parallelkit.distributed.comm_stats import collective_bytes
from parallelkit.distributed.local_sgd import GRAD_ALLREDUCE, PARAM_AVERAGE, LocalSGD, LocalSGDState, local_sgd_hook
from parallelkit.errors import ConfigError

OWNER = "callbacks=[local_sgd]"


class LocalSGDCallback(ReplicaState, CommHookCallback):
    """Ranks step on their own gradients and average parameters every ``k_steps`` optimizer steps.

    Installs :func:`~parallelkit.distributed.local_sgd.local_sgd_hook` as the DDP comm hook, which sends
    nothing during local phases (the gradient all-reduce is really off), and averages the parameters after
    the period's last step; see :mod:`parallelkit.distributed.local_sgd` for the adaptive rule and its
    source. Needs DDP (``strategy=ddp``): a comm hook to switch off, and full parameter replicas to average.
    ``strategy=single`` is refused (one process has nothing to average). The last step always averages, so
    the run ends with one model (the checkpoint and the final validation see it). Meant for momentum SGD
    (``optim=sgd``); with Adam-type optimizers it warns (their normalised steps partly cancel in the average).

    Checkpoints hold the schedule and every rank's own parameters, optimizer state and running period loss
    (gathered to rank 0 at save time: :mod:`parallelkit.callbacks.replica_state`), so a run resumed mid-period
    continues exactly; so does a finished run taken further (its final checkpoint holds the replicas as they were
    before the end-of-run averaging, and the averaged model). Resumed on another number of ranks, every rank
    starts from the mean of the saved replicas' parameters with rank 0's optimizer state (one line says so).

    Args:
        k_steps: averaging period in optimizer steps (the initial period when ``adaptive``).
        begin_step: fully synchronous DDP before this step (post-local SGD); 0 = local from the start.
        adaptive: grow the period as the training loss falls, up to ``max_period``.
        max_period: the largest adaptive period.

    Example::

        python train.py callbacks=[local_sgd] callbacks.local_sgd.k_steps=8 callbacks.local_sgd.begin_step=100 trainer.devices=2
    """

    owner = OWNER
    needs = {
        DDP_COMM_HOOK: "it switches the gradient all-reduce off during local steps through a DDP comm hook",
        REPLICATED_PARAMS: "it averages full parameter replicas",
    }

    def __init__(self, k_steps: int = 4, begin_step: int = 0, adaptive: bool = False, max_period: int = 64) -> None:
        for name, value, low in (("k_steps", k_steps, 1), ("begin_step", begin_step, 0), ("max_period", max_period, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"callbacks.local_sgd.{name} should be an int >= {low}. Got {value!r}.")
        if max_period < k_steps:
            raise ConfigError(f"callbacks.local_sgd.max_period ({max_period}) should be >= k_steps ({k_steps}).")
        if not adaptive and max_period != 64:
            raise ConfigError("callbacks.local_sgd.max_period only applies with adaptive=true; set adaptive=true or leave max_period at 64.")
        super().__init__()
        self.k_steps = k_steps
        self.begin_step = begin_step
        self.adaptive = bool(adaptive)
        self.max_period = max_period
        self.local: LocalSGD | None = None
        self._loaded: dict | None = None
        self._step_loss = 0.0
        self._sent = 0.0
        self._dense_step_bytes = 0.0
        self._last_bytes = 0

    # ---------------------------------------------------------------- setup
    @override
    def build_hook(self, strategy: Any) -> tuple[Callable, LocalSGDState]:
        return local_sgd_hook, LocalSGDState(strategy.data_parallel_group, strategy.comm_stats)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = [p for p in pl_module.parameters() if p.requires_grad]
        self.local = LocalSGD(params, self.state, k_steps=self.k_steps, begin_step=self.begin_step,
                              adaptive=self.adaptive, max_period=self.max_period)
        if self._loaded:
            self.local.load_state_dict(self._loaded.get("schedule", self._loaded))  # before: the schedule alone
        self.restore_replicas(trainer)
        # What plain DDP's gradient all-reduce writes per step on the same backend (framing included).
        grad_bytes = sum(p.numel() * p.element_size() for p in params)
        self._dense_step_bytes = collective_bytes(grad_bytes, "all_reduce", trainer.strategy.data_parallel_group)
        self._last_bytes = self._bytes(trainer)
        if any("betas" in group for opt in trainer.optimizers for group in opt.param_groups):
            # Adam's steps are normalised per coordinate: where the ranks' gradients disagree in sign their
            # steps cancel in the average, which acts like a smaller learning rate (measured: docs/communication.md).
            rank_zero_warn("Local SGD with an Adam-type optimizer: averaging the ranks' normalised steps trains slower "
                           "than DDP's Adam on averaged gradients, even with k_steps=1. Momentum SGD (optim=sgd) averages "
                           "exactly like DDP at k_steps=1.")
        rank_zero_info(f"Local SGD: synchronous before step {self.begin_step}, then averaging every "
                       f"{self.k_steps} steps" + (f", growing up to {self.max_period} as the loss falls." if self.adaptive else "."))

    def _bytes(self, trainer: pl.Trainer) -> int:
        stats = trainer.strategy.comm_stats
        return stats.bytes(GRAD_ALLREDUCE) + stats.bytes(PARAM_AVERAGE)

    # ---------------------------------------------------------------- per step
    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.local.before_step(trainer.global_step)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:  # Lightning scales micro-batch losses by 1/accumulate: their sum is the step's mean
            self._step_loss += float(loss.detach())
        step = self._finished_step(trainer)
        if step is None:
            return
        last = trainer.max_steps is not None and 0 < trainer.max_steps <= trainer.global_step
        synced = self.local.after_step(step, self._step_loss)
        self._step_loss = 0.0
        if last and not synced and self.local.is_local(step):
            self._end_with_one_model(trainer, step)
            synced = True
        now = self._bytes(trainer)
        sent, self._last_bytes = now - self._last_bytes, now
        self._sent += sent
        log_step_metrics(trainer, {"local_sgd_synced": float(synced), "local_sgd_period": float(self.local.period),
                                   "local_sgd_bytes_sent": float(sent)})

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.local is not None and self.local.last_sync < trainer.global_step and self.local.is_local(trainer.global_step - 1):
            # stopped before max_steps (e.g. max_epochs): still end with one model
            self._end_with_one_model(trainer, trainer.global_step - 1)

    def _end_with_one_model(self, trainer: pl.Trainer, step: int) -> None:
        """Average because the run ends here, not because the period is over: the checkpoint of this step keeps
        the replicas as the uninterrupted run has them (a run taken further continues exactly)."""
        self.hold_for_continuation(trainer)
        self.local.sync(step)

    def summary_metrics(self, trainer: pl.Trainer) -> dict[str, Any]:
        steps = max(self._steps, 1)
        local = self.local
        synchronous = min(self.begin_step, self._steps)
        return {"local_sgd": {
            "bytes_sent_per_step": self._sent / steps,
            "dense_bytes_per_step": self._dense_step_bytes,
            "compression_ratio": self._dense_step_bytes * steps / self._sent if self._sent else None,
            "sync_steps": len(local.sync_steps) if local else 0,  # parameter averagings
            "synchronous_steps": synchronous,  # steps with a gradient all-reduce (before begin_step)
            "averaged_after_steps": list(local.sync_steps) if local else [],
            "periods": list(local.periods) if local else [],
            "final_period": local.period if local else None,
            "adaptive": self.adaptive,
        }}

    # ---------------------------------------------------------------- per-replica state (callbacks.replica_state)
    @override
    def shared_state(self) -> dict[str, Any]:
        return {"schedule": self.local.state_dict()}

    @override
    def replica_entry(self, trainer: pl.Trainer) -> dict[str, Any]:
        return {"params": [p.detach().clone() for p in self.local.params],
                "optimizer": [opt.state_dict() for opt in trainer.optimizers],
                "period_loss_sum": self.local.period_loss_sum}

    @override
    def restore_entry(self, trainer: pl.Trainer, entry: dict[str, Any]) -> None:
        # Lightning loaded rank 0's parameters and optimizer state on every rank: put this replica's own back
        with torch.no_grad():
            for p, saved in zip(self.local.params, entry["params"], strict=True):
                p.copy_(saved)
        for opt, saved in zip(trainer.optimizers, entry["optimizer"], strict=True):
            opt.load_state_dict(saved)
        self.local.period_loss_sum = entry["period_loss_sum"]

    @override
    def reset_replicas(self, trainer: pl.Trainer, replicas: list) -> str:
        if not replicas:
            return "every rank continues from rank 0's parameters and optimizer state."
        with torch.no_grad():
            for i, p in enumerate(self.local.params):
                p.copy_(torch.stack([r["params"][i] for r in replicas]).mean(0))
        self.local.period_loss_sum = sum(r["period_loss_sum"] for r in replicas) / len(replicas)
        return (f"every rank continues from the mean of the {len(replicas)} saved replicas' parameters, with rank 0's "
                "optimizer state (the averaging schedule carries on).")
