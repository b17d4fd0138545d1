"""A callback that kills one rank mid-training, for the failure-path tests (imported via PYTHONPATH)."""

import os
import sys

from lightning.pytorch.callbacks import Callback


class KillRank(Callback):
    """Exit the process of global rank ``rank`` abruptly (no cleanup) once ``at_step`` steps are done."""

    def __init__(self, rank: int, at_step: int, exit_code: int = 13, only_attempt: int | None = None) -> None:
        self.rank = rank
        self.at_step = at_step
        self.exit_code = exit_code
        self.only_attempt = only_attempt  # under torchrun: kill only in this attempt (restart count)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if self.only_attempt is not None and attempt != self.only_attempt:
            return
        if trainer.global_rank == self.rank and trainer.global_step >= self.at_step:
            print(f"fault_injection: killing rank {self.rank} at step {trainer.global_step}", file=sys.stderr, flush=True)
            os._exit(self.exit_code)


class SigtermRank(Callback):
    """Send SIGTERM to the process of global rank ``rank`` once ``at_step`` steps are done (once)."""

    def __init__(self, rank: int, at_step: int) -> None:
        self.rank = rank
        self.at_step = at_step
        self.sent = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import signal

        if trainer.global_rank == self.rank and trainer.global_step >= self.at_step and not self.sent:
            self.sent = True
            print(f"fault_injection: SIGTERM to rank {self.rank} at step {trainer.global_step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)


class SigtermDuringValidation(Callback):
    """Send SIGTERM to global rank ``rank`` at the first batch of the first validation after step ``after_step``."""

    def __init__(self, rank: int, after_step: int) -> None:
        self.rank = rank
        self.after_step = after_step
        self.sent = False

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        import signal

        if trainer.global_rank == self.rank and trainer.global_step >= self.after_step and not self.sent and not trainer.sanity_checking:
            self.sent = True
            print(f"fault_injection: SIGTERM to rank {self.rank} during the validation after step {trainer.global_step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)


class ForgetDataPosition(Callback):
    """A deliberately broken resume (negative control): drop the sampler's mid-epoch position before training."""

    def on_train_start(self, trainer, pl_module) -> None:
        sampler = getattr(trainer.datamodule, "_train_sampler", None)
        if sampler is not None:
            sampler._resume = {}


class KillDuringSave(Callback):
    """Kill global rank ``rank`` in the middle of writing the ``nth`` checkpoint (1-based), after part of its
    data is on disk: a sharded save (torch.distributed.checkpoint) or a single-file save (parallelkit's atomic
    writer, ``parallelkit.run_dir.write_atomically``)."""

    def __init__(self, rank: int, nth: int) -> None:
        self.rank = rank
        self.nth = nth
        self.saves = 0

    def setup(self, trainer, pl_module, stage) -> None:
        if trainer.global_rank != self.rank:
            return
        import torch.distributed.checkpoint as dcp

        from parallelkit import run_dir

        callback = self
        real_save, real_write = dcp.save, run_dir.write_atomically

        def dying(what: str, path) -> None:
            print(f"fault_injection: killing rank {callback.rank} while writing {what} {path}", file=sys.stderr, flush=True)
            os._exit(13)

        def save(state_dict, *args, checkpoint_id=None, **kwargs):
            callback.saves += 1
            if callback.saves == callback.nth:
                from pathlib import Path

                Path(checkpoint_id).mkdir(parents=True, exist_ok=True)
                (Path(checkpoint_id) / f"__{callback.rank}_0.distcp").write_bytes(b"half a shard")
                dying("sharded checkpoint", checkpoint_id)
            return real_save(state_dict, *args, checkpoint_id=checkpoint_id, **kwargs)

        def write_atomically(path, write):
            if str(path).endswith(".ckpt"):
                callback.saves += 1
                if callback.saves == callback.nth:
                    def half_then_die(file):
                        write(file)
                        file.truncate(file.tell() // 2)
                        file.flush()
                        dying("checkpoint file", path)
                    return real_write(path, half_then_die)
            return real_write(path, write)

        dcp.save = save
        run_dir.write_atomically = write_atomically


class FailWrite(Callback):
    """A full disk (simulated): the ``nth`` checkpoint write of global rank ``rank`` (1-based) fails with
    ``ENOSPC`` after part of its data is written — in parallelkit's single-file writer, or inside
    ``torch.distributed.checkpoint``'s file writer for a sharded checkpoint."""

    def __init__(self, rank: int, nth: int) -> None:
        self.rank = rank
        self.nth = nth
        self.writes = 0

    def setup(self, trainer, pl_module, stage) -> None:
        if trainer.global_rank != self.rank:
            return
        import errno

        import torch.distributed.checkpoint as dcp
        import torch.distributed.checkpoint.filesystem as dcp_files

        from parallelkit import run_dir

        callback = self
        real_save, real_write, real_item = dcp.save, run_dir.write_atomically, dcp_files._write_item
        failing = {"now": False}

        def full(path) -> OSError:
            print(f"fault_injection: rank {callback.rank}: no space left while writing {path}", file=sys.stderr, flush=True)
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def save(state_dict, *args, checkpoint_id=None, **kwargs):
            callback.writes += 1
            failing["now"] = callback.writes == callback.nth
            try:
                return real_save(state_dict, *args, checkpoint_id=checkpoint_id, **kwargs)
            finally:
                failing["now"] = False

        def write_item(transforms, stream, data, *args, **kwargs):
            if failing["now"]:
                stream.write(b"part of a shard")
                raise full(getattr(stream, "name", "a shard"))
            return real_item(transforms, stream, data, *args, **kwargs)

        def write_atomically(path, write):
            if str(path).endswith(".ckpt"):
                callback.writes += 1
                if callback.writes == callback.nth:
                    def partial(file):
                        file.write(b"part of a checkpoint")
                        raise full(path)
                    return real_write(path, partial)
            return real_write(path, write)

        dcp.save = save
        dcp_files._write_item = write_item
        run_dir.write_atomically = write_atomically
        if trainer.strategy.strategy_name == "deepspeed":
            self._fail_deepspeed(full)

    def _fail_deepspeed(self, full) -> None:
        """DeepSpeed writes each rank's files with its checkpoint engine's ``save`` (torch.save) inside
        ``DeepSpeedEngine.save_checkpoint``: the nth of those calls fails on the first file this rank writes."""
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
        from deepspeed.runtime.engine import DeepSpeedEngine

        callback, failing = self, {"now": False}
        real_checkpoint, real_file = DeepSpeedEngine.save_checkpoint, TorchCheckpointEngine.save

        def save_checkpoint(engine, *args, **kwargs):
            callback.writes += 1
            failing["now"] = callback.writes == callback.nth
            try:
                return real_checkpoint(engine, *args, **kwargs)
            finally:
                failing["now"] = False

        def save_file(engine, state_dict, path):
            if failing["now"]:
                with open(path, "wb") as file:
                    file.write(b"part of a DeepSpeed file")
                raise full(path)
            return real_file(engine, state_dict, path)

        DeepSpeedEngine.save_checkpoint = save_checkpoint
        TorchCheckpointEngine.save = save_file


class StepStamp(Callback):
    """Print each finished optimizer step of rank 0 with a wall-clock time (to time a restart)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 0:
            import time

            print(f"fault_injection: step {trainer.global_step} done at {time.time():.3f}", file=sys.stderr, flush=True)


class StallRank(Callback):
    """Make global rank ``rank`` stop responding (sleep, no exit) once ``at_step`` steps are done: a stuck rank."""

    def __init__(self, rank: int, at_step: int, seconds: float = 3600.0) -> None:
        self.rank = rank
        self.at_step = at_step
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step >= self.at_step:
            import time

            print(f"fault_injection: stalling rank {self.rank} at step {trainer.global_step}", file=sys.stderr, flush=True)
            time.sleep(self.seconds)


class RequireCollector(Callback):
    """Fail the run if CPython's garbage collector is still off when training starts on this rank
    (``parallelkit.launch.startup_gc`` pauses it during start-up and must have turned it back on)."""

    def on_train_start(self, trainer, pl_module) -> None:
        import gc

        if not gc.isenabled():
            raise RuntimeError(f"rank {trainer.global_rank}: the garbage collector is still off when training starts")
        print(f"fault_injection: rank {trainer.global_rank} trains with the collector on", file=sys.stderr, flush=True)


class ReportThreads(Callback):
    """Say how many intra-op threads torch uses on this rank when training starts."""

    def on_train_start(self, trainer, pl_module) -> None:
        import torch

        print(f"fault_injection: rank {trainer.global_rank} trains with {torch.get_num_threads()} threads", file=sys.stderr, flush=True)


class RecordListeners(Callback):
    """Write the TCP sockets this rank listens on (``parallelkit.distributed.listeners.listening_sockets``) to
    ``DIR/listeners_rank<R>.json`` once ``at_step`` steps are done: every store, process group and RPC agent
    of the job exists by then, and the job is still running."""

    def __init__(self, at_step: int, out_dir: str) -> None:
        self.at_step = at_step
        self.out_dir = out_dir
        self.done = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.at_step and not self.done:
            import json

            self.done = True
            from parallelkit.distributed.listeners import listening_sockets

            path = os.path.join(self.out_dir, f"listeners_rank{trainer.global_rank}.json")
            with open(path, "w") as f:
                json.dump({"pid": os.getpid(), "listening": listening_sockets()}, f)


class InfGradient(Callback):
    """Put an inf into one gradient of global rank ``rank`` (only) after the backward of step ``at_step``, and at the
    end write what this rank's loss scaler did to ``DIR/amp_rank{r}.json`` (every rank), for the overflow tests."""

    def __init__(self, rank: int, at_step: int) -> None:
        self.rank = rank
        self.at_step = at_step

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.at_step:
            return
        for param in pl_module.parameters():
            if param.grad is not None:
                grad = param.grad._local_tensor if hasattr(param.grad, "_local_tensor") else param.grad
                grad.view(-1)[0] = float("inf")
                print(f"fault_injection: inf in a gradient of rank {self.rank} at step {trainer.global_step}", file=sys.stderr, flush=True)
                return

    def on_train_end(self, trainer, pl_module) -> None:
        import json
        from pathlib import Path

        scaler = getattr(trainer.strategy.precision_plugin, "scaler", None)
        record = {"rank": trainer.global_rank, "loss_scale": scaler.scale, "skipped_steps": scaler.skipped_steps}
        (Path(trainer.default_root_dir) / f"amp_rank{trainer.global_rank}.json").write_text(json.dumps(record))


class DropGradSync(Callback):
    """Remove the strategy's gradient syncs of one ``kind`` (e.g. ``grad_allreduce``) before training: the negative
    control of a composition test, whose comparison with one process must then fail."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def on_train_start(self, trainer, pl_module) -> None:
        syncs = trainer.strategy.grad_syncs
        kept = [s for s in syncs if getattr(s, "kind", None) != self.kind]
        assert len(kept) < len(syncs), f"no gradient sync of kind {self.kind!r} to drop"
        trainer.strategy.grad_syncs[:] = kept


class FinalCheckpointAtTrainEnd(Callback):
    """The final checkpoint as parallelkit wrote it before issue 33's fix: ``last.ckpt`` rewritten in
    ``on_train_end``, where Lightning has already counted the epoch as finished although ``trainer.max_steps``,
    not the data, ended it (a single-file checkpoint: strategy=ddp)."""

    def on_train_end(self, trainer, pl_module) -> None:
        from pathlib import Path

        trainer.save_checkpoint(Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt")


class KeepRestoredLearningRate(Callback):
    """A resume without ``parallelkit.callbacks.resumed_schedule`` (a negative control): the first resumed step
    trains at the learning rate the checkpoint's optimizer holds (the earlier run's schedule), as before issue 33's
    fix. User callbacks' ``on_train_start`` runs before ResumedSchedule's, so this one sees the restored rates."""

    def __init__(self) -> None:
        self.restored = None

    def on_train_start(self, trainer, pl_module) -> None:
        self.restored = [[group["lr"] for group in optimizer.param_groups] for optimizer in trainer.optimizers]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.restored is None:
            return
        for optimizer, rates in zip(trainer.optimizers, self.restored):
            for group, rate in zip(optimizer.param_groups, rates):
                group["lr"] = rate
        self.restored = None
