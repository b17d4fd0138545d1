"""A test callback that records which samples each optimizer step trained on: per step, per data-parallel rank, a hash
of every sample (row) of the batch. Runs compare these to check the data position: the same samples at the same
step, none skipped, none twice (tests/integration/test_layout_change_resume.py)."""

from __future__ import annotations

import hashlib
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback


def _first_tensor(batch: Any) -> torch.Tensor:
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, dict) else batch
    return next(_first_tensor(v) for v in values if isinstance(v, (torch.Tensor, dict, list, tuple)))


class SampleLog(Callback):
    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        rows = [hashlib.sha1(row.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16] for row in _first_tensor(batch)]
        dp_rank = (getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}).get("rank", 0)
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": trainer.global_step, "dp": dp_rank, "rows": rows}) + "\n")


def args(path: Path) -> list[str]:
    """The command-line overrides that add the callback to a run."""
    return ["+callbacks.sample_log._target_=sample_log.SampleLog", f"+callbacks.sample_log.path={path}"]


ENV = {"PYTHONPATH": str(Path(__file__).parent)}


def samples_per_step(path: Path) -> dict[int, list[str]]:
    """Step → the sorted hashes of every sample the step trained on (each data-parallel rank's batch counted once:
    tensor/pipeline/context-parallel ranks of one replica read the same batch)."""
    by_replica: dict[tuple[int, int], list[str]] = {}
    for file in sorted(path.glob("rank*.jsonl")):
        seen: dict[tuple[int, int], list[str]] = defaultdict(list)
        for line in file.read_text().splitlines():
            record = json.loads(line)
            seen[(record["step"], record["dp"])] += record["rows"]
        for key, rows in seen.items():
            by_replica.setdefault(key, rows)
    out: dict[int, list[str]] = defaultdict(list)
    for (step, _), rows in by_replica.items():
        out[step] += rows
    return {step: sorted(rows) for step, rows in out.items()}
