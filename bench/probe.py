"""Timestamps of a run's start-up phases, per rank, for ``bench/phases.py`` (not used by the timed benchmark).

:class:`PhaseProbe` is a Lightning callback that writes ``probe_rank{R}.json`` with wall-clock times
(``time.time()``) of: the process's creation (from ``/proc``), its own construction (data and model are
built by then), ``setup`` (the process group exists), ``on_fit_start`` (DDP wrapped, optimizer built),
``on_train_start``, the first step's phases (batch start, forward, backward, optimizer step), the end of
the first and last optimizer steps, ``on_train_end`` and ``teardown``; and the median wall and CPU time
(``time.process_time``: all threads of the rank) per step.

It reaches ``train.py`` through a Hydra override (``bench`` is importable from the repository root)::

    python train.py ... '+callbacks={probe:{_target_:bench.probe.PhaseProbe,out:DIR}}'
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from lightning.pytorch.callbacks import Callback


def process_start_time(pid: int | str = "self") -> float:
    """When the process was created, as ``time.time()`` (10 ms resolution: ``/proc`` counts clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22 of proc(5), counted after "pid (comm)"
    with open("/proc/uptime") as f:
        now, uptime = time.time(), float(f.read().split()[0])
    return now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


def step_medians(wall: list[float], cpu: list[float]) -> dict[str, float]:
    """Median wall and CPU milliseconds per step from per-step stamps (the first step left out: warm-up)."""
    import statistics

    def med(xs: list[float]) -> float:
        deltas = [b - a for a, b in zip(xs[1:-1], xs[2:])]
        return statistics.median(deltas) * 1e3 if deltas else float("nan")

    return {"wall_ms_per_step": med(wall), "cpu_ms_per_step": med(cpu)}


class PhaseProbe(Callback):
    """Record when each start-up phase ends on this rank (see the module docstring).

    Args:
        out: directory for ``probe_rank{R}.json``.
    """

    def __init__(self, out: str) -> None:
        self.out = out
        self.t: dict[str, float] = {"process_start": process_start_time(), "callbacks_built": time.time()}
        self._seen = 0
        self._cpu: list[float] = []  # process CPU time (all threads) at each optimizer step
        self._wall: list[float] = []

    def _mark(self, name: str) -> None:
        self.t.setdefault(name, time.time())

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._mark("setup_process_group_ready")

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._mark("fit_start_model_wrapped")

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._mark("train_start")
        self._seen = trainer.global_step
        self._cpu, self._wall = [time.process_time()], [time.perf_counter()]

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._mark("first_batch_start")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._mark("first_forward_end")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self._mark("first_backward_end")

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._mark("first_optimizer_step_start")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self._seen:
            self._seen = trainer.global_step
            self._mark("first_step_end")
            self.t["last_step_end"] = time.time()
            self._cpu.append(time.process_time())
            self._wall.append(time.perf_counter())

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._mark("train_end")

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._mark("teardown")
        self.t.update(step_medians(self._wall, self._cpu))
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, f"probe_rank{trainer.global_rank}.json"), "w") as f:
            json.dump(self.t, f, indent=1)
