"""Periodic checkpoints: every N optimizer steps and/or every M minutes, the newest K kept, ``last.ckpt``
always the newest, and one more at an agreed step boundary when the job is asked to stop.

Lightning's ``ModelCheckpoint`` does each of these alone, not together: steps *or* time (mutually exclusive),
and with ``monitor=None`` it keeps only one checkpoint; its time trigger broadcasts rank 0's clock before
every batch. Here the ranks agree every ``agree_every_s`` seconds of training (the number of steps between
agreements adapts to the step time, and is itself agreed) in one small all-reduce that carries "a time-based
checkpoint is due" and "some rank was asked to stop" (:mod:`parallelkit.callbacks.local_sigterm`).

Each checkpoint is written twice, as Lightning's ``save_last=True`` does: ``last.ckpt`` first, then
``epoch=E-step=S.ckpt`` (a file, or a directory for sharded and DeepSpeed checkpoints); the oldest step
checkpoints beyond ``save_top_k`` are removed through the strategy (``remove_checkpoint``: files and
directories, and what a strategy keeps beside them). Every write is atomic, so a write that fails or a
process killed while writing leaves the previous checkpoint loadable; a failed write stops the job with
:class:`~parallelkit.errors.WriteFailed` (one paragraph, exit code 5). A checkpoint due at a step that
validation follows is written after it, so that a resumed run neither repeats nor skips that validation.
The final state (step ``trainer.max_steps``) is written the same way, at that step's boundary (``last.ckpt``;
a step checkpoint too if one is due), so that a finished run taken further resumes mid-epoch, exactly.

With ``async_save=True`` a save stages the state between two steps and a background thread writes it while
training goes on (:mod:`parallelkit.distributed.async_checkpoint`); the step checkpoint is then a hard link of
``last.ckpt``. The parameters and optimizer moments are copied on that thread during the next step's forward and
backward: ``on_before_optimizer_step`` waits for the copy (and counts the wait in the save's stall) before the
optimizer changes them. One save is in flight at most: a save that falls due before the previous one is on disk waits
for it, and so do the end of training, a stop on a signal and a failure (before the process exits). A failed
background write stops the job at the next of these points with the same :class:`~parallelkit.errors.WriteFailed`,
on every rank.
"""

from __future__ import annotations

import math
import re
import signal
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from parallelkit.callbacks.base import ParallelKitCallback
from parallelkit.callbacks.local_sigterm import StoppedBySignal
from parallelkit.errors import ConfigError, WriteFailed

CHECKPOINT_NAME = re.compile(r"^epoch=\d+-step=(\d+)\.ckpt$")
LAST = "last.ckpt"
MAX_STEPS_BETWEEN_AGREEMENTS = 10_000


class PeriodicCheckpoint(Checkpoint, ParallelKitCallback):
    """Checkpoint every ``every_n_steps`` optimizer steps and/or ``every_n_minutes``, keep the newest ``save_top_k``.

    Args:
        dirpath: the checkpoint directory (``<run dir>/checkpoints``).
        every_n_steps: a checkpoint when the optimizer step is a multiple of it; 0 or ``None``: not by steps.
        every_n_minutes: a checkpoint when this much training time has passed since the last one; 0 or
            ``None``: not by time.
        save_top_k: step checkpoints kept besides ``last.ckpt`` (the newest ones); -1: all; 0: ``last.ckpt`` only.
        agree_every_s: how often (seconds of training) the ranks agree on time-based checkpoints and stops.
        async_save: write each checkpoint on a background thread from a staged copy while training goes on (one
            save in flight at most); ``False``: training waits while it is written.

    Example::

        Trainer(callbacks=[PeriodicCheckpoint("run/checkpoints", every_n_steps=100, every_n_minutes=30), LocalSigterm()])
    """

    def __init__(self, dirpath: str | Path, every_n_steps: int | None = 100, every_n_minutes: float | None = 30.0,
                 save_top_k: int = 3, agree_every_s: float = 2.0, async_save: bool = False) -> None:
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 0):
            raise ConfigError(f"checkpoint.every_n_steps should be an int ≥ 0 (0 or null: not by steps). Got {every_n_steps!r}.")
        if every_n_minutes is not None and (not isinstance(every_n_minutes, (int, float)) or isinstance(every_n_minutes, bool)
                                            or not math.isfinite(every_n_minutes) or every_n_minutes < 0):
            raise ConfigError(f"checkpoint.every_n_minutes should be a number of minutes ≥ 0 (0 or null: not by time). Got {every_n_minutes!r}.")
        if not isinstance(save_top_k, int) or isinstance(save_top_k, bool) or save_top_k < -1:
            raise ConfigError(f"checkpoint.save_top_k should be an int ≥ -1 (-1: keep all, 0: last.ckpt only). Got {save_top_k!r}.")
        if not isinstance(agree_every_s, (int, float)) or agree_every_s <= 0:
            raise ConfigError(f"PeriodicCheckpoint(agree_every_s=...) should be a number of seconds greater than 0. Got {agree_every_s!r}.")
        if not isinstance(async_save, bool):
            raise ConfigError(f"checkpoint.async_save should be true or false. Got {async_save!r}.")
        self.dirpath = Path(dirpath)
        self.every_n_steps = every_n_steps or 0
        self.every_n_minutes = float(every_n_minutes or 0)
        self.save_top_k = save_top_k
        self.agree_every_s = float(agree_every_s)
        self.last_model_path = ""  # Lightning's name: where last.ckpt is, once written
        self._stopper: Any = None
        self._pending: int | None = None  # a checkpoint deferred to the end of validation (the stop signal, or 0)
        self._pending_step_file = True  # ... and whether it writes a step checkpoint (not for the final state alone)
        self.async_save = async_save
        self._writer: Any = None  # the background writer (async_save), built in setup for the strategy's layout
        self._written_step: int | None = None  # the step of the newest checkpoint complete on disk
        #: one entry per save: {step, stall_s (training stood still), write_s (on disk after), async}
        self.save_records: list[dict[str, Any]] = []

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(dirpath=str(self.dirpath))

    @override
    def check_strategy(self, strategy: Any, dims: Any = None) -> None:
        """``async_save`` needs a strategy whose checkpoint the background writer can write (not DeepSpeed's, the
        parameter server's): refused before any process starts."""
        if self.async_save:
            from parallelkit.distributed.async_checkpoint import checkpoint_layout

            checkpoint_layout(strategy)

    # ---------------------------------------------------------------------------------------- hooks
    @override
    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        # Lightning calls this after it restored the data module's state and before the loops' state.
        datamodule = trainer.datamodule
        key = type(datamodule).__qualname__ if datamodule is not None else None
        if not continue_the_epoch(checkpoint, key):
            return
        rank_zero_info(f"parallelkit: the checkpoint of step {checkpoint.get('global_step')} was written at the end of its run, its "
                       "epoch counted as finished before the epoch's data were: training goes on in that epoch, as the "
                       "uninterrupted run does.")
        if key in checkpoint:
            datamodule.load_state_dict(checkpoint[key])  # the corrected position

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if not callable(getattr(trainer.fit_loop.epoch_loop, "_should_check_val_fx", None)):
            raise RuntimeError("PeriodicCheckpoint relies on Lightning's training_epoch_loop._should_check_val_fx (Lightning 2.6): "
                               "this Lightning version has none; check the pinned version.")
        self._stopper = next((cb for cb in trainer.callbacks if callable(getattr(cb, "agreement_signal", None))), None)
        if self._stopper is not None:
            self._stopper.connect(self)
        if self.async_save and self._writer is None:
            from parallelkit.distributed.async_checkpoint import AsyncCheckpointWriter, checkpoint_layout

            if not callable(getattr(getattr(trainer, "_checkpoint_connector", None), "dump_checkpoint", None)):
                raise RuntimeError("checkpoint.async_save relies on Lightning's trainer._checkpoint_connector.dump_checkpoint "
                                   "(Lightning 2.6): this Lightning version has none; check the pinned version.")
            self._writer = AsyncCheckpointWriter(checkpoint_layout(trainer.strategy), timeout_s=getattr(trainer.strategy, "timeout_s", 600.0))
            self._writer.setup(trainer.strategy)

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        now = time.monotonic()
        # The step a resumed run starts at is in its checkpoint already: nothing to write until the next one.
        self._seen_step = self._saved_step = self._agreed_step = trainer.global_step
        self._written_step = trainer.global_step
        self._saved_at = self._agreed_at = now
        self._next_agreement = trainer.global_step + 1
        self._pending, self._pending_step_file = None, True

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._seen_step:
            return  # a micro-batch inside an accumulated step: not a step boundary
        self._seen_step = step
        due = bool(self.every_n_steps) and step % self.every_n_steps == 0
        signum = self._pending or 0
        due = due or self._pending is not None  # deferred to a validation that did not run: write it now
        self._pending = None
        if step >= self._next_agreement and self._agrees():
            time_due, signum = self._agree(trainer, step, signum)
            due = due or time_due or bool(signum)
        # The final state is written here, at the last step's boundary like every other checkpoint, and not in
        # on_train_end: by then Lightning has counted the epoch as finished although trainer.max_steps, not the
        # data, ended it. A finished run taken further from that state (a larger trainer.max_steps with
        # ckpt_path=last) went on in the *next* epoch at this batch index: another data order and other dropout
        # streams than the uninterrupted run's (issue 33). At a step boundary Lightning resumes mid-epoch, exactly.
        final = _last_step(trainer)
        if not (due or final):
            return
        if _validation_follows(trainer):
            self._pending, self._pending_step_file = signum, due
            return
        self._save_then_stop(trainer, signum, step_file=due)

    @override
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._staged()  # the optimizer is about to change the parameters and moments a save in flight is copying

    @override
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._staged()  # not reached with a copy pending (a save a validation follows waits for it); no harm if so

    @override
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._pending is None or trainer.sanity_checking:
            return
        signum, self._pending = self._pending, None
        self._save_then_stop(trainer, signum, step_file=self._pending_step_file)

    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # The final state of a run that max_steps did not end (epochs, a callback's stop), or whose checkpoint
        # waited for a validation that did not run.
        if trainer.global_step != self._saved_step:
            pending = self._pending_step_file if self._pending is not None else False
            self._save(trainer, step_file=bool(pending or (self.every_n_steps and trainer.global_step % self.every_n_steps == 0)))
        self._finish_async(trainer)  # training is over once its last checkpoint is on disk

    @override
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # A save in flight is finished before the process goes (the ranks may not be in step: no collective).
        # A failure of that write is this rank's to report unless the job is already stopping for a write.
        if self._writer is None or not self._writer.in_flight:
            return
        record = self._writer.wait()
        if record is not None and record.error is None:
            self._completed(trainer, record, prune=False)
        elif record is not None and not isinstance(exception, WriteFailed):
            rank_zero_info(f"parallelkit: the checkpoint of step {record.step} could not be written either ({_reason(record.error)}).")

    @override
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._writer is not None:
            self._writer.wait()
            self._writer.close()
            self._writer = None

    # ---------------------------------------------------------------------------------------- agreement
    def _agrees(self) -> bool:
        """Whether there is anything to agree on: time-based checkpoints, or stops on a signal."""
        return bool(self.every_n_minutes) or (self._stopper is not None and getattr(self._stopper, "checkpoint_on_signal", False))

    def _agree(self, trainer: Any, step: int, signum: int) -> tuple[bool, int]:
        """One all-reduce (max) of [signal, time due, -steps to the next agreement]: every rank leaves with the
        same decision and the same next agreement step."""
        now = time.monotonic()
        local_signal = self._stopper.agreement_signal() if self._stopper is not None else 0
        time_due = bool(self.every_n_minutes) and now - self._saved_at >= 60 * self.every_n_minutes
        step_s = (now - self._agreed_at) / max(step - self._agreed_step, 1)
        gap = max(1, min(MAX_STEPS_BETWEEN_AGREEMENTS, int(self.agree_every_s / step_s) if step_s > 0 else MAX_STEPS_BETWEEN_AGREEMENTS))
        mine = [float(max(signum, local_signal)), float(time_due), -float(gap)]
        if trainer.world_size > 1:
            from parallelkit.callbacks.run_summary import _global_max

            mine = _global_max(trainer.strategy, torch.tensor(mine, dtype=torch.float64, device=trainer.strategy.root_device)).tolist()
        self._next_agreement = step + int(-mine[2])
        self._agreed_at, self._agreed_step = now, step
        return bool(mine[1]), int(mine[0])

    # ---------------------------------------------------------------------------------------- writing
    def _save_then_stop(self, trainer: Any, signum: int, step_file: bool = True) -> None:
        if signum and self._stopper is not None:
            self._stopper.stopping()  # from here on, a timer or another signal must not end this rank
        self._save(trainer, step_file=step_file)
        if signum:
            self._finish_async(trainer)  # stopping: the checkpoint named below is on disk first
        if signum and not _last_step(trainer):
            rank_zero_info(f"parallelkit: stopped on {signal.Signals(signum).name} after step {trainer.global_step}, "
                           f"checkpoint {self.last_model_path}; resume with ckpt_path=last.")
            raise StoppedBySignal(signum)

    def _save(self, trainer: Any, step_file: bool) -> None:
        """``last.ckpt``, then the step checkpoint; then the oldest step checkpoints beyond ``save_top_k`` go."""
        from torch.distributed.checkpoint.api import CheckpointException

        began = time.perf_counter()
        self._finish_async(trainer)  # one save in flight at most: a save due before the previous one is written waits
        for logger in trainer.loggers:  # the rows of the steps this checkpoint holds are on disk before it is
            logger.save()
        step = trainer.global_step
        paths = [self.dirpath / LAST]
        if step_file and self.save_top_k != 0:
            paths.append(self.dirpath / f"epoch={trainer.current_epoch}-step={step}.ckpt")
        if self._writer is not None:
            # Returns once staged, but for the parameters and moments: those are copied while the next step's forward
            # and backward run (until on_before_optimizer_step); written in the background.
            record = self._writer.start(trainer, paths, defer=_unchanged_until_the_optimizer_steps(trainer))
            self._saved_step, self._saved_at = step, time.monotonic()
            # stall: the wait for the previous save, the loggers and the staging; write: on disk after staging began
            self.save_records.append({"step": step, "began": began, "stall_s": time.perf_counter() - began, "dump_s": record.dump_s,
                                      "stage_s": record.stall_s - record.dump_s, "staged_wait_s": 0.0, "deferred": None,
                                      "write_s": None, "async": True})
            return
        for path in paths:
            try:
                trainer.save_checkpoint(path, weights_only=False)
            except (OSError, CheckpointException) as err:
                raise self._write_failed(trainer, path, err) from None
            except RuntimeError as err:
                if "inline_container" not in str(err):  # torch.save's writer on a full disk; else not a write error
                    raise
                raise self._write_failed(trainer, path, err) from None
        self.last_model_path = str(paths[0])
        self._saved_step, self._saved_at = step, time.monotonic()
        self._written_step = step
        elapsed = time.perf_counter() - began
        self.save_records.append({"step": step, "began": began, "stall_s": elapsed, "write_s": elapsed, "async": False})
        self._prune(trainer)

    def _staged(self) -> None:
        """Wait until the save in flight holds its own copy of the deferred tensors (counted in its stall)."""
        if self._writer is None or not self._writer.in_flight:
            return
        waited = self._writer.wait_staged()
        entry = self.save_records[-1]
        entry["stall_s"] += waited
        entry["staged_wait_s"] += waited
        entry["deferred"] = self._writer.records[-1].deferred

    def _finish_async(self, trainer: Any) -> None:
        """Wait for the background save in flight, if any; every rank learns whether some rank's write failed (the
        writers agree on it when their writes end) and raises :class:`WriteFailed` if one did."""
        if self._writer is None or not self._writer.in_flight:
            return
        record = self._writer.wait()
        failed = record.error is not None
        failed_somewhere = failed if record.failed_anywhere is None else record.failed_anywhere
        if not failed_somewhere:
            self._completed(trainer, record, prune=True)
            return
        path = record.paths[0]
        if failed:
            raise self._write_failed(trainer, path, record.error, step=record.step) from None
        raise WriteFailed(f"could not write the checkpoint {path} at step {record.step}: another rank's write failed (it says why).",
                          report=False)

    def _completed(self, trainer: Any, record: Any, prune: bool) -> None:
        self.last_model_path = str(record.paths[0])
        self._written_step = record.step
        self.save_records[-1]["write_s"] = record.write_s
        if prune:
            self._prune(trainer)

    def _prune(self, trainer: Any) -> None:
        if self.save_top_k < 0:
            return
        names = None
        if trainer.is_global_zero and self.dirpath.is_dir():
            found = sorted((int(m.group(1)), p.name) for p in self.dirpath.iterdir() if (m := CHECKPOINT_NAME.match(p.name)))
            old = found[:-self.save_top_k] if self.save_top_k else found
            resumed = Path(trainer.ckpt_path).resolve() if trainer.ckpt_path else None
            names = [name for _, name in old if (self.dirpath / name).resolve() != resumed]  # Lightning keeps that one too
        # Every rank calls the strategy with the same list (a strategy may remove collectively).
        for name in trainer.strategy.broadcast(names) or []:
            trainer.strategy.remove_checkpoint(self.dirpath / name)

    def _write_failed(self, trainer: Any, path: Path, err: BaseException, step: int | None = None) -> WriteFailed:
        step = trainer.global_step if step is None else step
        failures = getattr(err, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
        if failures:
            what = "; ".join(f"rank {rank}: {_reason(failure)}" for rank, failure in sorted(failures.items()))
            report = trainer.is_global_zero
        else:
            what = f"rank {trainer.global_rank}: {_reason(err)}"
            report = True
        previous = (f"{self.dirpath / LAST} (step {self._written_step})" if (self.dirpath / LAST).exists()
                    else "there is none yet: this run had written no checkpoint")
        return WriteFailed(
            f"could not write the checkpoint {path} at step {step} ({what}). Training stopped; the previous "
            f"checkpoint is intact: {previous}. Free space on that file system (or point hydra.run.dir elsewhere), then go "
            "on with ckpt_path=last.",
            report=report,
        )


def _reason(failure: Any) -> str:
    error = failure[0] if isinstance(failure, tuple) else failure
    if isinstance(error, OSError) and error.strerror:
        return f"{error.strerror} (errno {error.errno})"
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"


def continue_the_epoch(checkpoint: dict[str, Any], datamodule_key: str | None = None) -> bool:
    """Make a checkpoint written in ``on_train_end`` of a run that stopped mid-epoch go on in that epoch.

    parallelkit wrote its final checkpoint there until issue 33 (now: at the last step's boundary), and still does
    for a run that a callback stopped. By then Lightning's fit loop has counted the epoch as finished although its
    data were not (the epoch's last batch not reached): resumed as it is, Lightning goes on in the *next* epoch at
    the same batch index, another data order and other dropout streams than the uninterrupted run's. Such a
    checkpoint becomes the one Lightning writes after a mid-epoch batch and its validation: the two differ in the
    epoch counters only, and in the epoch of the data module's position (``checkpoint[datamodule_key]``, as
    :class:`parallelkit.data.base.DataParallelDataModule` records it). Returns whether it did.
    """
    loop = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    epochs, batches = loop.get("epoch_progress"), loop.get("epoch_loop.batch_progress")
    if not epochs or not batches:
        return False
    epoch, batch = epochs["current"], batches["current"]
    finished = epoch["ready"] == epoch["started"] == epoch["processed"] == epoch["completed"] > 0
    stopped_mid_epoch = not batches.get("is_last_batch", True) and batch["started"] == batch["processed"] == batch["completed"] > 0
    if not (finished and stopped_mid_epoch):
        return False
    counted = epoch["completed"]  # Lightning's current_epoch in that state: one too many
    for progress in (epochs["current"], epochs["total"]):
        progress["processed"] -= 1
        progress["completed"] -= 1
    if checkpoint.get("epoch") == counted:
        checkpoint["epoch"] = counted - 1
    position = checkpoint.get(datamodule_key) if datamodule_key else None
    if isinstance(position, dict) and position.get("epoch") == counted:
        position["epoch"] = counted - 1
    return True


def _validation_follows(trainer: Any) -> bool:
    """Whether Lightning validates right after this batch (it decides in the epoch loop's ``on_advance_end``)."""
    batches = trainer.num_val_batches
    if not (sum(batches) if isinstance(batches, list) else batches):
        return False  # no validation batches: Lightning skips the loop, and on_validation_end with it
    return bool(trainer.fit_loop.epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher))


def _unchanged_until_the_optimizer_steps(trainer: Any) -> Any:
    """Which tensors of the model's and optimizers' state dicts nothing changes between a save at a step boundary
    and the next ``on_before_optimizer_step``: all but the module's buffers (a forward may update them, e.g. batch
    norm's running statistics). ``None`` (nothing deferred) under manual optimization, where the module's own code
    may change anything anywhere in its training step."""
    from parallelkit.distributed.async_checkpoint import storage_key

    module = trainer.lightning_module
    if not getattr(module, "automatic_optimization", False):
        return None
    buffers = {storage_key(b) for b in module.buffers()}
    return lambda tensor: storage_key(tensor) not in buffers


def _last_step(trainer: Any) -> bool:
    return trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps
