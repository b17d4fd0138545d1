"""``--calibrate``'s Lightning callback: wall and process CPU seconds at every batch start, per rank
(a callbacks module: the planner, which imports no torch, names it only as a ``_target_``)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from lightning.pytorch.callbacks import Callback


class StepCpu(Callback):
    """Records ``(perf_counter, process_time)`` at every batch start and at teardown; writes ``out/rank{R}.json``."""

    def __init__(self, out: str) -> None:
        self.out, self.marks = out, []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.marks.append((time.perf_counter(), time.process_time()))

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self.marks.append((time.perf_counter(), time.process_time()))
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump(self.marks, f)
