"""Faults in the background checkpoint writer (``checkpoint.async_save=true``), for test_async_checkpoint.py
(imported via PYTHONPATH, as ``fault_injection``)."""

import json
import os
import sys
import threading
import time

from lightning.pytorch.callbacks import Callback


class AsyncWriteFault(Callback):
    """Make every background checkpoint write of this job wait ``delay_s`` before it writes (so training visibly
    goes on meanwhile) and log each write; optionally kill global rank ``rank`` half-way through its ``nth`` write
    (1-based), or write the tensors without staging them first (a deliberately broken writer). The delay comes
    after the copy the writer makes on its thread (the parameters and moments, while the next step computes):
    a slow disk. ``stage_delay_s`` holds that copy back instead, so that the training thread must wait for it
    before the optimizer steps; ``wait_for_copy=False`` removes that wait (a deliberately broken callback).

    The log (``log_to``, one JSON file per rank) lists, per write: the checkpoint's step, when the write began and
    ended (monotonic seconds), the optimizer step training had reached at its end, and how many writer threads
    were alive when it began.
    """

    def __init__(self, delay_s: float = 1.0, rank: int = -1, nth: int = 0, log_to: str | None = None, stage: bool = True,
                 stage_delay_s: float = 0.0, wait_for_copy: bool = True) -> None:
        self.delay_s = delay_s
        self.stage_delay_s = stage_delay_s
        self.wait_for_copy = wait_for_copy
        self.rank = rank
        self.nth = nth
        self.log_to = log_to
        self.stage = stage
        self.writes: list[dict] = []
        self.copies: dict[int, dict] = {}  # per saved step: when the deferred copy was done, when training waited for it

    def setup(self, trainer, pl_module, stage) -> None:
        import torch.distributed.checkpoint.filesystem as dcp_files

        from parallelkit import run_dir
        from parallelkit.distributed.async_checkpoint import AsyncCheckpointWriter

        callback = self
        from parallelkit.callbacks.periodic_checkpoint import PeriodicCheckpoint

        real_start, real_write, real_setup = AsyncCheckpointWriter.start, AsyncCheckpointWriter._write, AsyncCheckpointWriter.setup
        real_deferred, real_wait_staged = AsyncCheckpointWriter._stage_deferred, AsyncCheckpointWriter.wait_staged
        real_atomic, real_item = run_dir.write_atomically, dcp_files._write_item
        kills_here = trainer.global_rank == self.rank
        started = {"saves": 0}

        def armed() -> bool:  # this rank's nth save is the one being written (one in flight at most)
            return kills_here and started["saves"] == callback.nth

        def start(writer, *args, **kwargs):
            started["saves"] += 1
            return real_start(writer, *args, **kwargs)

        def die(what) -> None:
            print(f"fault_injection: killing rank {callback.rank} while writing {what} in the background, training at step "
                  f"{trainer.global_step}", file=sys.stderr, flush=True)
            os._exit(13)

        def write(writer, work, record):
            began = time.monotonic()
            alive = sum(t.name.startswith("parallelkit-checkpoint") for t in threading.enumerate())
            real_write(writer, work, record)
            callback.writes.append({"step": record.step, "began": began, "ended": time.monotonic(),
                                    "training_step_at_end": trainer.global_step, "writer_threads": alive,
                                    "error": None if record.error is None else repr(record.error)})

        def stage_deferred(writer, staged, deferred, record):  # on the writer's thread, first thing: the deferred copy
            time.sleep(callback.stage_delay_s)
            real_deferred(writer, staged, deferred, record)
            callback.copies.setdefault(record.step, {})["copy_done"] = time.perf_counter()
            time.sleep(callback.delay_s)  # then a slow disk, training going on

        def wait_staged(writer):  # the training thread's wait for that copy: when it began and ended
            began = time.perf_counter()
            waited = real_wait_staged(writer)
            if waited:
                callback.copies.setdefault(writer.records[-1].step, {}).update(wait_began=began, wait_ended=time.perf_counter())
            return waited

        def write_atomically(path, write_file):  # a file checkpoint: half of it on disk, then the process dies
            if not armed():
                return real_atomic(path, write_file)

            def half_then_die(file):
                write_file(file)
                file.truncate(file.tell() // 2)
                file.flush()
                die(f"checkpoint file {path}")
            return real_atomic(path, half_then_die)

        def write_item(transforms, stream, data, *args, **kwargs):  # a shard: part of it on disk, then the process dies
            if armed():  # in torch's writer thread, which starts at once: held back here as the file writes are above
                time.sleep(callback.delay_s)
                stream.write(b"half a shard")
                stream.flush()
                die(f"sharded checkpoint {getattr(stream, 'name', '')}")
            return real_item(transforms, stream, data, *args, **kwargs)

        def setup_without_staging(writer, strategy):
            real_setup(writer, strategy)

            class Unstaged:  # hands the live tensors to the writer: the next steps change them before they are written
                def stage(self, state_dict, **kwargs):
                    return state_dict

                should_synchronize_after_execute = False

                def close(self):
                    pass

            writer._stager = Unstaged()

        AsyncCheckpointWriter.start = start
        AsyncCheckpointWriter._write = write
        AsyncCheckpointWriter._stage_deferred = stage_deferred
        AsyncCheckpointWriter.wait_staged = wait_staged
        if not self.wait_for_copy:
            PeriodicCheckpoint._staged = lambda checkpoint: None
        run_dir.write_atomically = write_atomically
        dcp_files._write_item = write_item
        if not self.stage:
            AsyncCheckpointWriter.setup = setup_without_staging

    def teardown(self, trainer, pl_module, stage) -> None:
        if self.log_to:
            with open(f"{self.log_to}.rank{trainer.global_rank}.json", "w") as file:
                json.dump(self.writes, file)
            saves = next(cb.save_records for cb in trainer.callbacks if hasattr(cb, "save_records"))
            saves = [{**save, **self.copies.get(save["step"], {})} for save in saves]
            with open(f"{self.log_to}.saves.rank{trainer.global_rank}.json", "w") as file:
                json.dump(saves, file)
