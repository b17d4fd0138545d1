"""Start-up without the cyclic garbage collector.

Importing torch, Lightning and their dependencies creates a few hundred thousand container objects, and
CPython's collector runs a full pass over all of them again and again while they are being created: about
0.5 s of a rank's ~2.7 s of imports on a 2-core machine, for little garbage. So the entry points
(``train.py``, an early-started local rank) pause the collector first thing, and :func:`resume` turns it
back on once the run is built, just before the ranks start work. It also freezes what exists by then
(``gc.freeze``): the modules, the model and the trainer live for the whole run, and later collections no
longer walk them (measured: 0.6 M objects per rank). The price: the cyclic garbage of the start-up itself
(about 13-26 thousand objects, a few MB: Hydra's composition, caught import errors) is frozen with them
instead of freed; a full collection to free it first would cost the 0.3 s this saves.
"""

from __future__ import annotations

import gc

_paused = False


def pause() -> None:
    """Turn the collector off until :func:`resume` (reference counting still frees almost everything)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def resume() -> None:
    """Turn the collector back on if :func:`pause` turned it off; idempotent."""
    global _paused
    if _paused:
        _paused = False
        gc.freeze()
        gc.enable()
