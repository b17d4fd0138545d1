"""Seeded regression data: ``y = x @ W + noise``, for fast, exact tests of strategies."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset
from typing_extensions import override

from parallelkit.data.base import DataParallelDataModule
from parallelkit.errors import ConfigError


def make_regression(num_samples: int, in_features: int, out_features: int, noise: float, seed: int):
    """Deterministic inputs and targets from ``seed`` (same on every rank and every machine)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, in_features, generator=generator)
    weight = torch.randn(in_features, out_features, generator=generator) / in_features**0.5
    y = torch.tanh(x @ weight) + noise * torch.randn(num_samples, out_features, generator=generator)
    return x, y


class SyntheticDataModule(DataParallelDataModule):
    """Regression data with a fixed seed.

    Args:
        num_samples: training samples (validation gets a tenth as many, from the same distribution).
        in_features / out_features: sizes handed to the model.
        noise: standard deviation of the additive target noise.

    Example::

        dm = SyntheticDataModule(num_samples=512, in_features=16, out_features=4, global_batch_size=32)
    """

    def __init__(self, num_samples: int = 2048, in_features: int = 32, out_features: int = 8, noise: float = 0.01, **kwargs) -> None:
        super().__init__(**kwargs)
        for name, value in (("num_samples", num_samples), ("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"data.{name} should be an int greater than 0. Got {value!r}.")
        self.num_samples = num_samples
        self.in_features = in_features
        self.out_features = out_features
        self.noise = noise

    @override
    def build(self) -> None:
        x, y = make_regression(self.num_samples + self.num_samples // 10 + 1, self.in_features, self.out_features, self.noise, self.seed)
        n = self.num_samples
        self.train_set = TensorDataset(x[:n], y[:n])
        self.val_set = TensorDataset(x[n:], y[n:])

    @override
    def model_kwargs(self) -> dict:
        return {"in_features": self.in_features, "out_features": self.out_features}
