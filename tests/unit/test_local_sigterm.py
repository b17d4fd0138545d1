"""LocalSigterm replaces Lightning's per-batch SIGTERM broadcast; the pinned Lightning must still have it."""

from __future__ import annotations

import signal
import types

import pytest


def test_replaces_the_per_batch_broadcast_and_the_broadcasting_handler():
    import lightning.pytorch as pl

    from parallelkit.callbacks.local_sigterm import LocalSigterm

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    original = trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor
    LocalSigterm().setup(trainer, None, "fit")
    assert trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor is not original
    assert trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor() is None
    connector = trainer._signal_connector
    assert not connector.received_sigterm
    connector._sigterm_notifier_fn(signal.SIGTERM, None)
    assert connector.received_sigterm  # Lightning's loop checks this flag after the batch and stops


def test_an_upgrade_that_renames_the_members_fails_loudly():
    from parallelkit.callbacks.local_sigterm import check_lightning_members

    fake = types.SimpleNamespace(fit_loop=types.SimpleNamespace(epoch_loop=object()), _signal_connector=object())
    with pytest.raises(RuntimeError, match="_broadcast_sigterm_tensor, _sigterm_notifier_fn"):
        check_lightning_members(fake)
