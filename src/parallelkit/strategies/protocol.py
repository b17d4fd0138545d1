"""Moved to :mod:`parallelkit.strategy_protocol`, which imports no strategy; kept so that existing imports work."""

from parallelkit.strategy_protocol import ForeignStrategy, StrategyProtocol, as_protocol

__all__ = ["ForeignStrategy", "StrategyProtocol", "as_protocol"]
