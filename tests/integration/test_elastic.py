"""Elastic fault tolerance: under ``torchrun --max-restarts=1`` a rank killed at step 12 makes torchrun restart
the job, which resumes by itself from the last checkpoint (step 10) and ends with exactly the parameters of
an uninterrupted run. Each attempt rendezvouses on its own key prefix of torchrun's store."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from tests.integration.test_resume import ENV, RESUME
from tests.integration.test_train import REPO, run_ok


def test_torchrun_restart_resumes_and_ends_with_the_uninterrupted_parameters(tmp_path):
    args = [*RESUME, "strategy=ddp"]
    straight = run_ok([*args, "trainer.devices=2"], tmp_path / "straight")

    run_dir = tmp_path / "elastic"
    kill = ["+callbacks.kill._target_=fault_injection.KillRank", "+callbacks.kill.rank=1", "+callbacks.kill.at_step=12", "+callbacks.kill.only_attempt=0"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.5",
           str(REPO / "train.py"), *args, *kill, f"hydra.run.dir={run_dir}"]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, **ENV, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=400)
    elapsed = time.monotonic() - start
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "killing rank 1 at step 12" in log  # the failure really happened, once
    assert log.count("killing rank") == 1
    resumed = __import__("json").loads((run_dir / "summary.json").read_text())
    assert resumed["train_loss"] == straight["train_loss"]
    final = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    reference = torch.load(tmp_path / "straight" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    assert final.keys() == reference.keys()
    for key in reference:
        assert torch.equal(final[key], reference[key]), key
    print(f"torchrun job with one restart: {elapsed:.1f} s")
