"""Who imports whom: the neutral modules (capabilities, the strategy protocol) and the callbacks import no
strategy, and the names that moved out of ``parallelkit.strategies`` are still importable from there."""

from __future__ import annotations

import subprocess
import sys

# A fresh interpreter: this test process has long imported every strategy.
_LOADED = """
import importlib, pkgutil, sys
import parallelkit.callbacks
for module in {modules!r}:
    importlib.import_module(module)
for info in pkgutil.iter_modules(parallelkit.callbacks.__path__):
    importlib.import_module("parallelkit.callbacks." + info.name)
print(" ".join(sorted(m for m in sys.modules if m.startswith(("parallelkit.strategies", "parallelkit.ps")))))
"""


def loaded_after_importing(modules: list[str]) -> list[str]:
    code = _LOADED.format(modules=modules)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return proc.stdout.split()


def test_callbacks_and_neutral_modules_import_no_strategy():
    assert loaded_after_importing(["parallelkit.capabilities", "parallelkit.strategy_protocol"]) == []
    # Negative control: the same check sees a strategy when one is imported.
    assert "parallelkit.strategies.base" in loaded_after_importing(["parallelkit.strategies.base"])


def test_moved_names_are_importable_from_their_old_modules():
    import parallelkit.capabilities as capabilities
    import parallelkit.strategy_protocol as strategy_protocol
    from parallelkit.strategies import base, protocol

    for name in ("DDP_COMM_HOOK", "REPLICATED_PARAMS", "LIGHTNING_BACKWARD", "SERVER_TABLES", "SPARSE_GRADIENTS",
                 "require_capabilities"):
        assert getattr(base, name) is getattr(capabilities, name)
    for name in ("StrategyProtocol", "ForeignStrategy", "as_protocol"):
        assert getattr(protocol, name) is getattr(strategy_protocol, name)
