"""A user's own package: a model (model.py) and its parallel plans (parallelize.py), trained by parallelkit."""

from mynet.model import CharMLP

__all__ = ["CharMLP"]
