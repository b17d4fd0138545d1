"""What a run directory holds decides what a new run in it does (parallelkit.run_dir), without processes.

Checkpoints here are tiny files and directories carrying only ``global_step``, in the three layouts a run
writes: a file, a sharded directory (``meta.pt``), a DeepSpeed directory (``<tag>/*model_states.pt``).
"""

from __future__ import annotations

import csv
import json

import pytest
import torch

from parallelkit.errors import ConfigError
from parallelkit.run_dir import RunFinished, checkpoint_step, plan, set_aside, write_atomically

HEADER = "epoch,step,train_loss,val_loss\n"


def checkpoint(path, step: int, layout: str = "file"):
    if layout == "file":
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"global_step": step}, path)
    elif layout == "sharded":
        path.mkdir(parents=True)
        (path / "__0_0.distcp").write_bytes(b"shard")
        torch.save({"global_step": step}, path / "meta.pt")
    else:
        (path / "checkpoint").mkdir(parents=True)
        torch.save({"global_step": step, "module": {}}, path / "checkpoint" / "mp_rank_00_model_states.pt")
    return path


def metrics(run, steps: range, val_at: tuple[int, ...] = ()) -> None:
    lines = [f"0,{s},{4.0 - s / 100},\n" for s in steps] + [f"0,{s},,{3.5 - s / 100}\n" for s in val_at]
    (run / "metrics.csv").write_text(HEADER + "".join(lines))


def steps_in(path) -> list[int]:
    with open(path, newline="") as file:
        return [int(row["step"]) for row in csv.DictReader(file)]


@pytest.mark.parametrize("layout", ["file", "sharded", "deepspeed"])
def test_checkpoint_step_reads_every_layout(layout, tmp_path):
    assert checkpoint_step(checkpoint(tmp_path / "c.ckpt", 37, layout)) == 37
    (tmp_path / "broken.ckpt").write_bytes(b"PK half a file")
    assert checkpoint_step(tmp_path / "broken.ckpt") is None


def test_a_fresh_directory_trains_from_step_zero(tmp_path):
    assert plan(tmp_path / "new", None, 20).ckpt_path is None
    fresh = plan(tmp_path / "new", "last", 20)
    assert fresh.ckpt_path is None and fresh.resume_step is None and "starts from step 0" in fresh.notes[0]


@pytest.mark.parametrize("ckpt_path", [None, "last"])
def test_a_finished_run_is_not_trained_again(ckpt_path, tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 20}))
    checkpoint(tmp_path / "checkpoints" / "last.ckpt", 20)
    with pytest.raises(RunFinished) as stop:
        plan(tmp_path, ckpt_path, 20)
    assert stop.value.code == 0
    # More steps asked for: the same directory is a run to go on with (ckpt_path=last) or not to start over.
    with pytest.raises(ConfigError, match="a run of 20 steps, fewer than trainer.max_steps=40"):
        plan(tmp_path, None, 40)
    further = plan(tmp_path, "last", 40)
    assert further.resume_step == 20
    assert [p.name for p in further.apply()] == ["summary.until-step-20.1.json"]  # its measurements stay
    assert json.loads((tmp_path / "summary.until-step-20.1.json").read_text()) == {"steps": 20}


def test_an_unfinished_run_is_refused_without_ckpt_path(tmp_path):
    metrics(tmp_path, range(12))
    checkpoint(tmp_path / "checkpoints" / "last.ckpt", 10)
    with pytest.raises(ConfigError) as refused:
        plan(tmp_path, None, 20)
    for words in (f"hydra.run.dir={tmp_path}", "reached step 12", "last.ckpt (step 10)", "ckpt_path=last", "another hydra.run.dir"):
        assert words in str(refused.value)
    resume = plan(tmp_path, "last", 20)
    assert resume.ckpt_path == str(tmp_path / "checkpoints" / "last.ckpt") and resume.resume_step == 10


def test_last_falls_back_to_a_complete_older_checkpoint(tmp_path):
    # A sharded save that died between moving last.ckpt aside and renaming the new one in.
    checkpoint(tmp_path / "checkpoints" / "last.ckpt.old", 10, "sharded")
    assert plan(tmp_path, "last", 20).ckpt_path == str(tmp_path / "checkpoints" / "last.ckpt.old")
    # last.ckpt removed by hand: the newest step checkpoint.
    other = tmp_path / "other"
    for step in (5, 15):
        checkpoint(other / "checkpoints" / f"epoch=0-step={step}.ckpt", step)
    assert plan(other, "last", 20).ckpt_path == str(other / "checkpoints" / "epoch=0-step=15.ckpt")


def test_a_resume_moves_what_follows_its_step_into_side_files(tmp_path):
    metrics(tmp_path, range(15), val_at=(9, 14))
    ckpts = tmp_path / "checkpoints"
    checkpoint(ckpts / "epoch=0-step=10.ckpt", 10, "sharded")
    checkpoint(ckpts / "epoch=0-step=15.ckpt", 15, "sharded")
    (ckpts / "epoch=0-step=15_ps").mkdir()  # what a strategy keeps beside a checkpoint goes with it
    checkpoint(ckpts / "last.ckpt", 15, "sharded")
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 15}))
    before = steps_in(tmp_path / "metrics.csv")

    moved = plan(tmp_path, str(ckpts / "epoch=0-step=10.ckpt"), 20).apply()
    assert {p.name for p in moved} == {"metrics.after-step-10.1.csv", "after-step-10.1", "summary.after-step-10.1.json"}
    assert steps_in(tmp_path / "metrics.csv") == [s for s in before if s < 10]  # steps 1..10 (0-based rows 0..9)
    assert steps_in(tmp_path / "metrics.after-step-10.1.csv") == [s for s in before if s >= 10]  # nothing dropped
    assert sorted(p.name for p in ckpts.iterdir()) == ["after-step-10.1", "epoch=0-step=10.ckpt"]
    assert sorted(p.name for p in (ckpts / "after-step-10.1").iterdir()) == ["epoch=0-step=15.ckpt", "epoch=0-step=15_ps", "last.ckpt"]
    # A second resume from the same step does not overwrite the first one's side files.
    metrics(tmp_path, range(12))
    assert {p.name for p in set_aside(tmp_path, 10)} == {"metrics.after-step-10.2.csv"}
    assert steps_in(tmp_path / "metrics.after-step-10.1.csv") == [s for s in before if s >= 10]


def test_write_atomically_keeps_the_old_file_when_a_write_fails(tmp_path):
    target = tmp_path / "last.ckpt"
    target.write_bytes(b"the previous checkpoint")

    def full_disk(file):
        file.write(b"half of the new")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomically(target, full_disk)
    assert target.read_bytes() == b"the previous checkpoint"
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no temporary file left behind
    write_atomically(target, lambda file: file.write(b"the new one"))
    assert target.read_bytes() == b"the new one"


class _RunsCode:
    """A crafted checkpoint object: unpickling it runs ``os.system`` (what weights_only=False would allow)."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_reading_a_checkpoint_step_runs_no_pickled_code(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"global_step": 3, "payload": _RunsCode(marker)}, tmp_path / "last.ckpt")
    assert checkpoint_step(tmp_path / "last.ckpt") is None  # unreadable, not executed
    assert not marker.exists()


def test_a_checkpoint_with_tensors_and_a_trusted_type_still_gives_its_step(tmp_path):
    from torch.distributed.checkpoint.metadata import MetadataIndex  # a torch type outside weights_only's defaults

    torch.save({"global_step": 7, "state_dict": {"w": torch.ones(2)}, "extra": MetadataIndex("w")}, tmp_path / "last.ckpt")
    assert checkpoint_step(tmp_path / "last.ckpt") == 7
