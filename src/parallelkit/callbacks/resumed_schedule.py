"""A resumed run's learning rate follows the schedule of the command that resumed it, from its first step on.

``optim.schedule.decay_steps`` follows ``trainer.max_steps`` unless set, so a finished run taken further with a
larger ``trainer.max_steps`` resumes under another schedule than the one its checkpoint trained with. Lightning
restores the optimizer's learning rate (the one the *old* schedule set for the next step) and only then steps
the scheduler, whose function is the new one: the first resumed step trained at the old schedule's rate and the
later ones at the new one's, a mixture that no uninterrupted run uses.

Here the learning rate of the next step is recomputed from the restored scheduler's own function at its
restored step, as its next ``step()`` would, so every step s of a resumed run trains at the rate the
uninterrupted run of the same command uses at step s. What "exact" means follows from that:

- the schedule unchanged (a killed run, or ``optim.schedule.decay_steps`` set explicitly and kept): the
  recomputed rate is the restored one, bit for bit; the resume reproduces the uninterrupted run;
- a schedule that gave the same rates to every step the checkpoint trained (those steps all in the warm-up, say)
  but differs after: the run *is* the uninterrupted run of the new command, bit for bit;
- a schedule that differs on steps already trained (a run whose cosine already decayed over its old
  ``trainer.max_steps``): no run can be both; one line names the difference and how to keep the earlier
  schedule instead (set ``optim.schedule.decay_steps`` to its old value: then the run reproduces the
  uninterrupted run with that setting).

The checkpoint records the schedule it trained with (this callback's state) to tell these apart.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from parallelkit.models.module import TrainModule
from parallelkit.optim import SCHEDULE_KEYS


class ResumedSchedule(Callback):
    """On a resume, set the next step's learning rate from the scheduler's own function; say when the schedule
    is not the one the checkpoint's steps were trained with.

    Acts on ``LambdaLR`` schedulers (parallelkit's warm-up + cosine, and a user's own), whose rate is a function
    of the step alone. Example::

        Trainer(callbacks=[ResumedSchedule()]).fit(module, ckpt_path="last.ckpt")
    """

    def __init__(self) -> None:
        self._module: Any = None
        self._trained_with: dict[str, Any] | None = None

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._module = pl_module

    @override
    def state_dict(self) -> dict[str, Any]:
        return _schedule(self._module) or {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._trained_with = dict(state_dict) or None

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        step = trainer.global_step
        if not trainer.ckpt_path or step == 0:
            return
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
                continue
            # LambdaLR.get_lr's expression, at the restored step (get_lr itself warns outside step()).
            rates = [base * factor(scheduler.last_epoch) for factor, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
            for group, rate in zip(scheduler.optimizer.param_groups, rates):
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].fill_(float(rate))
                else:
                    group["lr"] = rate
            scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]  # what get_last_lr() reads
        now = _schedule(pl_module)
        if self._trained_with is None or now is None or set(self._trained_with) != set(now) or self._trained_with == now:
            return
        first = _first_difference(self._trained_with, now, step)
        if first is None:
            return  # every step the checkpoint trained had the rate this schedule gives it: the run is exact
        changed = ", ".join(f"{key}={self._trained_with[key]!r} → {now[key]!r}" for key in SCHEDULE_KEYS if self._trained_with[key] != now[key])
        keep = " ".join(f"optim.schedule.{key}={self._trained_with[key]!r}" for key in SCHEDULE_KEYS if self._trained_with[key] != now[key])
        rank_zero_info(
            f"parallelkit: the checkpoint's steps {first + 1}-{step} trained under another learning-rate schedule "
            f"(optim.schedule {changed}; decay_steps follows trainer.max_steps unless set). Steps {step + 1} on follow this "
            f"run's, so the run equals no uninterrupted one; add {keep} to continue the earlier schedule instead."
        )


def _schedule(module: Any) -> dict[str, Any] | None:
    """``optim.schedule`` as the module holds it (parallelkit's ``TrainModule``); ``None`` for another module."""
    return {key: getattr(module, key) for key in SCHEDULE_KEYS} if isinstance(module, TrainModule) else None


def _first_difference(old: dict[str, Any], new: dict[str, Any], steps: int) -> int | None:
    """The first of the ``steps`` trained steps (0-based: the scheduler's step, whose rate optimizer step s + 1
    uses) to which the two schedules give different rates. ``TrainModule``'s own factor, for each setting."""
    before, after = SimpleNamespace(**old), SimpleNamespace(**new)
    for step in range(steps):
        if TrainModule._lr_factor(before, step) != TrainModule._lr_factor(after, step):
            return step
    return None
