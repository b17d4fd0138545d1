"""``callbacks=[amp]``: automatic mixed precision (bf16 or fp16) with dynamic loss scaling, on CPU and GPU.

The callback installs a Lightning precision plugin (:class:`AmpPrecision`) on the strategy before the
strategy sets up: forward runs under ``torch.autocast`` in the chosen dtype with fp32 master weights; for
fp16 the loss is scaled before backward and gradients are unscaled and checked on every rank before the
step (:class:`~parallelkit.distributed.loss_scaling.DynamicLossScaler`). Lightning's own
``precision="16-mixed"`` silently turns into bf16 on CPU; this does what it says on every device.

It needs a strategy that runs forward and backward through the precision plugin (the ``MIXED_PRECISION``
capability): Lightning's own step does, and so does the pipeline's schedule (autocast around each stage's forward,
the scale on the last stage's loss, one overflow check over every rank); DeepSpeed's engine does not.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Generator

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from typing_extensions import override

from parallelkit.callbacks.base import ParallelKitCallback
from parallelkit.callbacks.run_summary import log_step_metrics
from parallelkit.capabilities import MIXED_PRECISION, require_capabilities
from parallelkit.distributed.loss_scaling import DynamicLossScaler
from parallelkit.distributed.precision_lists import apply_precision_lists
from parallelkit.errors import ConfigError
from parallelkit.models.plans import parallel_model

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class AmpPrecision(Precision):
    """Autocast in ``dtype``; with a ``scaler``, scale the loss and skip steps whose gradients overflowed."""

    def __init__(self, device_type: str, dtype: torch.dtype, scaler: DynamicLossScaler | None) -> None:
        self.device_type = device_type
        self.dtype = dtype
        self.scaler = scaler

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with torch.autocast(self.device_type, dtype=self.dtype, cache_enabled=False):
            yield

    @override
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        if self.scaler is not None:
            tensor = tensor * self.scaler.scale
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()  # forward, scaled backward, and the strategy's gradient averaging
        params = [p for group in optimizer.param_groups for p in group["params"]]
        finite = self.scaler.unscale_and_check(params)
        self._after_closure(model, optimizer)  # callbacks and clipping see the true (unscaled) gradients
        step_output = None
        if finite and closure_result is not None:
            step_output = optimizer.step(**kwargs)
        self.scaler.update()
        return step_output if finite else closure_result

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


class AMP(ParallelKitCallback):
    """Mixed precision training with PaddlePaddle Fleet's AMP knobs.

    Args:
        dtype: ``bf16`` or ``fp16``.
        init_loss_scaling, incr_every_n_steps, decr_every_n_nan_or_inf, incr_ratio, decr_ratio,
            use_dynamic_loss_scaling: fp16 loss scaling (see :class:`DynamicLossScaler`); a non-default value
            with ``dtype=bf16`` is an error (bf16 has fp32's range and needs no scaling).
        custom_white_list / custom_black_list: modules forced into half precision / kept in fp32
            (qualified names relative to the model, class names or class paths).

    Example::

        python train.py callbacks=[amp] callbacks.amp.dtype=fp16 trainer.devices=2
    """

    def __init__(
        self,
        dtype: str = "bf16",
        init_loss_scaling: float = 32768.0,
        incr_every_n_steps: int = 1000,
        decr_every_n_nan_or_inf: int = 2,
        incr_ratio: float = 2.0,
        decr_ratio: float = 0.5,
        use_dynamic_loss_scaling: bool = True,
        custom_white_list: list[str] | None = None,
        custom_black_list: list[str] | None = None,
    ) -> None:
        if dtype not in DTYPES:
            raise ConfigError(f"callbacks.amp.dtype must be one of {sorted(DTYPES)}. Got {dtype!r}.")
        self.dtype = dtype
        self.scaling = dict(
            init_loss_scaling=init_loss_scaling,
            incr_every_n_steps=incr_every_n_steps,
            decr_every_n_nan_or_inf=decr_every_n_nan_or_inf,
            incr_ratio=incr_ratio,
            decr_ratio=decr_ratio,
            use_dynamic_loss_scaling=use_dynamic_loss_scaling,
        )
        DynamicLossScaler(**self.scaling)  # validate the knobs now, before any process starts
        if dtype == "bf16":
            changed = [k for k, v in self.scaling.items() if v != DynamicLossScaler.__dataclass_fields__[k].default]
            if changed:
                raise ConfigError(
                    f"callbacks.amp.{changed[0]} only applies to dtype=fp16 (loss scaling); bf16 needs none. Set callbacks.amp.dtype=fp16 or drop it."
                )
        self.white = list(custom_white_list or [])
        self.black = list(custom_black_list or [])
        self.scaler: DynamicLossScaler | None = None
        self.pinned: dict[str, list[str]] = {}
        # fp16 skips steps whose loss or gradients overflow, on purpose: not a divergence (see RunSummary).
        self.skips_nonfinite_steps = dtype == "fp16"

    @override
    def check_strategy(self, strategy: Any, dims: Any = None) -> None:
        """Refuse, before any process starts, a strategy that runs backward outside the precision plugin (DeepSpeed)."""
        require_capabilities(
            strategy,
            f"callbacks=[amp] (dtype={self.dtype})",
            {MIXED_PRECISION: "it wraps the forward in autocast and scales the loss before backward through the strategy's precision plugin"},
            instead="strategy=single, ddp, zero, tp, pp or hybrid4d",
        )

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        self.check_strategy(strategy)
        device_type = strategy.root_device.type
        if self.dtype == "fp16":
            self.scaler = DynamicLossScaler(**self.scaling, comm_stats=getattr(strategy, "comm_stats", None))
        self.pinned = apply_precision_lists(parallel_model(pl_module), device_type, DTYPES[self.dtype], self.white, self.black)
        strategy.precision_plugin = AmpPrecision(device_type, DTYPES[self.dtype], self.scaler)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seen_step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        # One metrics.csv row per optimizer step (not per micro-batch): the scale the step used, after update.
        if self.scaler is not None and trainer.global_step != self._seen_step:
            self._seen_step = trainer.global_step
            log_step_metrics(trainer, {"loss_scale": self.scaler.scale, "skipped_steps": self.scaler.skipped_steps})

    def summary_metrics(self, trainer: pl.Trainer) -> dict[str, Any]:
        amp: dict[str, Any] = {"dtype": self.dtype, "white_listed": self.pinned.get("white", []), "black_listed": self.pinned.get("black", [])}
        if self.scaler is not None:
            amp.update(loss_scale=self.scaler.scale, skipped_steps=self.scaler.skipped_steps)
        return {"amp": amp}
