"""Callbacks for the elastic shrink/grow tests (imported by the workers via PYTHONPATH)."""

import os
import sys
import time

from lightning.pytorch.callbacks import Callback


class PauseAt(Callback):
    """Global rank ``rank`` stops after step ``at_step`` of attempt ``only_attempt`` (torchrun's restart count), at
    ``world_size`` processes if given, and writes its pid to ``marker``; then it waits to be killed with its agent
    (the test's "lost node"). Once only: not when ``marker`` exists (an agent that joins later counts its attempts
    from 0 again). A rank nobody kills exits 17 after ``wait_s``: a test that forgot it fails instead of hanging."""

    def __init__(self, rank: int, at_step: int, marker: str, only_attempt: int = 0, world_size: int | None = None, wait_s: float = 120) -> None:
        self.rank, self.at_step, self.marker = rank, at_step, marker
        self.only_attempt, self.world_size, self.wait_s = only_attempt, world_size, wait_s

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) != self.only_attempt:
            return
        if (self.world_size is not None and trainer.world_size != self.world_size) or os.path.exists(self.marker):
            return
        if trainer.global_rank == self.rank and trainer.global_step >= self.at_step:
            tmp = f"{self.marker}.tmp"
            with open(tmp, "w") as f:
                f.write(str(os.getpid()))
            os.replace(tmp, self.marker)
            print(f"elastic_faults: rank {self.rank} paused at step {trainer.global_step}", file=sys.stderr, flush=True)
            time.sleep(self.wait_s)
            os._exit(17)


class HoldAtWorld(Callback):
    """While the job runs at ``world_size`` processes: after step ``from_step`` rank 0 writes ``marker`` (the test
    then starts another agent, which joins the running job), and after step ``hold_step`` every rank waits until
    it receives torchrun's SIGTERM (the agents stopping the workers to let the new node in; parallelkit's
    ``LocalSigterm`` records it), at most ``max_wait_s``. So the job grows back at ``hold_step``, however long the
    new agent takes to start."""

    def __init__(self, world_size: int, from_step: int, hold_step: int, marker: str, max_wait_s: float = 120) -> None:
        self.world_size, self.from_step, self.hold_step, self.marker, self.max_wait_s = world_size, from_step, hold_step, marker, max_wait_s

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.world_size != self.world_size or trainer.global_step < self.from_step:
            return
        if trainer.global_rank == 0 and not os.path.exists(self.marker):
            with open(f"{self.marker}.tmp", "w") as f:
                f.write(str(trainer.global_step))
            os.replace(f"{self.marker}.tmp", self.marker)
        if trainer.global_step != self.hold_step:
            return
        deadline = time.monotonic() + self.max_wait_s
        while time.monotonic() < deadline and not any(getattr(c, "requested_signal", 0) for c in trainer.callbacks):
            time.sleep(0.05)
