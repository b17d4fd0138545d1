"""An interrupted run loses nothing it trained.

- A SIGTERM at a random moment of a 2-rank run (to the launching process, or to the whole job as SLURM and
  Ctrl-C do): the ranks agree on a step boundary, write a checkpoint there and stop with exit code 143;
  ``ckpt_path=last`` then ends with the uninterrupted run's final weights, ``train_loss`` and ``metrics.csv``
  rows, bit for bit (DDP on CPU is exact).
- A SIGTERM during validation: the validation finishes, the same stop follows, the resume is exact.
- A full disk while a checkpoint is written (a simulated failing write, ``fault_injection.FailWrite``): one
  paragraph, exit code 5, no traceback, no partial file left, and the previous checkpoint resumes exactly.

Negative control: the checkpoint the SIGTERM left is a mid-run state (its weights differ from the final
ones), so equal final weights say that the resume really trained the rest.
"""

from __future__ import annotations

import csv
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallelkit.run_dir import checkpoint_step
from tests.integration.test_train import REPO, TINY, run_ok, train

HERE = Path(__file__).resolve().parent
ENV = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
# 300 steps (a few seconds), validation every 50, a periodic checkpoint every 40: a signal lands anywhere. The
# ranks agree every 0.2 s of training (some 10-40 of these steps), so a stop asked for by step 150 comes well
# before the end (with the default 2 s, a signal that late may find the run finished: exit 0, rightly).
LONG = [*TINY, "model.dropout=0.1", "trainer.max_steps=300", "trainer.val_check_interval=50", "checkpoint.every_n_steps=40",
        "checkpoint.agree_every_s=0.2", "trainer.log_every_n_steps=7", "strategy=ddp", "trainer.devices=2"]
SHORT = [*TINY, "model.dropout=0.1", "checkpoint.every_n_steps=5", "trainer.log_every_n_steps=3", "trainer.devices=2"]
STOPPED = re.compile(r"stopped on SIGTERM after step (\d+)")


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[dict, Path]:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    return run_ok(LONG, run_dir), run_dir


def metrics_rows(path: Path) -> list[tuple]:
    """Every row of a metrics.csv as its non-empty (column, value) pairs, sorted: the history, whatever the order."""
    with open(path, newline="") as file:
        return sorted(tuple(sorted((k, v) for k, v in row.items() if v)) for row in csv.DictReader(file))


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]


def assert_same_run(resumed: dict, resumed_dir: Path, straight: dict, straight_dir: Path) -> None:
    assert resumed["steps"] == straight["steps"]
    assert resumed["train_loss"] == straight["train_loss"]  # bit for bit, every step
    assert resumed["val_loss"] == straight["val_loss"]
    assert metrics_rows(resumed_dir / "metrics.csv") == metrics_rows(straight_dir / "metrics.csv")  # the whole history, once
    final, reference = weights(resumed_dir / "checkpoints" / "last.ckpt"), weights(straight_dir / "checkpoints" / "last.ckpt")
    assert final.keys() == reference.keys()
    for key in reference:
        assert torch.equal(final[key], reference[key]), key


def signalled_run(args: list[str], run_dir: Path, at_step: int, whole_job: bool, delay_s: float) -> subprocess.CompletedProcess:
    """A real `python train.py` (cold, its own session) that gets SIGTERM ``delay_s`` after rank 0 finished ``at_step``."""
    import threading

    command = [sys.executable, str(REPO / "train.py"), *args, "+callbacks.stamp._target_=fault_injection.StepStamp", f"hydra.run.dir={run_dir}"]
    # stdout is not read while stderr is: it must not fill a pipe and block the job.
    proc = subprocess.Popen(command, cwd=run_dir.parent, env={**os.environ, "HYDRA_FULL_ERROR": "0", **ENV}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    killer = threading.Timer(300, lambda: os.killpg(proc.pid, signal.SIGKILL))  # a hang fails the test, not the suite
    killer.start()
    err_lines = []
    try:
        for line in proc.stderr:
            err_lines.append(line)
            if f"step {at_step} done" in line:
                threading.Timer(delay_s, lambda: (os.killpg if whole_job else os.kill)(proc.pid, signal.SIGTERM)).start()
                break
        _, rest = proc.communicate()
    finally:
        killer.cancel()
    return subprocess.CompletedProcess(command, proc.returncode, "", "".join(err_lines) + rest)


@pytest.mark.parametrize("whole_job", [False, True], ids=["rank0", "whole-job"])
def test_sigterm_at_a_random_moment_then_resume_reaches_the_uninterrupted_run(straight, whole_job, tmp_path):
    reference, reference_dir = straight
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    at_step, delay_s = rng.randint(20, 150), rng.uniform(0.0, 0.1)  # mid-step, mid-collective, mid-validation...
    run_dir = tmp_path / "run"
    stopped = signalled_run(LONG, run_dir, at_step, whole_job, delay_s)
    why = f"(seed {seed}: SIGTERM {delay_s:.3f} s after step {at_step})\n{stopped.stderr[-3000:]}"
    assert stopped.returncode == 143, why
    assert "Traceback" not in stopped.stderr, why
    match = STOPPED.search(stopped.stderr)
    assert match, why
    step = int(match.group(1))
    assert at_step <= step < 300, why
    last = run_dir / "checkpoints" / "last.ckpt"
    assert checkpoint_step(last) == step and not (run_dir / "summary.json").exists(), why
    # Negative control: that checkpoint is a mid-run state, not the final one.
    assert any(not torch.equal(a, b) for a, b in zip(weights(last).values(), weights(reference_dir / "checkpoints" / "last.ckpt").values()))

    resumed = run_ok([*LONG, "ckpt_path=last"], run_dir)
    assert_same_run(resumed, run_dir, reference, reference_dir)


def test_sigterm_during_validation_ends_cleanly_and_resumes_exactly(straight, tmp_path):
    reference, reference_dir = straight
    run_dir = tmp_path / "run"
    term = ["+callbacks.term._target_=fault_injection.SigtermDuringValidation", "+callbacks.term.rank=1", "+callbacks.term.after_step=100"]
    stopped = train([*LONG, *term, f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=ENV)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "SIGTERM to rank 1 during the validation after step 100" in stopped.stderr
    assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    step = int(STOPPED.search(stopped.stderr).group(1))
    assert 100 < step < 300  # the validation ran to its end; the stop came at a later step boundary
    with open(run_dir / "metrics.csv", newline="") as file:
        validated = [int(row["step"]) for row in csv.DictReader(file) if row.get("val_loss")]
    assert validated == [s - 1 for s in range(50, step + 1, 50)]  # the interrupted validation logged once, none lost

    resumed = run_ok([*LONG, "ckpt_path=last"], run_dir, env=ENV)
    assert_same_run(resumed, run_dir, reference, reference_dir)


@pytest.mark.parametrize("strategy,rank", [(["strategy=ddp"], 0), (["strategy=zero", "strategy.stage=3"], 1),
                                           (["strategy=deepspeed", "strategy.stage=2"], 1)], ids=["file", "sharded", "deepspeed"])
def test_full_disk_during_a_checkpoint_stops_clearly_and_keeps_the_previous_one(strategy, rank, tmp_path):
    # Checkpoints every 5 steps, each written as last.ckpt, then epoch=0-step=N.ckpt: the 3rd write is last.ckpt
    # at step 10. It fails with ENOSPC half-way (rank 0's file, or rank 1's shard of the sharded checkpoint).
    args = [*SHORT, *strategy]
    straight = run_ok(args, tmp_path / "straight")
    run_dir = tmp_path / "full"
    fail = ["+callbacks.fail._target_=fault_injection.FailWrite", f"+callbacks.fail.rank={rank}", "+callbacks.fail.nth=3"]
    failed = train([*args, *fail, f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=ENV)
    assert failed.returncode == 5, failed.stderr[-3000:]
    assert f"rank {rank}: no space left" in failed.stderr  # the fault really happened
    assert "Traceback" not in failed.stderr, failed.stderr[-3000:]
    errors = [line for line in failed.stderr.splitlines() if line.startswith("parallelkit: error:")]
    assert len(errors) == 1, failed.stderr[-3000:]
    for words in ("could not write the checkpoint", "last.ckpt at step 10", f"rank {rank}: No space left on device",
                  "the previous checkpoint is intact", "(step 5)", "ckpt_path=last"):
        assert words in errors[0], errors[0]
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch=0-step=5.ckpt", "last.ckpt"]  # nothing partial left
    assert checkpoint_step(checkpoints / "last.ckpt") == 5

    resumed = run_ok([*args, "ckpt_path=last"], run_dir, env=ENV)
    assert resumed["train_loss"] == straight["train_loss"]  # from step 5, bit for bit to the end
    assert metrics_rows(run_dir / "metrics.csv") == metrics_rows(tmp_path / "straight" / "metrics.csv")
