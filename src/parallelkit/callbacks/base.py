"""What ``parallelkit.run`` asks of a callback before any process starts.

A callback that needs something of the strategy (a DDP comm hook to replace, replicated parameters to
average, Lightning's own backward to wrap) says so in :meth:`ParallelKitCallback.check_strategy`, which
``parallelkit.run`` calls for every parallelkit callback with the strategy and its planned degrees, so that a
combination that cannot work costs one message and exit code 2 instead of an error on every rank. It asks
the strategy's capabilities (``strategy.supports(...)``), never its class. Lightning's own callbacks
(``LearningRateMonitor``, ...) need nothing of the strategy and are not asked.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback


class ParallelKitCallback(Callback):
    """A Lightning ``Callback`` that checks the strategy it will run with before any process starts.

    Example (the capabilities are in :mod:`parallelkit.capabilities`)::

        class NeedsDDP(ParallelKitCallback):
            @override
            def check_strategy(self, strategy, dims=None):
                require_capabilities(strategy, "callbacks=[needs_ddp]", {DDP_COMM_HOOK: "it installs a comm hook"})
    """

    def check_strategy(self, strategy: Any, dims: Any = None) -> None:
        """Raise :class:`~parallelkit.errors.ConfigError` if this callback cannot work with ``strategy``
        (with ``dims``, its planned degrees); also call it from ``setup`` for runs built without ``parallelkit.run``."""
