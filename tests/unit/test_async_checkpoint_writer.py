"""The asynchronous checkpoint writer in one process: what it writes is the state at the moment it was staged, its
second name is a hard link, one save at a time; which strategies it takes (and the clear refusal of the others)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy

from parallelkit.callbacks.periodic_checkpoint import PeriodicCheckpoint
from parallelkit.distributed.async_checkpoint import FILE, SHARDED, AsyncCheckpointWriter, checkpoint_layout
from parallelkit.errors import ConfigError


class Connector:
    """Lightning's checkpoint connector, reduced to the dump: live tensors and a live list, as Lightning hands them."""

    def __init__(self, weight: torch.Tensor, history: list[float]) -> None:
        self.weight, self.history = weight, history

    def dump_checkpoint(self, weights_only: bool = False) -> dict:
        return {"state_dict": {"w": self.weight}, "optimizer_states": [{"state": {0: {"exp_avg": self.weight * 0 + 1}}}],
                "global_step": 3, "loss_history": self.history}


def fake_trainer(weight: torch.Tensor, history: list[float]) -> SimpleNamespace:
    return SimpleNamespace(_checkpoint_connector=Connector(weight, history), strategy=SimpleNamespace(is_global_zero=True), global_step=3)


def test_the_file_holds_the_state_at_staging_time_and_the_step_file_is_a_hard_link(tmp_path):
    weight, history = torch.arange(6.0), [1.0, 2.0]
    trainer = fake_trainer(weight, history)
    writer = AsyncCheckpointWriter(FILE)
    writer.setup(trainer.strategy)
    last, step = tmp_path / "last.ckpt", tmp_path / "epoch=0-step=3.ckpt"
    record = writer.start(trainer, [last, step])
    weight.add_(100)  # the next steps change the live state while the write goes on
    history.append(3.0)
    assert writer.wait() is record and record.error is None and record.write_s >= record.stall_s
    saved = torch.load(last, weights_only=False)
    assert torch.equal(saved["state_dict"]["w"], torch.arange(6.0)) and saved["loss_history"] == [1.0, 2.0]
    assert os.stat(last).st_ino == os.stat(step).st_ino  # one write, two names
    # The staging buffers are reused: a second save overwrites them only after the first is written.
    writer.start(trainer, [last])
    writer.wait()
    assert torch.equal(torch.load(last, weights_only=False)["state_dict"]["w"], torch.arange(6.0) + 100)
    assert torch.equal(torch.load(step, weights_only=False)["state_dict"]["w"], torch.arange(6.0))  # the old name kept its file
    writer.close()


def test_deferred_tensors_are_copied_on_the_writers_thread_before_wait_staged_returns(tmp_path, monkeypatch):
    """``defer``: the accepted tensors are copied after ``start`` returned (on the writer's thread) and before
    ``wait_staged`` does; the others (a buffer a forward may change) at ``start``; the optimizer's own state dicts,
    which the dump hands over as they are, are not touched by the split."""
    import threading

    from parallelkit.distributed.async_checkpoint import AsyncCheckpointWriter as Writer
    from parallelkit.distributed.async_checkpoint import storage_key

    weight, buffer, moment = torch.arange(4.0), torch.zeros(2), torch.ones(4)
    optimizer_state = {"exp_avg": moment}  # the optimizer's own dict: must still hold its tensor afterwards

    class Dump:
        def dump_checkpoint(self, weights_only: bool = False) -> dict:
            return {"state_dict": {"w": weight, "running_mean": buffer}, "optimizer_states": [{"state": {0: optimizer_state}}],
                    "global_step": 3}

    trainer = SimpleNamespace(_checkpoint_connector=Dump(), strategy=SimpleNamespace(is_global_zero=True), global_step=3)
    release, real = threading.Event(), Writer._stage_deferred
    monkeypatch.setattr(Writer, "_stage_deferred", lambda self, *a: (release.wait(10), real(self, *a)))
    writer = Writer(FILE)
    writer.setup(trainer.strategy)
    record = writer.start(trainer, [tmp_path / "last.ckpt"], defer=lambda t: storage_key(t) != storage_key(buffer))
    assert not record.staged.is_set() and optimizer_state["exp_avg"] is moment
    buffer.add_(7)  # the next forward: after start, so it must not reach the file
    weight.add_(1)  # before the optimizer step: the deferred copy sees it (as training would not change it)
    release.set()
    assert writer.wait_staged() >= 0 and record.staged.is_set() and record.deferred == 2
    weight.add_(100)  # the optimizer step, after wait_staged: must not reach the file
    moment.mul_(5)
    assert writer.wait().error is None
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert torch.equal(saved["state_dict"]["running_mean"], torch.zeros(2))
    assert torch.equal(saved["state_dict"]["w"], torch.arange(4.0) + 1)
    assert torch.equal(saved["optimizer_states"][0]["state"][0]["exp_avg"], torch.ones(4))
    # Negative control: nothing deferred, the weight is copied at start (the +1 above would not be there).
    weight.copy_(torch.arange(4.0))
    writer.start(trainer, [tmp_path / "last.ckpt"])
    weight.add_(1)
    writer.wait()
    assert torch.equal(torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]["w"], torch.arange(4.0))
    writer.close()


def test_a_second_save_while_one_is_in_flight_is_refused(tmp_path, monkeypatch):
    import threading

    from parallelkit import run_dir

    release = threading.Event()
    real = run_dir.write_atomically
    monkeypatch.setattr(run_dir, "write_atomically", lambda path, write: (release.wait(10), real(path, write)))
    trainer = fake_trainer(torch.ones(2), [])
    writer = AsyncCheckpointWriter(FILE)
    writer.start(trainer, [tmp_path / "last.ckpt"])
    assert writer.in_flight
    with pytest.raises(RuntimeError, match="still in flight"):
        writer.start(trainer, [tmp_path / "last.ckpt"])
    release.set()
    assert writer.wait().error is None and not writer.in_flight


def test_a_failed_write_is_handed_to_wait_and_leaves_the_previous_file(tmp_path, monkeypatch):
    import errno

    from parallelkit import run_dir

    trainer = fake_trainer(torch.ones(2), [])
    writer = AsyncCheckpointWriter(FILE)
    writer.start(trainer, [tmp_path / "last.ckpt"])
    writer.wait()

    def full(file):
        file.write(b"part of a checkpoint")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real = run_dir.write_atomically
    monkeypatch.setattr(run_dir, "write_atomically", lambda path, write: real(path, full))
    trainer._checkpoint_connector.weight = torch.zeros(2)
    writer.start(trainer, [tmp_path / "last.ckpt"])
    record = writer.wait()
    assert isinstance(record.error, OSError) and record.error.errno == errno.ENOSPC
    assert torch.equal(torch.load(tmp_path / "last.ckpt", weights_only=False)["state_dict"]["w"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # no partial file left


def test_layouts_of_the_strategies():
    from parallelkit.strategies.ddp import DDPStrategy
    from parallelkit.strategies.single import SingleStrategy
    from parallelkit.strategies.tp import TensorParallelStrategy
    from parallelkit.strategies.zero import ZeroStrategy

    assert checkpoint_layout(SingleStrategy()) == FILE
    assert checkpoint_layout(DDPStrategy()) == FILE
    assert checkpoint_layout(ZeroStrategy(stage=3)) == SHARDED
    assert checkpoint_layout(TensorParallelStrategy(tp=2)) == SHARDED
    assert checkpoint_layout(ZeroStrategy(stage=3, save_distributed_checkpoint=False)) == FILE  # rank 0's one file


def test_strategies_that_write_their_own_way_are_refused():
    from parallelkit.strategies.ps import ParameterServerStrategy

    with pytest.raises(ConfigError, match="does not work with strategy=ps.*async_save=false"):
        checkpoint_layout(ParameterServerStrategy())

    class OwnIO(LightningDDPStrategy):
        pass

    strategy = OwnIO()
    strategy.checkpoint_io = SimpleNamespace()  # a CheckpointIO that is not torch.save's: the writer would bypass it
    with pytest.raises(ConfigError, match="would be bypassed"):
        checkpoint_layout(strategy)
    # Without async_save nothing is asked of the strategy (negative control of the check itself).
    PeriodicCheckpoint("ckpts", async_save=False).check_strategy(ParameterServerStrategy())
    with pytest.raises(ConfigError, match="strategy=ps"):
        PeriodicCheckpoint("ckpts", async_save=True).check_strategy(ParameterServerStrategy())


def test_async_save_must_be_a_boolean():
    with pytest.raises(ConfigError, match="checkpoint.async_save should be true or false"):
        PeriodicCheckpoint("ckpts", async_save="yes")
