"""Parameter-server fault tolerance under ``torchrun --max-restarts=1``: a worker or a server killed abruptly
mid-training (``os._exit``: no cleanup, no RPC shutdown, like ``kill -9``) makes torchrun restart the whole
job; every rank rendezvouses again (the process group *and* the RPC agents, on per-attempt keys of torchrun's
store), the workers resume from ``last.ckpt`` by themselves, and the servers load the snapshot of the same
step beside it. Sync mode then ends exactly where an uninterrupted run ends: the same ``train_loss`` for all
20 steps, bit for bit, and the same table rows and Adagrad state on the server.

The uninterrupted reference is a plain ``python train.py trainer.devices=3`` run in the same test module.
Negative control: a restart whose servers do not load their snapshot is told apart by the same checks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.integration.test_ps_train import CTR
from tests.integration.test_train import REPO, run_ok

HERE = Path(__file__).resolve().parent
ENV = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
# 20 steps, a checkpoint (and the servers' snapshot) every 5: a kill at step 12 resumes from step 10.
ARGS = [
    *CTR,
    "strategy=ps",
    "strategy.mode=sync",
    "trainer.max_steps=20",
    "trainer.val_check_interval=20",
    "checkpoint.every_n_steps=5",
    "strategy.timeout_s=60",
]
STAMP = ["+callbacks.stamp._target_=fault_injection.StepStamp"]  # rank 0 prints each finished step
KILL_WORKER = ["+callbacks.kill._target_=fault_injection.KillRank", "+callbacks.kill.rank=1", "+callbacks.kill.at_step=12", "+callbacks.kill.only_attempt=0"]
KILL_SERVER = ["+callbacks.kill._target_=ps_faults.KillServer", "+callbacks.kill.rank=2", "+callbacks.kill.at_step=12"]
KILL_SERVER_SAVING = [
    "+callbacks.kill._target_=ps_faults.KillServer",
    "+callbacks.kill.rank=2",
    "+callbacks.kill.at_step=10",
    "+callbacks.kill.during_snapshot=true",
]


def torchrun(args: list[str], run_dir: Path) -> tuple[subprocess.CompletedProcess, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3", "--max-restarts=1", "--monitor-interval=0.5",
           str(REPO / "train.py"), *args, f"hydra.run.dir={run_dir}"]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=run_dir.parent, env={**os.environ, "HYDRA_FULL_ERROR": "0", **ENV}, capture_output=True, text=True, timeout=400)
    return proc, time.monotonic() - start


def server_table(run_dir: Path, step: int = 20) -> dict[str, torch.Tensor]:
    """The server's table after ``step`` (its snapshot beside last.ckpt), rows sorted by id: a restored table
    holds the same rows as one that never stopped, in another order of creation."""
    snapshot = torch.load(run_dir / "checkpoints" / "last_ps" / f"server0-step{step}.pt", weights_only=False)
    assert snapshot["step"] == step and snapshot["version"] == {"embedding": step}
    table = snapshot["tables"]["embedding"]
    order = torch.argsort(table["ids"])
    return {"ids": table["ids"][order], "weights": table["weights"][order], "accumulator": table["state"][0][order]}


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[dict, Path]:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    return run_ok([*ARGS, "trainer.devices=3"], run_dir), run_dir


def _restarted(args: list[str], run_dir: Path, fault: str, resumed_at: int) -> dict:
    proc, elapsed = torchrun([*args, *STAMP], run_dir)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert log.count(fault) == 1, log[-5000:]  # the failure really happened, once
    # Attempt 1 went on from the checkpoint of step `resumed_at`: rank 0's steps count 1, 2, ..., then from resumed_at + 1.
    steps = [int(n) for n in re.findall(r"fault_injection: step (\d+) done", log)]
    restarts = [later for earlier, later in zip(steps, steps[1:]) if later <= earlier]
    assert restarts == [resumed_at + 1] and steps[-1] == 20, steps
    print(f"torchrun ps job with one restart ({fault}): {elapsed:.1f} s")
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize(
    "kill, fault, resumed_at",
    [
        (KILL_WORKER, "killing rank 1 at step 12", 10),
        pytest.param(KILL_SERVER, "killing server rank 2 at step 12", 10, marks=pytest.mark.slow),
        # Before the checkpoint of step 10 is written: the job goes back to step 5's checkpoint and snapshot.
        pytest.param(KILL_SERVER_SAVING, "killing server rank 2 while writing its snapshot of step 10", 5, marks=pytest.mark.slow),
    ],
    ids=["worker", "server", "server_while_saving"],
)
def test_torchrun_restart_ends_with_the_uninterrupted_losses_and_tables(straight, kill, fault, resumed_at, tmp_path):
    reference, reference_dir = straight
    run_dir = tmp_path / "elastic"
    resumed = _restarted([*ARGS, *kill], run_dir, fault, resumed_at)
    assert resumed["steps"] == reference["steps"] == 20
    assert resumed["train_loss"] == reference["train_loss"]  # all 20 steps, bit for bit
    assert resumed["val_auc"] == reference["val_auc"]
    got, want = server_table(run_dir), server_table(reference_dir)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert resumed["ps"]["tables"]["embedding"]["rows"] == reference["ps"]["tables"]["embedding"]["rows"]
    # Only the snapshot of the checkpoint's step is kept beside it (older ones and torn temp files are dropped).
    assert sorted(p.name for p in (run_dir / "checkpoints" / "last_ps").iterdir()) == ["server0-step20.pt"]


@pytest.mark.slow
def test_a_restart_whose_servers_forget_their_snapshot_is_caught(straight, tmp_path):
    """Negative control: the same worker kill and restart, but the servers start from fresh rows."""
    reference, reference_dir = straight
    run_dir = tmp_path / "forgetful"
    forget = ["+callbacks.forget._target_=ps_faults.ForgetTables"]
    broken = _restarted([*ARGS, *KILL_WORKER, *forget], run_dir, "killing rank 1 at step 12", 10)
    assert broken["train_loss"][:10] == reference["train_loss"][:10]  # up to the checkpoint all was well
    assert broken["train_loss"] != reference["train_loss"]
    got, want = server_table(run_dir), server_table(reference_dir)
    assert got["ids"].shape != want["ids"].shape or not torch.equal(got["weights"], want["weights"])
