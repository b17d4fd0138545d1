"""A callback that kills one rank mid-training, for the failure-path tests (imported via PYTHONPATH)."""

import os
import sys

from lightning.pytorch.callbacks import Callback


class KillRank(Callback):
    """Exit the process of global rank ``rank`` abruptly (no cleanup) once ``at_step`` steps are done."""

    def __init__(self, rank: int, at_step: int, exit_code: int = 13) -> None:
        self.rank = rank
        self.at_step = at_step
        self.exit_code = exit_code

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
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


class ForgetDataPosition(Callback):
    """A deliberately broken resume (negative control): drop the sampler's mid-epoch position before training."""

    def on_train_start(self, trainer, pl_module) -> None:
        sampler = getattr(trainer.datamodule, "_train_sampler", None)
        if sampler is not None:
            sampler._resume = {}
