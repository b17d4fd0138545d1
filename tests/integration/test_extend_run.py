"""A finished run taken further (issue 33): ``trainer.max_steps=6``, then the same command with
``trainer.max_steps=12 ckpt_path=last``, is the run that went straight to 12 steps, bit for bit (``train_loss`` of
every step and the final parameters), for every exact strategy's layout.

What it takes, and the runs that would catch each part missing:

- the final checkpoint is written at the last step's boundary, like every periodic one
  (``parallelkit.callbacks.periodic_checkpoint``). Written in ``on_train_end``, as before, it held a fit loop that
  had counted the epoch as finished: the extension trained the *next* epoch's data order (and dropout streams)
  from batch 6 on. A checkpoint written that way (``fault_injection.FinalCheckpointAtTrainEnd``) is corrected
  on load; control: ``fault_injection.ForgetDataPosition`` (the sampler starts the epoch over);
- the first resumed step's learning rate comes from the resumed run's own schedule
  (``parallelkit.callbacks.resumed_schedule``). With ``optim.schedule.warmup_steps=5`` and ``decay_steps``
  following ``trainer.max_steps`` (6, then 12), steps 1–6 have the same rates in both runs, but the rate of step
  7 differs: the restored optimizer holds the 6-step schedule's. Control: ``fault_injection.KeepRestoredLearningRate``;
- with ``optim.schedule.decay_steps`` set by the user (decaying during the first 6 steps already), both runs share
  the schedule and the extension is exact too;
- Lightning knows the training loader to be resumable mid-epoch: its "not resumable" warning is gone.

Dropout is on (its masks are drawn per micro-batch from seed, epoch, batch and rank); validation is off but in one
case, where the final checkpoints are written after the validation of their step.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from parallelkit.distributed.checkpoint_io import load_unsharded
from tests.integration.test_train import TINY, train

HERE = Path(__file__).resolve().parent
ENV = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
ARGS = [*TINY, "model.dropout=0.1", "trainer.limit_val_batches=0"]
FOLLOWS_MAX_STEPS = ["optim.schedule.warmup_steps=5"]  # decay_steps: ${trainer.max_steps}, the default
USER_DECAY = ["optim.schedule.warmup_steps=2", "optim.schedule.decay_steps=8"]
# Validation after steps 3, 6, 9 and 12: the final checkpoint of either run waits for the validation that follows.
VALIDATED = ["trainer.limit_val_batches=1", "trainer.val_check_interval=3"]
NOT_RESUMABLE = "your dataloader is not resumable"


def _run(args: list[str], run_dir: Path) -> tuple[dict, str]:
    proc = train([*args, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent, env=ENV)
    assert proc.returncode == 0, f"train.py {' '.join(args)} exited {proc.returncode}\n{proc.stderr[-4000:]}"
    return json.loads((run_dir / "summary.json").read_text()), proc.stderr


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The final parameters, from ``last.ckpt`` (a file, or a sharded directory, in full)."""
    state = load_unsharded(run_dir / "checkpoints" / "last.ckpt")["state_dict"]
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}


def _same_weights(a: Path, b: Path) -> bool:
    first, second = _weights(a), _weights(b)
    assert first.keys() == second.keys()
    return all(torch.equal(first[k], second[k]) for k in first)


def _straight_and_extended(args: list[str], tmp_path: Path) -> tuple[dict, dict, str]:
    straight, _ = _run([*args, "trainer.max_steps=12"], tmp_path / "straight")
    first, _ = _run([*args, "trainer.max_steps=6"], tmp_path / "extended")
    assert first["steps"] == 6 and first["train_loss"] == straight["train_loss"][:6]
    extended, stderr = _run([*args, "trainer.max_steps=12", "ckpt_path=last"], tmp_path / "extended")
    assert extended["steps"] == 12
    return straight, extended, stderr


@pytest.mark.parametrize(
    "strategy, schedule",
    [
        (["strategy=ddp"], FOLLOWS_MAX_STEPS),
        (["strategy=ddp", *VALIDATED], USER_DECAY),
        (["strategy=zero", "strategy.stage=3"], FOLLOWS_MAX_STEPS),
        (["strategy=zero", "strategy.stage=3"], USER_DECAY),
        (["strategy=tp"], FOLLOWS_MAX_STEPS),
        (["strategy=pp", "strategy.microbatches=2"], FOLLOWS_MAX_STEPS),
    ],
    ids=["ddp", "ddp-user_decay-validated", "zero3", "zero3-user_decay", "tp", "pp"],
)
def test_a_finished_run_taken_further_is_the_uninterrupted_run(strategy, schedule, tmp_path):
    args = [*ARGS, *strategy, *schedule, "trainer.devices=2"]
    straight, extended, stderr = _straight_and_extended(args, tmp_path)
    assert extended["train_loss"] == straight["train_loss"]  # bit for bit, steps 7-12 included
    assert extended["val_loss"] == straight["val_loss"] and (extended["val_loss"] is not None) == (VALIDATED[0] in strategy)
    assert _same_weights(tmp_path / "extended", tmp_path / "straight")
    assert NOT_RESUMABLE not in stderr
    assert "trained under another learning-rate schedule" not in stderr  # the schedules agree on steps 1-6


def test_a_final_checkpoint_written_the_old_way_and_the_controls(tmp_path):
    """A 6-step run whose final checkpoint was written in on_train_end, as parallelkit did before the fix (its
    epoch counted as finished): taken further, it is the uninterrupted run too (PeriodicCheckpoint corrects the
    epoch on load). Two copies of it are the negative controls: taken further without the data position
    (the sampler starts the epoch over) or with the restored learning rate kept for step 7, each must differ."""
    args = [*ARGS, "strategy=ddp", *FOLLOWS_MAX_STEPS, "trainer.devices=2"]
    straight, _ = _run([*args, "trainer.max_steps=12"], tmp_path / "straight")
    _run([*args, "trainer.max_steps=6", "+callbacks.old._target_=fault_injection.FinalCheckpointAtTrainEnd"], tmp_path / "old")
    for control in ("forgot", "kept_rate"):
        shutil.copytree(tmp_path / "old", tmp_path / control)
    extended, stderr = _run([*args, "trainer.max_steps=12", "ckpt_path=last"], tmp_path / "old")
    assert "was written at the end of its run" in stderr, stderr[-3000:]
    assert extended["train_loss"] == straight["train_loss"]
    assert _same_weights(tmp_path / "old", tmp_path / "straight")

    forgot, _ = _run([*args, "trainer.max_steps=12", "ckpt_path=last", "+callbacks.forget._target_=fault_injection.ForgetDataPosition"],
                     tmp_path / "forgot")
    assert forgot["train_loss"][:6] == straight["train_loss"][:6] and forgot["train_loss"][6] != straight["train_loss"][6]
    # Step 7's update differs: the losses from step 8 on (each computed before its own step's update).
    kept, _ = _run([*args, "trainer.max_steps=12", "ckpt_path=last", "+callbacks.keep._target_=fault_injection.KeepRestoredLearningRate"],
                   tmp_path / "kept_rate")
    assert kept["train_loss"][:7] == straight["train_loss"][:7] and kept["train_loss"][7] != straight["train_loss"][7]
    assert not _same_weights(tmp_path / "kept_rate", tmp_path / "straight")


def test_a_schedule_that_differs_on_the_trained_steps_is_said(tmp_path):
    """warmup_steps=2: the 6-step run's cosine decayed over 6 steps from step 3 on, the 12-step run's over 12, so
    no run can be both; the extension says so and names the setting that continues the earlier schedule. With it,
    the extension is the uninterrupted run of that setting."""
    args = [*ARGS, "strategy=ddp", "optim.schedule.warmup_steps=2", "trainer.devices=2"]
    _run([*args, "trainer.max_steps=6"], tmp_path / "run")
    shutil.copytree(tmp_path / "run", tmp_path / "kept")
    _, stderr = _run([*args, "trainer.max_steps=12", "ckpt_path=last"], tmp_path / "run")
    said = [line for line in stderr.splitlines() if "trained under another learning-rate schedule" in line]
    assert said and "steps 4-6" in said[0] and "decay_steps=6 → 12" in said[0] and "optim.schedule.decay_steps=6" in said[0], stderr[-3000:]
    kept, stderr = _run([*args, "optim.schedule.decay_steps=6", "trainer.max_steps=12", "ckpt_path=last"], tmp_path / "kept")
    assert "trained under another learning-rate schedule" not in stderr
    straight, _ = _run([*args, "optim.schedule.decay_steps=6", "trainer.max_steps=12"], tmp_path / "straight")
    assert kept["train_loss"] == straight["train_loss"]


def test_a_run_by_epochs_taken_one_epoch_further(tmp_path):
    """``trainer.max_epochs=1``, then ``max_epochs=2 ckpt_path=last``: the second epoch is the uninterrupted run's
    (its data order from its start, not 5 batches in: the data position recorded once the epoch ended is epoch 1's
    beginning, while Lightning's batch counters still hold epoch 0's). Epochs of 5 steps (``limit_train_batches``)."""
    args = [*ARGS, "strategy=ddp", "trainer.devices=2", "trainer.max_steps=-1", "trainer.limit_train_batches=5",
            "optim.schedule.decay_steps=0"]
    straight, _ = _run([*args, "trainer.max_epochs=2"], tmp_path / "straight")
    first, _ = _run([*args, "trainer.max_epochs=1"], tmp_path / "extended")
    assert first["steps"] == 5
    extended, stderr = _run([*args, "trainer.max_epochs=2", "ckpt_path=last"], tmp_path / "extended")
    assert extended["steps"] == 10 and extended["train_loss"] == straight["train_loss"]
    assert _same_weights(tmp_path / "extended", tmp_path / "straight")
    assert NOT_RESUMABLE not in stderr
