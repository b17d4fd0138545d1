"""Local SGD: ranks step on their own gradients and average their parameters every few steps.

Three schedules (Stich, ICLR 2019; Lin et al., "Don't use large mini-batches, use local SGD", ICLR 2020):

- **fixed**: average every ``k_steps`` optimizer steps;
- **post-local**: fully synchronous data parallel (gradients all-reduced every step, i.e. exactly DDP)
  before ``begin_step``, local steps after it;
- **adaptive**: the period starts at ``k_steps`` and grows as the training loss falls:

      τ = min(max_period, max(τ_prev, ⌈k_steps · √(F₀ / F)⌉))

  where F₀ is the global mean training loss over the first local period and F the mean over the period
  that just ended. The square-root form is AdaComm's (Wang & Joshi, "Adaptive Communication Strategies to
  Achieve the Best Error-Runtime Trade-off in Local-Update SGD", MLSys 2019). AdaComm itself, at a fixed
  learning rate, *shrinks* the period, τ = ⌈√(F/F₀)·τ₀⌉ (its bound trades runtime against the error
  floor, which falls with τ), and grows it only as the learning rate decays (× √(η₀/η)). We grow it as
  the loss falls, as the issue asks and as post-local / stagewise schemes do (Lin et al. 2020; STL-SGD,
  Shen et al., AAAI 2021): once the loss has dropped, the model changes slowly and replicas drift less per
  step. The period never shrinks, so noise in the loss cannot make it oscillate.

During local phases the DDP comm hook returns the local gradient *without any collective* (the counter
shows zero gradient traffic), so the saving is real, not an all-reduce followed by an averaging. The
averaging is one bucketed all-reduce of the parameters (optimizer state stays local, as in torch's
``PeriodicModelAverager``); the loss for the adaptive rule rides in the same all-reduce. A ring all-reduce
gives every rank the same bits, so the replicas are bit-identical right after each averaging.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at run time.

import math
from typing import Any, Iterable, List, Optional

import torch
import torch.distributed as dist

from parallelkit.distributed.comm_counting import counting
from parallelkit.distributed.comm_hooks import counts_own_traffic
from parallelkit.distributed.comm_stats import CommStats

GRAD_ALLREDUCE = "grad_allreduce"
PARAM_AVERAGE = "local_sgd_param_average"


class LocalSGDState:
    """The hook's switch (``sync_grads``) and where it counts."""

    def __init__(self, process_group: Any, stats: Optional[CommStats] = None) -> None:
        self.process_group = process_group
        self.stats = stats
        self.sync_grads = True


@counts_own_traffic
def local_sgd_hook(state: LocalSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket while ``state.sync_grads``; otherwise hand back the local gradient, sending nothing."""
    buffer = bucket.buffer()
    if not state.sync_grads:
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(buffer)
        return future
    world = dist.get_world_size(state.process_group)
    buffer.div_(world)
    with counting(state.stats, GRAD_ALLREDUCE):
        work = dist.all_reduce(buffer, group=state.process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class LocalSGD:
    """Decides when to average, and averages ``params`` over ``group`` (model-agnostic).

    Call :meth:`before_step` before each optimizer step's backward (it turns the gradient all-reduce on or
    off) and :meth:`after_step` after it, with this rank's loss of the step.

    Args:
        params: the replicated parameters to average.
        state: the hook's state (its ``sync_grads`` is driven from here).
        k_steps: the averaging period (the initial one when adaptive).
        begin_step: steps ``< begin_step`` are synchronous (gradients all-reduced): post-local SGD.
        adaptive: grow the period as the loss falls (see the module docstring).
        max_period: the largest adaptive period.

    Example::

        state = LocalSGDState(group, stats)
        ddp = apply_ddp(model, process_group=group, comm_hook=local_sgd_hook, comm_state=state)
        local = LocalSGD(ddp.parameters(), state, k_steps=4)
        for step, batch in enumerate(batches):
            local.before_step(step); loss = ...; loss.backward(); opt.step(); local.after_step(step, loss)
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        state: LocalSGDState,
        *,
        k_steps: int,
        begin_step: int = 0,
        adaptive: bool = False,
        max_period: int = 64,
    ) -> None:
        self.params: List[torch.nn.Parameter] = [p for p in params if p.requires_grad]
        self.state = state
        self.k_steps = int(k_steps)
        self.begin_step = int(begin_step)
        self.adaptive = bool(adaptive)
        self.max_period = int(max_period)
        self.period = self.k_steps
        self.last_sync = self.begin_step  # the local phase counts from here
        self.initial_loss: Optional[float] = None
        self.period_loss_sum = 0.0
        self.period_steps = 0
        self.sync_steps: List[int] = []  # optimizer steps after which parameters were averaged
        self.periods: List[int] = []  # the period in force at each averaging

    def is_local(self, step: int) -> bool:
        return step >= self.begin_step

    def before_step(self, step: int) -> None:
        self.state.sync_grads = not self.is_local(step)

    def due(self, step: int) -> bool:
        """Whether the period ends with optimizer step ``step`` (0-based)."""
        return self.is_local(step) and step + 1 - self.last_sync >= self.period

    def after_step(self, step: int, loss: float, force: bool = False) -> bool:
        """After optimizer step ``step`` (0-based): average if the period is over (or ``force``, e.g. at
        the last step, so the run ends with one model). Returns whether it averaged."""
        if not self.is_local(step):
            return False
        self.period_loss_sum += float(loss)
        self.period_steps += 1
        if not (force or self.due(step)):
            return False
        self.sync(step)
        return True

    def sync(self, step: int) -> None:
        """Average the parameters now, after optimizer step ``step``, whether or not the period is over."""
        mean_loss = average_parameters(self.params, self.state.process_group, self.state.stats,
                                       extra=torch.tensor([self.period_loss_sum / max(self.period_steps, 1)]))
        self.sync_steps.append(step)
        self.periods.append(self.period)
        self.last_sync = step + 1
        self.period_loss_sum, self.period_steps = 0.0, 0
        if self.adaptive:
            self._adapt(float(mean_loss[0]))

    def _adapt(self, loss: float) -> None:
        if self.initial_loss is None:
            self.initial_loss = loss
            return
        if loss <= 0 or not math.isfinite(loss):
            return  # the rule needs a positive loss; keep the period
        grown = math.ceil(self.k_steps * math.sqrt(self.initial_loss / loss) - 1e-9)
        self.period = min(self.max_period, max(self.period, grown))

    def state_dict(self) -> dict:
        """The schedule, the same on every rank. This rank's own ``period_loss_sum`` (the adaptive rule's running
        loss) is not in it: it differs between ranks, and is saved per replica (``callbacks.local_sgd``)."""
        return {"period": self.period, "last_sync": self.last_sync, "initial_loss": self.initial_loss,
                "sync_steps": list(self.sync_steps), "periods": list(self.periods), "period_steps": self.period_steps}

    def load_state_dict(self, state: dict) -> None:
        self.period = state["period"]
        self.last_sync = state["last_sync"]
        self.initial_loss = state["initial_loss"]
        self.sync_steps = list(state["sync_steps"])
        self.periods = list(state["periods"])
        self.period_steps = state.get("period_steps", 0)  # absent from checkpoints written before it was saved


@torch.no_grad()
def average_parameters(
    params: List[torch.nn.Parameter],
    group: Any,
    stats: Optional[CommStats] = None,
    extra: Optional[torch.Tensor] = None,
) -> Optional[torch.Tensor]:
    """Replace each parameter by its mean over ``group``, in one flat all-reduce per dtype.

    ``extra`` (a small float tensor, e.g. this rank's loss) rides along and comes back averaged.
    """
    world = dist.get_world_size(group)
    by_dtype: dict = {}
    for param in params:
        by_dtype.setdefault(param.dtype, []).append(param)
    averaged_extra = None
    for dtype, group_params in by_dtype.items():
        parts = [p.detach().reshape(-1) for p in group_params]
        carry = extra is not None and averaged_extra is None
        if carry:
            parts.append(extra.to(dtype).reshape(-1))
        flat = torch.cat(parts)
        with counting(stats, PARAM_AVERAGE):
            dist.all_reduce(flat, group=group)
        flat.div_(world)
        offset = 0
        for param in group_params:
            param.copy_(flat[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        if carry:
            averaged_extra = flat[offset:].clone()
    return averaged_extra
