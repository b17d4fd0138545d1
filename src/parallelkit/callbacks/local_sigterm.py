"""SIGTERM and SIGINT: checkpoint at the next step boundary the ranks agree on, then stop; no per-batch collective.

Lightning 2.6 broadcasts a "got SIGTERM?" flag from rank 0 before *every* training batch (a blocking
collective: 0.3–1 ms per step on 2 gloo CPU ranks, 1–2 % of a small model's step), and its SIGTERM handler
broadcasts too, from inside the signal handler (which made a lone rank's SIGTERM wait for the collective
timeout: rank 0 never joins it). Both go. Instead a rank that receives SIGTERM (what SLURM, torchrun and
Kubernetes send before they kill) or SIGINT (Ctrl-C) only records it. ``PeriodicCheckpoint`` already has the
ranks agree, every second or two of training, on whether a time-based checkpoint is due; the same small
all-reduce carries "some rank was asked to stop". All ranks then write a checkpoint at that step boundary
(a sharded one needs every rank) and leave with 128 + the signal number (143, 130). Ranks that got no
signal stop too: their peers are leaving. An interrupted run so loses nothing it trained.

If no agreed step boundary comes within ``grace_s`` (a step or a validation longer than that, a rank stuck),
the rank that got the signal leaves at once without a checkpoint (the newest periodic one stays), before the
sender's kill; a second signal does the same. Without a ``PeriodicCheckpoint`` (``checkpoint_on_signal=False``)
or before training starts, a signal stops the rank after its batch, as Lightning does, with no checkpoint.

Relies on two private Lightning 2.6.6 members (pinned); ``check_lightning_members`` fails loudly if an
upgrade renames them.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any, Callable

from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from parallelkit.errors import ConfigError

log = logging.getLogger(__name__)


def check_lightning_members(trainer: Any) -> None:
    """Raise if Lightning no longer has the members this callback replaces (an upgrade changed them)."""
    missing = [
        name
        for owner, name in ((trainer.fit_loop.epoch_loop, "_broadcast_sigterm_tensor"), (trainer._signal_connector, "_sigterm_notifier_fn"))
        if not callable(getattr(owner, name, None))
    ]
    if missing:
        raise RuntimeError(f"LocalSigterm: Lightning has no {', '.join(missing)} any more; check the pinned version.")


class StoppedBySignal(SystemExit):
    """The job stopped because a rank received ``signum``: exit code 128 + ``signum`` (143 for SIGTERM)."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + int(signum))
        self.signum = int(signum)


class LocalSigterm(Callback):
    """Each rank records its own SIGTERM/SIGINT; the ranks checkpoint at an agreed step boundary and stop.

    Args:
        checkpoint_on_signal: wait for the checkpoint the ranks agree on (a ``PeriodicCheckpoint`` in the same
            Trainer agrees on it, :meth:`agreement_signal`); ``False``, or without one: stop after the current
            batch, without a checkpoint.
        grace_s: how long a signalled rank waits for that step boundary before it leaves without a checkpoint.
        on_leave: called just before a signalled rank leaves without a checkpoint: ``parallelkit.run`` hands in the
            launcher's, which stops the local ranks this rank started.

    Example::

        Trainer(strategy=..., callbacks=[PeriodicCheckpoint("run/checkpoints"), LocalSigterm(grace_s=20)])
    """

    def __init__(self, checkpoint_on_signal: bool = True, grace_s: float = 20.0, on_leave: Callable[[], None] | None = None) -> None:
        if not isinstance(grace_s, (int, float)) or isinstance(grace_s, bool) or grace_s <= 0:
            raise ConfigError(f"checkpoint.signal_grace_s should be a number of seconds greater than 0. Got {grace_s!r}.")
        self.checkpoint_on_signal = bool(checkpoint_on_signal)
        self.grace_s = float(grace_s)
        self.on_leave = on_leave
        self.requested_signal = 0  # the signal this rank received while training, until the ranks act on it
        self._lock = threading.Lock()
        self._committed = False  # the ranks agreed to checkpoint: the grace timer must not end this rank
        self._timer: threading.Timer | None = None
        self._training = False
        self._trainer: Any = None
        self._agreed_by: Any = None  # the checkpoint callback that asks for signals (connect)

    # ------------------------------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # Runs before Lightning registers its signal handlers (Trainer._run), which read the notifier below.
        check_lightning_members(trainer)
        self._trainer = trainer
        trainer._signal_connector._sigterm_notifier_fn = self._on_signal
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._training = True
        if self.checkpoint_on_signal and threading.current_thread() is threading.main_thread():
            # Lightning leaves SIGINT to Python (KeyboardInterrupt wherever the main thread is, mid-collective
            # included); its signal connector restores this handler when fit ends.
            signal.signal(signal.SIGINT, self._on_signal)

    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._training = False
        self._cancel_timer()

    @override
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._training = False
        self._cancel_timer()

    # ------------------------------------------------------------------------------------------ the protocol
    def connect(self, checkpoint: Any) -> None:
        """Called by the checkpoint callback that will ask :meth:`agreement_signal` at its agreements: only then
        is waiting for a checkpoint worth a signal's grace period."""
        self._agreed_by = checkpoint

    def agreement_signal(self) -> int:
        """The signal this rank brings to the ranks' agreement (0: none). Called by the checkpoint callback just
        before its collective: a rank that brings one is committed to the checkpoint, and its grace timer stops."""
        with self._lock:
            if self.requested_signal:
                self._committed = True
                self._cancel_timer()
            return self.requested_signal

    def stopping(self) -> None:
        """The ranks agreed to checkpoint and stop: no timer or later signal may end this rank before that."""
        with self._lock:
            self._committed = True
            self._cancel_timer()

    def _on_signal(self, signum: Any, frame: Any) -> None:
        trainer = self._trainer
        connector = trainer._signal_connector
        name = signal.Signals(signum).name
        if self._committed:
            return  # the checkpoint is being written; the stop follows it
        first = not self.requested_signal and not connector.received_sigterm
        if first and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)  # ranks Lightning's launcher started get it too
        if first and self.checkpoint_on_signal and self._training and self._agreed_by is not None:
            log.info(f"Received {name} (rank {trainer.global_rank}): checkpoint at the next agreed step boundary, then stop")
            with self._lock:
                self.requested_signal = int(signum)
                self._timer = threading.Timer(self.grace_s, self._give_up, args=(int(signum),))
                self._timer.daemon = True
                self._timer.start()
            return
        if self.requested_signal:
            self._give_up(int(signum), again=True)  # a second signal: stop now
            return
        log.info(f"Received {name} (rank {trainer.global_rank})")
        self.requested_signal = int(signum)
        connector.received_sigterm = True  # Lightning's loops check it after each batch and stop

    def _give_up(self, signum: int, again: bool = False) -> None:
        """No agreed step boundary within ``grace_s`` (or a second signal): leave now, without a checkpoint."""
        with self._lock:
            if self._committed:
                return
            self._committed = True  # agreement_signal() now reports nothing more: this rank is leaving
            self._timer = None
        why = "a second signal" if again else f"no step boundary within {self.grace_s:g} s"
        rank = getattr(self._trainer, "global_rank", "?")
        print(f"parallelkit: rank {rank} stops on {signal.Signals(signum).name} without a checkpoint ({why}); "
              "the newest periodic checkpoint stays: resume with ckpt_path=last.", file=sys.stderr, flush=True)
        if self.on_leave is not None:
            self.on_leave()  # rank 0 of a local job: the ranks it started leave too
        sys.stdout.flush()
        os._exit(128 + signum)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
