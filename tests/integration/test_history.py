"""A run directory keeps its whole history; periodic checkpoints keep the newest K.

- Running a finished run again (with or without ``ckpt_path=last``) says so in one line, exits 0 and changes
  nothing: no retraining, ``metrics.csv``, ``summary.json`` and checkpoints byte for byte as they were.
- Running again over an unfinished run without ``ckpt_path`` is refused (exit 2, one paragraph naming the
  directory, the step it reached and what to do), changing nothing.
- A resume appends: ``metrics.csv`` ends with every step once, equal to the uninterrupted run's; the rows the
  killed run wrote after its checkpoint are kept in a side file, and equal the recomputed ones.
- ``ckpt_path=last`` without a checkpoint says in one line that it starts from step 0.
- Checkpoints every N steps keep the newest ``save_top_k`` (files and sharded directories); time-based
  checkpoints are agreed by the ranks; ``save_top_k=-1`` keeps all (the control: pruning is what removed them).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from parallelkit.run_dir import checkpoint_step
from tests.integration.test_interrupt import metrics_rows
from tests.integration.test_train import TINY, run_ok, train

HERE = Path(__file__).resolve().parent
ENV = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
ARGS = [*TINY, "model.dropout=0.1", "checkpoint.every_n_steps=5", "trainer.log_every_n_steps=1"]
KILL = ["+callbacks.kill._target_=fault_injection.KillRank", "+callbacks.kill.rank=1", "+callbacks.kill.at_step=12"]


def snapshot(run_dir: Path) -> dict[str, str]:
    """Every file the runs wrote (Hydra's record of how they were started included; not the logs, which later
    runs append to), with a hash of its bytes."""
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.suffix != ".log"}


def test_a_finished_run_is_not_trained_again(tmp_path):
    run_dir = tmp_path / "run"
    first = run_ok([*TINY, "strategy=single", "checkpoint.every_n_steps=5"], run_dir)
    before = snapshot(run_dir)
    assert {"metrics.csv", "summary.json", "checkpoints/last.ckpt", "checkpoints/epoch=0-step=20.ckpt", ".hydra/overrides.yaml"} <= set(before)
    for extra in ([], ["ckpt_path=last"]):
        again = train([*TINY, "strategy=single", "checkpoint.every_n_steps=5", *extra, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
        assert again.returncode == 0, again.stderr[-3000:]
        said = [line for line in (again.stdout + again.stderr).splitlines() if "already holds a finished run" in line]
        assert said and f"{run_dir}" in said[0] and "20 of trainer.max_steps=20 steps" in said[0]
        assert "Restoring states" not in again.stdout + again.stderr  # nothing was loaded, nothing trained
        assert snapshot(run_dir) == before
    assert first["steps"] == 20


def test_resume_keeps_the_whole_history_and_an_unfinished_run_is_not_started_over(tmp_path):
    args = [*ARGS, "strategy=ddp", "trainer.devices=2"]
    straight = run_ok(args, tmp_path / "straight")
    run_dir = tmp_path / "run"
    killed = train([*args, *KILL, f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=ENV)
    assert killed.returncode != 0 and "killing rank 1 at step 12" in killed.stderr, killed.stderr[-2000:]
    assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == 10
    written = metrics_rows(run_dir / "metrics.csv")
    after_checkpoint = [row for row in written if int(dict(row)["step"]) >= 10]  # steps 11.. of the killed run
    assert after_checkpoint, "the killed run should have logged past its checkpoint (log_every_n_steps=1)"

    # Again without ckpt_path: refused, nothing touched.
    before = snapshot(run_dir)
    refused = train([*args, f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=ENV)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "Traceback" not in refused.stderr
    message = refused.stderr[refused.stderr.index("parallelkit: error:"):]
    for words in (f"hydra.run.dir={run_dir}", "unfinished run", "reached step 11", "(step 10)", "ckpt_path=last", "another hydra.run.dir"):
        assert words in message, message
    assert snapshot(run_dir) == before

    # With ckpt_path=last: the history is appended to, every step once, and what was recomputed is kept aside.
    resumed = run_ok([*args, "ckpt_path=last"], run_dir, env=ENV)
    assert resumed["train_loss"] == straight["train_loss"]
    # How each run was started stays on record: the killed run's .hydra/, the resume's .hydra-2/.
    killed_record = (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "callbacks.kill" in killed_record and "ckpt_path=last" not in killed_record
    assert "ckpt_path=last" in (run_dir / ".hydra-2" / "overrides.yaml").read_text()
    assert metrics_rows(run_dir / "metrics.csv") == metrics_rows(tmp_path / "straight" / "metrics.csv")
    (side,) = run_dir.glob("metrics.after-step-10.*.csv")
    assert metrics_rows(side) == after_checkpoint
    assert set(after_checkpoint) <= set(metrics_rows(tmp_path / "straight" / "metrics.csv"))  # recomputed identically


def test_ckpt_path_last_without_a_checkpoint_starts_from_step_zero(tmp_path):
    fresh = train([*TINY, "strategy=single", "trainer.max_steps=3", "ckpt_path=last", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    said = [line for line in (fresh.stdout + fresh.stderr).splitlines() if "ckpt_path=last: no checkpoint" in line]
    assert said and "starts from step 0" in said[0] and "no earlier run" in said[0], fresh.stdout[-2000:]
    assert (tmp_path / "run" / "summary.json").is_file()


@pytest.mark.parametrize("strategy", [["strategy=ddp"], ["strategy=zero", "strategy.stage=3"]], ids=["file", "sharded"])
def test_step_checkpoints_keep_the_newest_k(strategy, tmp_path):
    args = [*TINY, *strategy, "trainer.devices=2", "checkpoint.every_n_steps=4", "checkpoint.every_n_minutes=0"]
    run_ok([*args, "checkpoint.save_top_k=2"], tmp_path / "two")
    names = sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir())
    assert names == ["epoch=0-step=16.ckpt", "epoch=0-step=20.ckpt", "last.ckpt"]
    assert checkpoint_step(tmp_path / "two" / "checkpoints" / "last.ckpt") == 20
    # The control: the same run keeping all has every fourth step, so pruning is what removed the others.
    run_ok([*args, "checkpoint.save_top_k=-1"], tmp_path / "all")
    names = sorted(p.name for p in (tmp_path / "all" / "checkpoints").iterdir())
    assert names == sorted([f"epoch=0-step={s}.ckpt" for s in (4, 8, 12, 16, 20)] + ["last.ckpt"])


def test_time_based_checkpoints_are_agreed_by_the_ranks(tmp_path):
    # Every 6 ms of training (and no step schedule), agreed about every step: checkpoints at the steps the
    # ranks agree on (a rank's own clock alone would split them: a sharded save needs both), the newest 2 kept.
    args = [*TINY, "strategy=zero", "strategy.stage=3", "trainer.devices=2", "checkpoint.every_n_steps=0",
            "checkpoint.every_n_minutes=0.0001", "checkpoint.agree_every_s=0.001", "checkpoint.save_top_k=2"]
    run_ok(args, tmp_path / "run")
    checkpoints = tmp_path / "run" / "checkpoints"
    steps = sorted(checkpoint_step(p) for p in checkpoints.glob("epoch=*-step=*.ckpt"))
    assert len(steps) == 2 and all(s is not None and 0 < s <= 20 for s in steps), steps
    assert checkpoint_step(checkpoints / "last.ckpt") == 20  # the final state, always
