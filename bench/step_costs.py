"""What each piece of per-step machinery costs, timed in place (bench only, for the overhead analysis).

:class:`StepCosts` is a Lightning callback that wraps, on this trainer and module instance only, the
per-step calls that a hand-written loop does not make, and times every call (wall ``perf_counter`` and
this thread's CPU ``thread_time``):

- ``sigterm_broadcast``: Lightning 2.6's ``_TrainingEpochLoop._broadcast_sigterm_tensor`` (a collective);
- ``self.log``: ``LightningModule.log`` as called from ``training_step``;
- ``logger_connector``: ``_LoggerConnector.on_batch_start`` / ``on_batch_end`` / ``update_train_step_metrics``;
- ``callback <Name>``: every other callback's per-step hooks (progress bar, checkpoint, RunSummary, ...).

At ``teardown`` each rank writes ``step_costs_rank{R}.json`` with per-item medians and means per step.

    python train.py ... '+callbacks={costs:{_target_:bench.step_costs.StepCosts,out:DIR}}'
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import defaultdict
from typing import Any, Callable

from lightning.pytorch.callbacks import Callback

STEP_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
)


class StepCosts(Callback):
    """Time per-step calls in place; see the module docstring.

    Args:
        out: directory for ``step_costs_rank{R}.json``.
        skip: leading steps left out of the statistics (warm-up, first-call costs).
    """

    def __init__(self, out: str, skip: int = 5) -> None:
        self.out = out
        self.skip = skip
        self._step = 0
        self._per_step: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
        self._first_call: dict[str, float] = {}

    def _wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
                self._first_call.setdefault(name, wall)
                acc = self._per_step[name][self._step]
                acc[0] += wall
                acc[1] += cpu

        return timed

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        loop = trainer.fit_loop.epoch_loop
        if hasattr(loop, "_broadcast_sigterm_tensor"):
            loop._broadcast_sigterm_tensor = self._wrap("sigterm_broadcast", loop._broadcast_sigterm_tensor)
        pl_module.log = self._wrap("self.log", pl_module.log)
        connector = trainer._logger_connector
        for method in ("on_batch_start", "on_batch_end", "update_train_step_metrics"):
            setattr(connector, method, self._wrap("logger_connector", getattr(connector, method)))
        for callback in trainer.callbacks:
            if callback is self:
                continue
            for hook in STEP_HOOKS:
                if getattr(type(callback), hook) is not getattr(Callback, hook):  # overridden: does something
                    setattr(callback, hook, self._wrap(f"callback {type(callback).__name__}", getattr(callback, hook)))

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        # Everything from here to the next batch's start counts for this step (the SIGTERM broadcast, which
        # Lightning makes before fetching the batch, goes to the previous step: one per step all the same).
        self._step = trainer.global_step + 1

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        steps = range(self.skip, self._step)
        report = {"rank": trainer.global_rank, "steps": len(steps), "items": {}}
        for name, per_step in self._per_step.items():
            wall = [per_step.get(s, [0.0, 0.0])[0] * 1e3 for s in steps]
            cpu = [per_step.get(s, [0.0, 0.0])[1] * 1e3 for s in steps]
            if not wall:
                continue
            report["items"][name] = {
                "wall_ms_median": statistics.median(wall),
                "wall_ms_mean": statistics.fmean(wall),
                "cpu_ms_median": statistics.median(cpu),
                "cpu_ms_mean": statistics.fmean(cpu),
                "first_call_s": self._first_call[name],
            }
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, f"step_costs_rank{trainer.global_rank}.json"), "w") as f:
            json.dump(report, f, indent=1)
