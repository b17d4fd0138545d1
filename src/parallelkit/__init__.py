"""parallelkit: distributed-training strategies and callbacks on Lightning's Trainer."""

from parallelkit import deferred_imports
from parallelkit.console import silence_library_warnings
from parallelkit.errors import ConfigError

deferred_imports.install()  # before Lightning is imported: torchmetrics' BERTScore imports transformers on first use
silence_library_warnings()  # Lightning's and torch's own deprecations, which no user setting can address

__version__ = "0.1.0"
__all__ = ["ConfigError", "__version__"]
