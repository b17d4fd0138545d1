"""The skeleton every callback that replaces DDP's gradient all-reduce with a comm hook shares.

``callbacks=[dgc]``, ``[grad_compression]``, ``[hierarchical_allreduce]`` and ``[local_sgd]`` each install one
DDP comm hook. DDP holds only one, so each must ask for the capability *and* reserve the hook before any
process starts (two such callbacks together cost one message and exit code 2, not a failure on every rank),
then register it in ``setup``, after the process group exists and before the strategy wraps the model.
:class:`CommHookCallback` does these steps once; a callback says only what differs: its :attr:`owner`, why it
needs what it needs (:attr:`needs`), extra checks of the planned degrees (:meth:`check_degrees`) and the hook
with its state (:meth:`build_hook`). A hook whose state differs between the replicas (residuals, error
feedback, replicas that train alone between averagings) also mixes in
:class:`~parallelkit.callbacks.replica_state.ReplicaState`, which checkpoints every rank's own state.
"""

from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
from typing_extensions import override

from parallelkit.callbacks.base import ParallelKitCallback
from parallelkit.capabilities import DDP_COMM_HOOK, require_capabilities

REPLACES_ALLREDUCE = "it replaces the gradient all-reduce with a DDP comm hook"


class CommHookCallback(ParallelKitCallback):
    """A callback that installs one DDP comm hook, counting the optimizer steps it saw.

    Subclasses set :attr:`owner` (how messages name the callback, and the key of the strategy's hook
    reservation), may widen :attr:`needs`, and implement :meth:`build_hook`. ``self.state`` is the hook's
    state once ``setup`` ran (``None`` before: summaries read it to tell whether the hook was ever installed).

    Example::

        class Plain(CommHookCallback):
            owner = "callbacks=[plain]"

            @override
            def build_hook(self, strategy):
                return allreduce_hook, strategy.data_parallel_group
    """

    owner: str = ""
    #: capability → why this callback needs it (the reason is part of the refusal message).
    needs: dict[str, str] = {DDP_COMM_HOOK: REPLACES_ALLREDUCE}

    def __init__(self) -> None:
        super().__init__()
        self.state: Any = None
        self._steps = 0  # optimizer steps seen (see _finished_step)
        self._seen_step = -1

    @override
    def check_strategy(self, strategy: Any, dims: Any = None) -> None:
        require_capabilities(strategy, self.owner, self.needs)
        if dims is not None:
            self.check_degrees(dims)
        strategy.reserve_comm_hook(self.owner)

    def check_degrees(self, dims: Any) -> None:
        """Raise :class:`~parallelkit.errors.ConfigError` if the planned degrees ``dims`` do not suit this callback."""

    def dims_at_setup(self, strategy: Any) -> Any:
        """The degrees ``setup`` re-checks (``None``: none); only a callback with :meth:`check_degrees` needs them,
        so the others never ask a strategy (that may lack them) for its ``parallel_dims``."""
        return None

    def build_hook(self, strategy: Any) -> tuple[Callable, Any]:
        """The comm hook and its state, for ``strategy`` (its process group exists; the model is not wrapped yet)."""
        raise NotImplementedError

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        # again here: a run built without parallelkit.run never called check_strategy
        self.check_strategy(strategy, self.dims_at_setup(strategy))
        hook, self.state = self.build_hook(strategy)
        strategy.use_comm_hook(hook, self.state, self.owner)

    def _finished_step(self, trainer: pl.Trainer) -> int | None:
        """The optimizer step that just finished, once per step; ``None`` between micro-batches of gradient
        accumulation (``on_train_batch_end`` runs per batch, the hook's traffic is per optimizer step)."""
        step = trainer.global_step - 1
        if step == self._seen_step or step < 0:
            return None
        self._seen_step = step
        self._steps += 1
        return step
