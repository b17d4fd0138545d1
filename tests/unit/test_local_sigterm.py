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


@pytest.fixture
def training_sigterm(monkeypatch):
    """A LocalSigterm set up on a real (idle) Trainer as in training, with os._exit recorded instead of run."""
    import lightning.pytorch as pl

    from parallelkit.callbacks import local_sigterm

    exits: list[int] = []
    monkeypatch.setattr(local_sigterm.os, "_exit", exits.append)
    sigint = signal.getsignal(signal.SIGINT)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    callback = local_sigterm.LocalSigterm(grace_s=60.0)
    callback.setup(trainer, None, "fit")
    callback.connect(object())  # what PeriodicCheckpoint.setup does: some callback will ask at its agreements
    callback.on_train_start(trainer, None)
    try:
        yield callback, trainer._signal_connector, exits
    finally:
        callback.on_train_end(trainer, None)
        signal.signal(signal.SIGINT, sigint)


def test_a_signal_in_training_waits_for_the_agreed_checkpoint(training_sigterm):
    callback, connector, exits = training_sigterm
    assert signal.getsignal(signal.SIGINT) == callback._on_signal  # Ctrl-C takes the same path
    connector._sigterm_notifier_fn(signal.SIGTERM, None)
    assert callback.requested_signal == signal.SIGTERM
    assert not connector.received_sigterm  # Lightning must not stop the loop before the checkpoint
    assert callback.agreement_signal() == signal.SIGTERM  # what this rank brings to the ranks' all-reduce
    callback.stopping()
    connector._sigterm_notifier_fn(signal.SIGINT, None)  # a signal during the checkpoint changes nothing
    assert not exits and not connector.received_sigterm


def test_no_step_boundary_within_the_grace_period_stops_without_a_checkpoint(training_sigterm, capsys):
    callback, connector, exits = training_sigterm
    connector._sigterm_notifier_fn(signal.SIGTERM, None)
    timer = callback._timer
    timer.cancel()
    timer.function(*timer.args)  # what the grace timer does when it runs out: no agreement came in time
    assert exits == [143]
    assert "stops on SIGTERM without a checkpoint (no step boundary within 60 s)" in capsys.readouterr().err


def test_a_second_signal_stops_at_once(training_sigterm, capsys):
    callback, connector, exits = training_sigterm
    connector._sigterm_notifier_fn(signal.SIGINT, None)
    connector._sigterm_notifier_fn(signal.SIGINT, None)
    assert exits == [130]
    assert "(a second signal)" in capsys.readouterr().err


def test_without_a_checkpoint_callback_a_signal_stops_after_the_batch(training_sigterm):
    callback, connector, exits = training_sigterm
    callback._agreed_by = None  # nobody will agree on a checkpoint: waiting would only delay the stop
    connector._sigterm_notifier_fn(signal.SIGTERM, None)
    assert connector.received_sigterm and not exits and callback._timer is None
