"""SIGTERM handling without a collective before every batch.

Lightning 2.6 broadcasts a "got SIGTERM?" flag from rank 0 before *every* training batch (a blocking
collective: 0.3–1 ms per step on 2 gloo CPU ranks, 1–2 % of a small model's step), and its SIGTERM handler
broadcasts too, from inside the signal handler. parallelkit does not need either: a rank that receives
SIGTERM finishes its batch, raises Lightning's ``SIGTERMException`` and tears its process group down, so its
peers' next collective fails at once ("connection closed by peer") and they exit with code 3; SLURM and
torchrun send SIGTERM to every rank anyway. The handler's own broadcast is what made a lone rank's SIGTERM
wait for the collective timeout once the per-batch broadcast was gone (rank 0 never joins it), so both go.

Relies on two private Lightning 2.6.6 members (pinned); ``check_lightning_members`` fails loudly if an
upgrade renames them.
"""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch.callbacks import Callback

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


class LocalSigterm(Callback):
    """Each rank handles its own SIGTERM; no per-batch broadcast (see the module docstring).

    Example::

        Trainer(strategy=..., callbacks=[LocalSigterm()])
    """

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # Runs before Lightning registers its signal handlers (Trainer._run), which read the notifier below.
        check_lightning_members(trainer)
        connector = trainer._signal_connector

        def notify(signum: Any, frame: Any) -> None:
            log.info(f"Received SIGTERM: {signum} (rank {trainer.global_rank})")
            if not connector.received_sigterm and trainer.strategy.launcher is not None:
                trainer.strategy.launcher.kill(signum)  # ranks Lightning's launcher started get it too
            connector.received_sigterm = True

        connector._sigterm_notifier_fn = notify
        trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None
