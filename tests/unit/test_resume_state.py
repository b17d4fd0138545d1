"""What a resume restores beyond the weights (issue 33), without processes: the epoch of a checkpoint written at
the end of a run that stopped mid-epoch, and the learning rate of the first resumed step.
The end-to-end runs are in tests/integration/test_extend_run.py."""

from __future__ import annotations

import copy
import functools
from types import SimpleNamespace

import torch

from parallelkit.callbacks.periodic_checkpoint import continue_the_epoch
from parallelkit.callbacks.resumed_schedule import ResumedSchedule, _first_difference
from parallelkit.models.module import TrainModule


def _progress(ready: int, started: int, processed: int, completed: int) -> dict[str, int]:
    return {"ready": ready, "started": started, "processed": processed, "completed": completed}


def _checkpoint(epoch: dict[str, int], batch: dict[str, int], is_last_batch: bool, counted_epoch: int) -> dict:
    """The parts of a Lightning checkpoint that say where in the data the run is."""
    return {
        "epoch": counted_epoch,
        "global_step": batch["completed"],
        "CharsDataModule": {"epoch": counted_epoch, "batches_done": batch["processed"]},
        "loops": {"fit_loop": {
            "epoch_progress": {"total": dict(epoch), "current": dict(epoch)},
            "epoch_loop.batch_progress": {"total": dict(batch), "current": dict(batch), "is_last_batch": is_last_batch},
        }},
    }


def test_a_run_that_max_steps_ended_mid_epoch_goes_on_in_that_epoch():
    # What on_train_end saw after 6 of an epoch's many batches (the old final checkpoint): the epoch counted as
    # finished, the data module's position in epoch 1.
    written = _checkpoint(_progress(1, 1, 1, 1), _progress(6, 6, 6, 6), is_last_batch=False, counted_epoch=1)
    checkpoint = copy.deepcopy(written)
    assert continue_the_epoch(checkpoint, "CharsDataModule")
    epochs = checkpoint["loops"]["fit_loop"]["epoch_progress"]
    assert epochs["current"] == epochs["total"] == _progress(1, 1, 0, 0)  # epoch 0, started, not finished
    assert checkpoint["epoch"] == 0 and checkpoint["CharsDataModule"] == {"epoch": 0, "batches_done": 6}
    assert checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"] == written["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    assert not continue_the_epoch(checkpoint, "CharsDataModule")  # once


def test_checkpoints_that_are_right_as_they_are_stay_so():
    # The epoch's data really ended (its last batch), then on_train_end: the next run starts the next epoch.
    end_of_epoch = _checkpoint(_progress(1, 1, 1, 1), _progress(40, 40, 40, 40), is_last_batch=True, counted_epoch=1)
    # A step boundary mid-epoch (on_train_batch_end: every periodic checkpoint, and now the final one).
    step_boundary = _checkpoint(_progress(1, 1, 0, 0), _progress(6, 6, 6, 5), is_last_batch=False, counted_epoch=0)
    # After a mid-epoch validation (on_validation_end).
    after_validation = _checkpoint(_progress(1, 1, 0, 0), _progress(6, 6, 6, 6), is_last_batch=False, counted_epoch=0)
    for checkpoint in (end_of_epoch, step_boundary, after_validation, {"state_dict": {}}):
        before = copy.deepcopy(checkpoint)
        assert not continue_the_epoch(checkpoint, "CharsDataModule")
        assert checkpoint == before


def _scheduler(decay_steps: int, warmup_steps: int = 5, steps: int = 0) -> tuple[TrainModule, torch.optim.lr_scheduler.LambdaLR]:
    torch.manual_seed(0)
    module = TrainModule(torch.nn.Linear(3, 2), functools.partial(torch.optim.AdamW, lr=3e-3), warmup_steps=warmup_steps,
                         decay_steps=decay_steps, min_lr_ratio=0.1)
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return module, scheduler


def _resume(checkpoint: tuple[TrainModule, torch.optim.lr_scheduler.LambdaLR], decay_steps: int, warmup_steps: int = 5):
    """A module of ``decay_steps`` restored from ``checkpoint`` as Lightning restores it, then ResumedSchedule."""
    old_module, old = checkpoint
    module, scheduler = _scheduler(decay_steps, warmup_steps)
    scheduler.optimizer.load_state_dict(old.optimizer.state_dict())
    scheduler.load_state_dict(old.state_dict())
    saving = ResumedSchedule()
    saving.setup(None, old_module, "fit")
    callback = ResumedSchedule()
    callback.load_state_dict(saving.state_dict())  # the schedule the checkpoint trained with
    trainer = SimpleNamespace(global_step=old.last_epoch, ckpt_path="last.ckpt", lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)])
    return scheduler, callback, trainer, module


def test_the_first_resumed_step_trains_at_the_rate_of_the_resumed_runs_schedule():
    # warmup 5, decay over max_steps: the 6-step and the 12-step schedules agree on steps 1-6, not on step 7.
    six_steps = _scheduler(decay_steps=6, steps=6)
    twelve = _scheduler(decay_steps=12, steps=6)[1]
    scheduler, callback, trainer, module = _resume(six_steps, decay_steps=12)
    restored = scheduler.optimizer.param_groups[0]["lr"]
    assert restored == six_steps[1].get_last_lr()[0] != twelve.get_last_lr()[0]  # the control: Lightning's restore alone
    callback.on_train_start(trainer, module)
    assert scheduler.optimizer.param_groups[0]["lr"] == twelve.optimizer.param_groups[0]["lr"]  # bit for bit
    assert scheduler.get_last_lr() == twelve.get_last_lr()
    assert _first_difference(callback._trained_with, {"warmup_steps": 5, "decay_steps": 12, "min_lr_ratio": 0.1}, 6) is None
    # The schedule unchanged (a killed run): the rate stays the restored one.
    scheduler, callback, trainer, module = _resume(six_steps, decay_steps=6)
    callback.on_train_start(trainer, module)
    assert scheduler.optimizer.param_groups[0]["lr"] == restored


def test_a_schedule_that_differs_on_trained_steps_is_found():
    old = {"warmup_steps": 2, "decay_steps": 6, "min_lr_ratio": 0.1}
    assert _first_difference(old, {**old, "decay_steps": 12}, 6) == 3  # scheduler step 3: optimizer step 4
    assert _first_difference(old, {**old, "decay_steps": 12}, 3) is None
    assert _first_difference(old, {**old, "warmup_steps": 3}, 6) == 0
    assert _first_difference(old, old, 6) is None
