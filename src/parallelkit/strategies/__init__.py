"""Lightning strategies, one per file; each composes the techniques of ``parallelkit.distributed``."""

from parallelkit.strategies.ddp import DDPStrategy
from parallelkit.strategies.ps import ParameterServerStrategy
from parallelkit.strategies.single import SingleStrategy

__all__ = ["DDPStrategy", "ParameterServerStrategy", "SingleStrategy"]
