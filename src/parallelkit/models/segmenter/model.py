"""A small fully convolutional per-pixel classifier for tiles of a large image.

The input is zero-padded once by the receptive radius and the convolutions themselves do not pad, so the
output at a pixel depends only on the input within ``receptive_radius`` of it (zeros outside the image).
That is what makes tiled prediction with ``data.halo ≥ receptive_radius`` equal to whole-image prediction:
padding every layer (``padding="same"``) would instead make each tile's border act like an image border.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallelkit.errors import ConfigError


class TileSegmenter(nn.Module):
    """``in_channels → width → … → 1`` logit per pixel; the output has the input's height and width.

    Args:
        in_channels: taken from the data module.
        width: channels of the hidden layers.
        layers: unpadded ``kernel × kernel`` convolutions (receptive radius ``layers · (kernel // 2)``).

    Example::

        model = TileSegmenter(in_channels=3, width=16, layers=3)
        logits = model(torch.randn(4, 3, 72, 72))     # [4, 1, 72, 72]
    """

    def __init__(self, in_channels: int = 3, width: int = 16, layers: int = 3, kernel: int = 3) -> None:
        super().__init__()
        if kernel < 1 or kernel % 2 == 0:
            raise ConfigError(f"model.kernel should be an odd int (centred convolutions). Got {kernel!r}.")
        if layers < 1 or width < 1:
            raise ConfigError(f"model.layers and model.width should be ints greater than 0. Got {layers!r}, {width!r}.")
        self.receptive_radius = layers * (kernel // 2)
        widths = [in_channels] + [width] * layers
        self.convs = nn.ModuleList(nn.Conv2d(a, b, kernel) for a, b in zip(widths[:-1], widths[1:]))
        self.head = nn.Conv2d(width, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.receptive_radius
        x = F.pad(x, (r, r, r, r))
        for conv in self.convs:
            x = F.gelu(conv(x))
        return self.head(x)

    @staticmethod
    def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Binary cross-entropy over the tile's core pixels that lie inside the image.

        ``target`` is ``[B, 2, tile, tile]`` (label, in-image mask); ``logits`` cover the whole window
        (core plus halo on each side), so the core is cropped from their centre.
        """
        tile = target.shape[-1]
        halo = (logits.shape[-1] - tile) // 2
        core = logits[:, 0, halo : halo + tile, halo : halo + tile]
        label, mask = target[:, 0], target[:, 1]
        per_pixel = F.binary_cross_entropy_with_logits(core, label, reduction="none")
        return (per_pixel * mask).sum() / mask.sum().clamp_min(1)
