"""parallelkit: distributed-training strategies and callbacks on Lightning's Trainer."""

from parallelkit.errors import ConfigError

__version__ = "0.1.0"
__all__ = ["ConfigError", "__version__"]
