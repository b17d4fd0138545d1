"""The steps ``parallelkit.run`` takes with a strategy, declared once with their no-op defaults.

A run is validated before any process starts, so bad input costs one message and nothing half-written. The
strategy takes part through the methods of :class:`StrategyProtocol`, called by ``parallelkit.run`` in this
order, every one of them on every strategy (a strategy overrides what concerns it):

1. :meth:`~StrategyProtocol.bind_accelerator`, :meth:`~StrategyProtocol.bind_trainer_config`: learn the
   device type and check the Trainer settings the strategy applies itself (clipping, precision);
2. :meth:`~StrategyProtocol.default_devices`: processes per node when ``trainer.devices`` is unset;
3. :meth:`~StrategyProtocol.resolve`: the strategy that really trains (``strategy=auto`` returns the
   hybrid4d layout it chose; every other strategy itself);
4. :meth:`~StrategyProtocol.plan`: the validated degrees for the world size;
5. :meth:`~StrategyProtocol.check_model`, :meth:`~StrategyProtocol.check_lightning_module`,
   :meth:`~StrategyProtocol.check_workload`, :meth:`~StrategyProtocol.check_checkpoint`: can this model,
   this LightningModule, these batches, this checkpoint be trained as planned;
6. after training, on every rank: :meth:`~StrategyProtocol.summary_metrics` (extra ``summary.json``
   entries).

A Lightning ``Strategy`` that is not parallelkit's still trains (``strategy._target_=...``): it is wrapped
in :class:`ForeignStrategy`, whose steps do nothing, and parallelkit's extras (degrees checked before launch,
counted traffic, its model-state accounting) are off — one line says so.

This module imports no strategy: ``parallelkit.run`` and the planner ask these steps of any strategy without
depending on the ``parallelkit.strategies`` package (``parallelkit.strategies.protocol`` re-exports it).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from parallelkit.distributed.parallel_dims import ParallelDims


class StrategyProtocol:
    """What ``parallelkit.run`` asks of a strategy, with defaults that do nothing (see the module docstring)."""

    #: the name used by ``strategy=NAME`` and written to ``summary.json``.
    strategy_name: str = "?"

    @property
    def lightning_strategy(self) -> Any:
        """The object handed to ``lightning.pytorch.Trainer(strategy=...)``."""
        return self

    def bind_accelerator(self, accelerator: str) -> None:
        """The device type of the run (``cpu`` or ``gpu``), before anything is built."""

    def bind_trainer_config(self, trainer_cfg: dict[str, Any]) -> None:
        """Check the Trainer settings this strategy applies itself; raise :class:`~parallelkit.errors.ConfigError`."""

    def default_devices(self, accelerator: str) -> int:
        """Processes per node when ``trainer.devices`` is not set."""
        return 1

    def resolve(self, cfg: Any, devices: int, num_nodes: int) -> StrategyProtocol:
        """The strategy that trains ``cfg`` on ``devices × num_nodes`` processes (default: this one)."""
        return self

    def plan(self, world_size: int) -> ParallelDims:
        """The validated degrees for ``world_size`` processes (default: all of them data-parallel)."""
        return ParallelDims.from_degrees(world_size, dp=-1)

    def check_model(self, model: torch.nn.Module, world_size: int) -> None:
        """Can ``model`` (the built ``model=``) be split as planned (heads % tp, a plan exists, ...)?"""

    def check_lightning_module(self, module: Any) -> None:
        """Can this strategy train ``module`` (manual optimization, several optimizers, ...)? Also called in
        ``setup`` so that a LightningModule handed to a Trainer directly is refused with the same message."""

    def check_workload(self, model: torch.nn.Module, datamodule: Any) -> None:
        """Do the model and the batch plan fit together (pipeline split points, micro-batches, ...)?"""

    def check_checkpoint(self, path: Any, shapes: dict[str, Any]) -> None:
        """Can ``path`` be resumed (complete, of this strategy's format, with these parameter shapes)?"""
        from parallelkit.distributed.checkpoint_io import check_compatible

        check_compatible(path, shapes)

    def summary_metrics(self, trainer: Any) -> dict[str, Any]:
        """Extra top-level entries for ``summary.json``; called on every rank at the end of training."""
        return {}


class ForeignStrategy(StrategyProtocol):
    """A Lightning strategy that is not parallelkit's, taking part in ``parallelkit.run`` with no-op steps.

    Args:
        strategy: any ``lightning.pytorch.strategies.Strategy``.
    """

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy
        self.strategy_name = f"{type(strategy).__module__}.{type(strategy).__qualname__}"

    @property
    @override
    def lightning_strategy(self) -> Any:
        return self._strategy

    @override
    def plan(self, world_size: int) -> ParallelDims:
        rank_zero_info(
            f"strategy={self.strategy_name} is not a parallelkit strategy: it trains as Lightning runs it, and "
            "parallelkit's extras are off (degrees checked before launch, counted traffic and model-state bytes in "
            "summary.json, the callbacks' strategy checks)."
        )
        return super().plan(world_size)


def as_protocol(strategy: Any) -> StrategyProtocol:
    """``strategy`` itself if it follows :class:`StrategyProtocol`, else :class:`ForeignStrategy` around it."""
    from lightning.pytorch.strategies import Strategy

    from parallelkit.errors import ConfigError

    if isinstance(strategy, StrategyProtocol):
        return strategy
    if isinstance(strategy, Strategy):
        return ForeignStrategy(strategy)
    raise ConfigError(
        f"strategy=... built a {type(strategy).__name__}, which is not a Lightning strategy. Its _target_ must build a "
        "lightning.pytorch.strategies.Strategy (parallelkit's strategies are: conf/strategy/*.yaml)."
    )
