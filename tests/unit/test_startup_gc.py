"""parallelkit.launch.startup_gc: the collector is off between pause() and resume(), then on and frozen; a collector
the user turned off stays off."""

from __future__ import annotations

import gc

import pytest

from parallelkit.launch import startup_gc


@pytest.fixture(autouse=True)
def _restore_collector():
    was_on = gc.isenabled()
    yield
    startup_gc._paused = False
    gc.unfreeze()
    gc.enable() if was_on else gc.disable()


def test_pause_then_resume_turns_the_collector_off_then_on_and_freezes_the_start_up():
    gc.enable()
    gc.unfreeze()
    startup_gc.pause()
    assert not gc.isenabled()
    survivors = [[i] for i in range(1000)]  # start-up objects that live on
    startup_gc.resume()
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(survivors)  # later collections skip them
    startup_gc.resume()  # idempotent
    assert gc.isenabled()


def test_a_collector_that_was_already_off_stays_off():
    gc.disable()
    gc.unfreeze()
    startup_gc.pause()
    startup_gc.resume()
    assert not gc.isenabled()
    assert gc.get_freeze_count() == 0  # nothing was paused, so nothing is frozen either
