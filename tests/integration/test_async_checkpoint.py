"""Asynchronous checkpoints (``checkpoint.async_save=true``, issue 33 item 5): a save overlapping the next steps
writes what a synchronous save writes; a writer killed mid-save leaves the previous checkpoint, from which the
run resumes bit for bit; one save is in flight at most; a writer that does not stage its copy is caught.

Every run checkpoints every 5 of 20 steps (dropout on: the random stream must come back too). The background
writes are slowed down (``async_faults.AsyncWriteFault``: 0.5–1 s before each write) so that training really
goes on while they are written; the tests check that it did.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from parallelkit.distributed.checkpoint_io import load_unsharded
from parallelkit.run_dir import checkpoint_step
from tests.integration.test_train import TINY, run_ok, train

HERE = Path(__file__).resolve().parent
ARGS = [*TINY, "model.dropout=0.1", "checkpoint.every_n_steps=5", "trainer.devices=2"]
ASYNC = ["checkpoint.async_save=true"]
ENV = {"PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
STRATEGIES = {"ddp": ["strategy=ddp"], "zero3": ["strategy=zero", "strategy.stage=3"], "tp": ["strategy=tp", "strategy.tp=2"]}


def slow_writes(delay_s: float, **kwargs) -> list[str]:
    args = ["+callbacks.slow._target_=async_faults.AsyncWriteFault", f"+callbacks.slow.delay_s={delay_s}"]
    return args + [f"+callbacks.slow.{k}={v}" for k, v in kwargs.items()]


def differences(a, b, where: str = "") -> list[str]:
    """Where two checkpoint objects differ: tensors bit for bit (dtype, shape, values), the rest by ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where} keys {sorted(set(a) ^ set(b), key=str)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r:.80} != {b!r:.80}"]


def checkpoint_differences(run_a: Path, run_b: Path) -> dict[str, list[str]]:
    names_a = sorted(p.name for p in (run_a / "checkpoints").iterdir())
    names_b = sorted(p.name for p in (run_b / "checkpoints").iterdir())
    assert names_a == names_b, (names_a, names_b)
    found = {name: differences(load_unsharded(run_a / "checkpoints" / name), load_unsharded(run_b / "checkpoints" / name)) for name in names_a}
    return {name: d for name, d in found.items() if d}


@pytest.fixture(scope="module")
def synchronous(tmp_path_factory) -> dict[str, tuple[dict, Path]]:
    """The synchronous runs, the reference (computed once per strategy, on first use)."""
    base, runs = tmp_path_factory.mktemp("sync"), {}

    class Runs(dict):
        def __missing__(self, name):
            run_dir = base / name
            self[name] = (run_ok([*ARGS, *STRATEGIES[name]], run_dir), run_dir)
            return self[name]

    return Runs(runs)


@pytest.mark.parametrize("name", ["ddp", "zero3", "tp"])  # tp: every tensor a DTensor, staged as its local shard
def test_async_saves_write_what_synchronous_saves_write(name, synchronous, tmp_path):
    reference, reference_dir = synchronous[name]
    run_dir = tmp_path / "async"
    summary = run_ok([*ARGS, *STRATEGIES[name], *ASYNC, *slow_writes(0.5, log_to=tmp_path / "writes")], run_dir, env=ENV)
    assert summary["train_loss"] == reference["train_loss"]  # training unaffected, bit for bit
    writes = json.loads((tmp_path / "writes.rank0.json").read_text())
    assert [w["step"] for w in writes] == [5, 10, 15, 20]
    assert any(w["training_step_at_end"] > w["step"] for w in writes)  # training went on while they were written
    # Every kept checkpoint (last.ckpt and the step ones: hard links of it) holds exactly what the synchronous one does.
    assert checkpoint_differences(reference_dir, run_dir) == {}


@pytest.mark.parametrize("name", ["ddp", "tp"])
def test_the_copy_made_during_the_next_step_is_waited_for_before_the_optimizer_steps(name, synchronous, tmp_path):
    # The parameters and moments are copied on the writer's thread while the next step's forward and backward run.
    # Held back 0.5 s here (a step takes tens of ms): the optimizer must wait for the copy (its wait began before the
    # copy was done and ended after it: how long depends on how long the forward and backward took, tens of ms on a
    # quiet machine, over 0.1 s beside another heavy job), the wait counts as the save's stall, and every checkpoint
    # still holds what the synchronous one does.
    reference, reference_dir = synchronous[name]
    run_dir = tmp_path / "held"
    summary = run_ok([*ARGS, *STRATEGIES[name], *ASYNC, *slow_writes(0.0, stage_delay_s=0.5, log_to=tmp_path / "writes")], run_dir, env=ENV)
    assert summary["train_loss"] == reference["train_loss"]
    assert checkpoint_differences(reference_dir, run_dir) == {}
    for rank in (0, 1):
        saves = json.loads((tmp_path / f"writes.saves.rank{rank}.json").read_text())
        assert [s["step"] for s in saves] == [5, 10, 15, 20] and all(s["async"] for s in saves)
        for save in saves[:-1]:  # the last one is waited for whole at the end of training
            assert 0 < save["staged_wait_s"] <= save["stall_s"], save
            assert save["wait_began"] < save["copy_done"] <= save["wait_ended"], save
            # ddp's file is rank 0's alone; tp's ranks each copy their own shards
            assert (save["deferred"] > 0) == (rank == 0 or name != "ddp"), save


def test_an_optimizer_step_that_does_not_wait_for_the_copy_is_caught(synchronous, tmp_path):
    """Negative control of the test above: without the wait in on_before_optimizer_step the held-back copy reads
    parameters the optimizer has already changed, and the comparison with the synchronous checkpoints catches it."""
    reference, reference_dir = synchronous["ddp"]
    run_dir = tmp_path / "unwaited"
    summary = run_ok([*ARGS, "strategy=ddp", *ASYNC, *slow_writes(0.0, stage_delay_s=0.5, wait_for_copy="false")], run_dir, env=ENV)
    assert summary["train_loss"] == reference["train_loss"]
    found = checkpoint_differences(reference_dir, run_dir)
    assert "epoch=0-step=10.ckpt" in found and any(d.startswith(".state_dict.") for d in found["epoch=0-step=10.ckpt"]), found


@pytest.mark.parametrize("name,rank", [("ddp", 0), ("zero3", 1)])
def test_writer_killed_mid_save_leaves_the_previous_checkpoint_and_resume_is_exact(name, rank, synchronous, tmp_path):
    # The 3rd save (step 15) dies half-way through the write (rank 0's file, or rank 1's shard) while training
    # goes on: last.ckpt must still be step 10, whole, and the run resumed from it (async again) is bit-identical.
    reference, _ = synchronous[name]
    run_dir = tmp_path / "killed"
    args = [*ARGS, *STRATEGIES[name], *ASYNC]
    killed = train([*args, *slow_writes(0.5, rank=rank, nth=3), f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=ENV)
    assert killed.returncode != 0 and f"killing rank {rank} while writing" in killed.stderr, killed.stderr[-3000:]
    at = re.search(r"in the background, training at step (\d+)", killed.stderr)
    assert at and int(at.group(1)) > 15  # the writer died while training went on
    checkpoints = run_dir / "checkpoints"
    assert checkpoint_step(checkpoints / "last.ckpt") == 10
    assert not (run_dir / "summary.json").exists()
    resumed = run_ok([*args, "ckpt_path=last"], run_dir, env=ENV)
    assert resumed["steps"] == 20 and resumed["train_loss"] == reference["train_loss"]


def test_one_save_in_flight_and_training_goes_on_meanwhile(tmp_path):
    # Saves due every 2 steps, each write held back 1 s while a step takes tens of ms: every save falls due while
    # the previous one is still being written, so each must wait for it.
    run_dir = tmp_path / "run"
    args = [*ARGS, "strategy=ddp", "checkpoint.every_n_steps=2", "trainer.max_steps=8", *ASYNC, *slow_writes(1.0, log_to=tmp_path / "writes")]
    summary = run_ok(args, run_dir, env=ENV)
    for rank in (0, 1):
        writes = json.loads((tmp_path / f"writes.rank{rank}.json").read_text())
        assert [w["step"] for w in writes] == [2, 4, 6, 8]
        assert all(w["writer_threads"] == 1 and w["error"] is None for w in writes), writes  # only its own thread alive
        for earlier, later in zip(writes, writes[1:]):
            assert later["began"] >= earlier["ended"], (earlier, later)  # never two at once
        assert writes[0]["training_step_at_end"] > 2  # the step went on during the first write
    assert summary["steps"] == 8 and checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == 8


def test_a_writer_that_does_not_stage_its_copy_is_caught(synchronous, tmp_path):
    """Negative control: writing the live tensors (no staged copy) lets the steps taken during the write leak into
    the checkpoint, and the comparison of the first test catches it."""
    reference, reference_dir = synchronous["ddp"]
    run_dir = tmp_path / "unstaged"
    summary = run_ok([*ARGS, "strategy=ddp", *ASYNC, *slow_writes(0.5, stage="false")], run_dir, env=ENV)
    assert summary["train_loss"] == reference["train_loss"]
    found = checkpoint_differences(reference_dir, run_dir)
    assert "epoch=0-step=10.ckpt" in found and any(d.startswith(".state_dict.") for d in found["epoch=0-step=10.ckpt"]), found


def test_async_save_with_a_strategy_that_writes_its_own_way_is_refused(tmp_path):
    proc = train([*TINY, "strategy=deepspeed", "trainer.devices=2", *ASYNC, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "checkpoint.async_save=true does not work with strategy=deepspeed" in proc.stderr and "checkpoint.async_save=false" in proc.stderr


def test_a_failed_background_write_stops_the_job_clearly_and_keeps_the_previous_checkpoint(tmp_path):
    # A full disk (fault_injection.FailWrite) in rank 0's 3rd write, the step-15 checkpoint, found by the background
    # writer: the job still ends with one WriteFailed paragraph (exit 5) naming step 15 and the intact step 10.
    run_dir = tmp_path / "full"
    fail = ["+callbacks.fail._target_=fault_injection.FailWrite", "+callbacks.fail.rank=0", "+callbacks.fail.nth=3"]
    failed = train([*ARGS, "strategy=ddp", *ASYNC, *fail, f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=ENV)
    assert failed.returncode == 5, failed.stderr[-3000:]
    errors = [line for line in failed.stderr.splitlines() if line.startswith("parallelkit: error:")]
    assert len(errors) == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    for words in ("could not write the checkpoint", "last.ckpt at step 15", "rank 0: No space left on device", "(step 10)"):
        assert words in errors[0], errors[0]
    assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == 10
