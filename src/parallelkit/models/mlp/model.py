"""A multi-layer perceptron for regression: the smallest model every strategy is tested on."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallelkit.errors import ConfigError


class MLP(nn.Module):
    """``in_features → hidden → … → out_features`` with GELU between layers and a mean-squared-error loss.

    Args:
        in_features / out_features: taken from the data module.
        hidden: widths of the hidden layers.

    Example::

        model = MLP(in_features=32, out_features=8, hidden=[64, 64])
        loss = model.loss(model(x), y)
    """

    def __init__(self, in_features: int = 32, out_features: int = 8, hidden: list[int] | tuple[int, ...] = (64, 64)) -> None:
        super().__init__()
        widths = [in_features, *hidden, out_features]
        if any(not isinstance(w, int) or w < 1 for w in widths):
            raise ConfigError(f"model.hidden and the data's feature sizes must be positive ints. Got {widths}.")
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x

    @staticmethod
    def loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(prediction, target)
