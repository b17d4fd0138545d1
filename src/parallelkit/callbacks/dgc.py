"""``callbacks=[dgc]``: Deep Gradient Compression on the data-parallel gradient all-reduce."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from parallelkit.callbacks.comm_hook import CommHookCallback
from parallelkit.callbacks.replica_state import ReplicaState
from parallelkit.callbacks.run_summary import log_step_metrics
from parallelkit.distributed.dgc import DEFAULT_SPARSITY, DGCState, dgc_hook
from parallelkit.errors import ConfigError

OWNER = "callbacks=[dgc]"


class DeepGradientCompression(ReplicaState, CommHookCallback):
    """Send only the top ``1 − sparsity`` of each rank's accumulated gradient (Lin et al., ICLR 2018).

    Installs :func:`~parallelkit.distributed.dgc.dgc_hook` as the strategy's DDP comm hook, so it needs a
    strategy that averages gradients with DDP (``strategy=ddp``); other strategies are refused at setup,
    ``strategy=single`` included (one process sends nothing, so there is nothing to compress).

    Momentum correction moves the optimizer's momentum into the hook: it needs ``torch.optim.SGD`` with
    ``momentum > 0`` (``optim=sgd``), whose momentum the callback takes over and sets to 0 in the optimizer
    (as PaddlePaddle's ``DGCMomentumOptimizer`` does). ``momentum_correction=null`` turns it on for such an
    optimizer and off otherwise (AdamW has no momentum to move: the residual accumulates raw gradients).

    Checkpoints hold every rank's own residuals and momenta (gathered to rank 0 at save time:
    :mod:`parallelkit.callbacks.replica_state`), so a resumed run continues exactly; resumed on another number of
    ranks, both restart from zero (one line says so).

    Args:
        sparsity: the warm-up list; its last value is the steady-state sparsity.
        rampup_begin_step: optimizer steps before it are dense.
        rampup_steps: steps over which the list is walked in equal shares.
        warmup: walk the list; ``False`` starts at the last value.
        momentum_correction: ``True``, ``False`` or ``None`` (auto, see above).
        momentum_masking: zero the momentum of sent coordinates; ``None`` = whenever momentum correction is on.
        local_clip_norm: clip each tensor's local gradient to this norm / √ranks before accumulating (None: off).
        dense_min_numel: tensors with fewer elements are averaged densely.

    Example::

        python train.py callbacks=[dgc] optim=sgd callbacks.dgc.sparsity=[0.75,0.99,0.999] trainer.devices=2
    """

    owner = OWNER

    def __init__(
        self,
        sparsity: Sequence[float] = DEFAULT_SPARSITY,
        rampup_begin_step: int = 0,
        rampup_steps: int = 100,
        warmup: bool = True,
        momentum_correction: bool | None = None,
        momentum_masking: bool | None = None,
        local_clip_norm: float | None = None,
        dense_min_numel: int = 0,
    ) -> None:
        sparsity = list(sparsity) if not isinstance(sparsity, (int, float)) else [sparsity]
        if not sparsity or any(not isinstance(s, (int, float)) or not 0 <= s < 1 for s in sparsity):
            raise ConfigError(f"callbacks.dgc.sparsity should be a list of fractions in [0, 1), e.g. [0.75,0.9375,0.999]. Got {sparsity!r}.")
        if any(b < a for a, b in zip(sparsity, sparsity[1:])):
            raise ConfigError(f"callbacks.dgc.sparsity should not decrease (it is a warm-up ramp). Got {sparsity!r}.")
        for name, value in (("rampup_begin_step", rampup_begin_step), ("rampup_steps", rampup_steps), ("dense_min_numel", dense_min_numel)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"callbacks.dgc.{name} should be an int >= 0. Got {value!r}.")
        if local_clip_norm is not None and (not isinstance(local_clip_norm, (int, float)) or local_clip_norm <= 0):
            raise ConfigError(f"callbacks.dgc.local_clip_norm should be a number > 0 or null. Got {local_clip_norm!r}.")
        if momentum_correction is False and momentum_masking:
            raise ConfigError("callbacks.dgc.momentum_masking=true needs momentum correction (it masks the momentum the hook keeps); "
                              "set callbacks.dgc.momentum_correction=true (with optim=sgd) or momentum_masking=null.")
        super().__init__()
        self.sparsity = [float(s) for s in sparsity]
        self.rampup_begin_step = rampup_begin_step
        self.rampup_steps = rampup_steps
        self.warmup = bool(warmup)
        self.momentum_correction = momentum_correction
        self.momentum_masking = momentum_masking
        self.local_clip_norm = local_clip_norm
        self.dense_min_numel = dense_min_numel
        self.state: DGCState | None = None
        self._optimizer_momentum: float | None = None  # taken over from the optimizer (kept for resume)
        self._params: dict[str, Any] = {}  # name -> parameter: the hook's per-parameter state, saved by name
        self._sent = 0.0
        self._dense = 0.0
        self._steady_sent = 0.0
        self._steady_dense = 0.0
        self._compressed_steps = 0

    # ---------------------------------------------------------------- setup
    @override
    def build_hook(self, strategy: Any) -> tuple[Callable, DGCState]:
        return dgc_hook, DGCState(
            strategy.data_parallel_group,
            sparsity=self.sparsity,
            rampup_begin_step=self.rampup_begin_step,
            rampup_steps=self.rampup_steps,
            warmup=self.warmup,
            momentum=0.0,  # set in on_train_start, once the optimizer exists
            momentum_masking=False,
            clip_norm=self.local_clip_norm,
            dense_min_numel=self.dense_min_numel,
            stats=strategy.comm_stats,
        )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        momentum = self._take_over_momentum(trainer)
        self.state.momentum = momentum
        self.state.momentum_masking = momentum > 0 and self.momentum_masking is not False
        self._params = dict(pl_module.named_parameters())
        self.restore_replicas(trainer)
        rank_zero_info(
            f"DGC: sparsity {self.sparsity} from step {self.rampup_begin_step} over {self.rampup_steps} steps; "
            f"momentum correction {'on (m=%g)' % momentum if momentum else 'off'}, "
            f"masking {'on' if self.state.momentum_masking else 'off'}, local clipping {self.local_clip_norm or 'off'}."
        )
        self._warn_if_short(trainer.max_steps)

    def _warn_if_short(self, max_steps: int | None) -> None:
        """At sparsity s a coordinate is sent about once per 1/(1 − s) steps: a run with few such periods lags dense."""
        final = self.sparsity[-1]
        if not max_steps or max_steps < 0 or final <= 0:
            return
        steps = max(0, max_steps - self.rampup_begin_step - (self.rampup_steps if self.warmup else 0))
        sends = steps * (1 - final)
        if sends < 10:
            rank_zero_warn(
                f"DGC at sparsity {final:g} sends each coordinate about once per {1 / (1 - final):,.0f} steps, and this run "
                f"has {steps} steps at that sparsity (about {sends:.1f} sends per coordinate). Expect its loss to lag dense "
                "DDP's: on bench/comm_efficiency.py the gap closed only after about ten sends per coordinate (the paper's "
                "runs are tens of thousands of steps). See docs/communication.md."
            )

    def _take_over_momentum(self, trainer: pl.Trainer) -> float:
        if self.momentum_correction is False:
            return 0.0
        if len(trainer.optimizers) != 1:
            raise ConfigError(f"{OWNER} with momentum correction supports one optimizer; got {len(trainer.optimizers)}.")
        optimizer = trainer.optimizers[0]
        groups = optimizer.param_groups
        has_momentum = all("momentum" in g and "nesterov" in g for g in groups)  # SGD's keys
        momenta = {float(g["momentum"]) for g in groups} if has_momentum else set()
        if self._optimizer_momentum is not None and momenta == {0.0}:
            momenta = {self._optimizer_momentum}  # resumed: the optimizer's momentum was already taken over
        if not has_momentum or momenta == {0.0}:
            if self.momentum_correction:
                raise ConfigError(
                    f"callbacks.dgc.momentum_correction=true needs torch.optim.SGD with momentum > 0 (optim=sgd), "
                    f"but the optimizer is {type(optimizer).__name__}"
                    + (" without momentum" if has_momentum else "") + ". Use optim=sgd, or momentum_correction=null/false."
                )
            if self.momentum_masking:
                raise ConfigError(f"callbacks.dgc.momentum_masking=true has no momentum to mask with {type(optimizer).__name__}; "
                                  "use optim=sgd or momentum_masking=null.")
            if self.momentum_correction is None:
                rank_zero_warn(f"DGC with {type(optimizer).__name__}: no SGD momentum to correct, so the residual accumulates raw "
                               "gradients (the paper's setting is momentum SGD: optim=sgd). Expect a larger loss gap on short runs.")
            return 0.0
        if len(momenta) != 1 or any(g["nesterov"] for g in groups) or any(g.get("weight_decay", 0) for g in groups):
            raise ConfigError(
                f"{OWNER}: momentum correction moves SGD's momentum into the comm hook, which needs one momentum for "
                "all parameter groups, nesterov=false and weight_decay=0 (weight decay would otherwise skip the "
                f"momentum). Got momentum {sorted(momenta)}, nesterov {[g['nesterov'] for g in groups]}, "
                f"weight_decay {[g.get('weight_decay', 0) for g in groups]}. Or set callbacks.dgc.momentum_correction=false."
            )
        momentum = momenta.pop()
        for group in groups:
            group["momentum"] = 0.0  # the hook applies it now, before compression
        self._optimizer_momentum = momentum
        return momentum

    # ---------------------------------------------------------------- per step
    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.state.begin_step(trainer.global_step)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = self._finished_step(trainer)
        if step is None:
            return
        sent, dense = self.state.step_sent_bytes, self.state.step_dense_bytes
        self._sent += sent
        self._dense += dense
        sparsity = self.state.sparsity_at(step)
        if sparsity > 0:
            self._compressed_steps += 1
        if sparsity == self.sparsity[-1]:
            self._steady_sent += sent
            self._steady_dense += dense
        log_step_metrics(trainer, {"dgc_sparsity": sparsity, "dgc_bytes_sent": sent,
                                   "dgc_compression_ratio": dense / sent if sent else 0.0})

    def summary_metrics(self, trainer: pl.Trainer) -> dict[str, Any]:
        steps = max(self._steps, 1)
        return {"dgc": {
            "bytes_sent_per_step": self._sent / steps,
            "dense_bytes_per_step": self._dense / steps,
            "compression_ratio": self._dense / self._sent if self._sent else None,
            # after warm-up only: the figure the paper reports
            "compression_ratio_after_warmup": self._steady_dense / self._steady_sent if self._steady_sent else None,
            "sync_steps": self._steps,  # DGC communicates every step (sparsely)
            "compressed_steps": self._compressed_steps,
            "final_sparsity": self.state.sparsity_at(trainer.global_step - 1) if self.state else None,
            "momentum_correction": self.state.momentum if self.state else None,
            "momentum_masking": self.state.momentum_masking if self.state else None,
            "local_clip_norm": self.local_clip_norm,
        }}

    # ---------------------------------------------------------------- per-replica state (callbacks.replica_state)
    @override
    def shared_state(self) -> dict[str, Any]:
        return {"optimizer_momentum": self._optimizer_momentum}

    @override
    def replica_entry(self, trainer: pl.Trainer) -> dict[str, Any]:
        names = {p: name for name, p in self._params.items()}
        return {key: {names[p]: t.clone() for p, t in store.items()}
                for key, store in (("residuals", self.state.velocity), ("momenta", self.state.momentum_buffer))}

    @override
    def restore_entry(self, trainer: pl.Trainer, entry: dict[str, Any]) -> None:
        for key, store in (("residuals", self.state.velocity), ("momenta", self.state.momentum_buffer)):
            store.clear()
            store.update({self._params[name]: t.clone() for name, t in entry[key].items()})

    @override
    def reset_replicas(self, trainer: pl.Trainer, replicas: list) -> str:
        self.state.velocity.clear()
        self.state.momentum_buffer.clear()
        return "the residuals" + (" and momenta" if self.state.momentum else "") + " restart from zero."

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._optimizer_momentum = state_dict.get("optimizer_momentum")
