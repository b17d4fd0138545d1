"""Dynamic loss scaling for fp16 training, with PaddlePaddle Fleet's rule and knobs.

fp16 represents magnitudes down to about 6e-8 (subnormal) and up to 65504: small gradients underflow to
zero. Multiplying the loss by a large factor S lifts the gradients into range; they are divided by S
again before the optimizer step. If any gradient overflowed (inf/NaN), the step is skipped on every rank
and, after ``decr_every_n_nan_or_inf`` such steps in a row, S shrinks by ``decr_ratio``; after
``incr_every_n_steps`` good steps in a row it grows by ``incr_ratio`` (Paddle's ``update_loss_scaling``
op; torch's ``GradScaler`` shrinks on every overflow instead). The overflow check is all-reduced over all
ranks: with sharded gradients (ZeRO, tensor parallel) each rank sees only its part, and ranks that
disagree about skipping would diverge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.distributed as dist

from parallelkit.distributed.comm_counting import counting
from parallelkit.distributed.comm_stats import CommStats
from parallelkit.errors import ConfigError


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


@dataclass
class DynamicLossScaler:
    """Loss scale state and update rule (see the module docstring).

    Example::

        scaler = DynamicLossScaler(init_loss_scaling=2.0**15)
        (scaler.scale * loss).backward()
        if scaler.unscale_and_check(params):   # True: finite on every rank
            optimizer.step()
        scaler.update()
    """

    init_loss_scaling: float = 32768.0
    incr_every_n_steps: int = 1000
    decr_every_n_nan_or_inf: int = 2
    incr_ratio: float = 2.0
    decr_ratio: float = 0.5
    use_dynamic_loss_scaling: bool = True
    min_loss_scaling: float = 1.0
    group: Any = None
    comm_stats: CommStats | None = None
    scale: float = field(init=False)
    good_steps: int = field(init=False, default=0)
    bad_steps: int = field(init=False, default=0)
    skipped_steps: int = field(init=False, default=0)
    last_found_inf: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        for name in ("init_loss_scaling", "incr_ratio"):
            if not getattr(self, name) >= 1:
                raise ConfigError(f"callbacks.amp.{name} must be ≥ 1. Got {getattr(self, name)!r}.")
        if not 0 < self.decr_ratio < 1:
            raise ConfigError(f"callbacks.amp.decr_ratio must be in (0, 1). Got {self.decr_ratio!r}.")
        for name in ("incr_every_n_steps", "decr_every_n_nan_or_inf"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"callbacks.amp.{name} must be a positive int. Got {value!r}.")
        self.scale = float(self.init_loss_scaling)

    @torch.no_grad()
    def unscale_and_check(self, params: Iterable[torch.Tensor]) -> bool:
        """Divide every gradient by the scale; return True if all are finite on every rank of ``group``."""
        grads = [_local(p.grad) for p in params if p.grad is not None]
        found = torch.zeros(1)
        if grads:
            inv = 1.0 / self.scale
            for g in grads:
                g.mul_(inv)
            found = torch.stack([(~torch.isfinite(g)).any().float() for g in grads]).max().reshape(1).cpu()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            with counting(self.comm_stats, "amp_found_inf"):
                dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
        self.last_found_inf = bool(found.item() > 0)
        return not self.last_found_inf

    def update(self) -> None:
        """Apply the rule after a step (skipped or not); call once per optimizer step."""
        if self.last_found_inf:
            self.skipped_steps += 1
        if not self.use_dynamic_loss_scaling:
            return
        if self.last_found_inf:
            self.good_steps = 0
            self.bad_steps += 1
            if self.bad_steps == self.decr_every_n_nan_or_inf:
                self.scale = max(self.scale * self.decr_ratio, self.min_loss_scaling)
                self.bad_steps = 0
        else:
            self.bad_steps = 0
            self.good_steps += 1
            if self.good_steps == self.incr_every_n_steps:
                self.scale *= self.incr_ratio
                self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "bad_steps": self.bad_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.bad_steps = int(state["bad_steps"])
        self.skipped_steps = int(state["skipped_steps"])
