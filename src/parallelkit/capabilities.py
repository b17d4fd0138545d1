"""What a strategy offers, by name: the capabilities callbacks and ``parallelkit.run`` ask for.

A callback that needs something of the strategy asks ``strategy.supports(CAPABILITY)`` (through
:func:`require_capabilities`), never the strategy's class, so a new strategy that offers the capability works
with every callback unchanged. Each strategy lists what it offers in its ``capabilities`` attribute
(:class:`~parallelkit.strategies.base.ParallelKitStrategyMixin`).

This module imports neither ``parallelkit.strategies`` nor ``parallelkit.callbacks``: both sides of the
question import it, and a callback does not pull in every strategy (the parameter server's RPC included) to
name what it needs. The names stay importable from ``parallelkit.strategies.base``, where they were first.
"""

from __future__ import annotations

from typing import Any

from parallelkit.errors import ConfigError

#: gradients are averaged by a ``DistributedDataParallel`` module that accepts DDP comm hooks.
DDP_COMM_HOOK = "ddp_comm_hook"
#: every rank holds the full (unsharded, unsplit) parameters, so they can be averaged or compared directly.
REPLICATED_PARAMS = "replicated_params"
#: Lightning runs ``training_step`` and ``backward`` itself (a pipeline schedule does not).
LIGHTNING_BACKWARD = "lightning_backward"
#: the strategy runs forward under the precision plugin's context and backward on the loss its scaler scales, and
#: steps through the plugin (``callbacks=[amp]``): Lightning's own step does, and so does the pipeline's schedule.
MIXED_PRECISION = "mixed_precision"
#: the model's embedding tables are held and updated by server ranks, not by the module's optimizer.
SERVER_TABLES = "server_tables"
#: sparse gradients (``nn.Embedding(sparse=True)``) are averaged as they are (only the rows of the batch).
SPARSE_GRADIENTS = "sparse_gradients"


def require_capabilities(strategy: Any, who: str, needs: dict[str, str], instead: str = "strategy=ddp") -> None:
    """Raise :class:`ConfigError` if ``strategy`` lacks a capability in ``needs`` (capability → why ``who`` needs it).

    Decided by asking the strategy (``supports``), never by its class, so a new strategy that offers the
    capability works with the callback unchanged. A strategy without ``supports`` (not parallelkit's) offers none.
    """
    supports = getattr(strategy, "supports", None)
    name = getattr(strategy, "strategy_name", type(strategy).__name__)
    missing = {c: why for c, why in needs.items() if supports is None or not supports(c)}
    if missing:
        raise ConfigError(
            f"{who} does not work with strategy={name}: "
            + "; ".join(f"{why}, which strategy={name} does not offer ({c!r})" for c, why in missing.items())
            + f". Use {instead}, or drop the callback."
        )
