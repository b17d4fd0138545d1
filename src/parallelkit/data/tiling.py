"""Cut an image too large for one device into tiles, give each rank its own, and put predictions back.

The geometry is kept apart from any pixels, so a plan for an 8192 × 8192 raster costs nothing:

- the *cores* tile the image exactly once (the last row and column of tiles are shorter when the tile does
  not divide the image);
- each tile is read with a *halo* of ``halo`` pixels around its core, so a convolutional model sees the
  neighbours of the core's border pixels; parts of the window outside the image are zeros — what a network
  that zero-pads the whole image would see there;
- every window has the same shape ``(tile + 2·halo)²`` (short edge tiles are zero-padded), so tiles batch;
- predictions are cropped back to their core and written into the full-size output; nothing else is.

With a halo at least the receptive radius of a network that pads its input once and then uses unpadded
convolutions, tiled prediction equals whole-image prediction (``tests/unit/test_tiling.py`` checks both
that and the seams that appear without a halo).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol

import numpy as np
import torch

from parallelkit.errors import ConfigError


@dataclass(frozen=True)
class Tile:
    """One tile: its core ``[y0, y1) × [x0, x1)`` in image coordinates and its place in the grid."""

    index: int
    y0: int
    y1: int
    x0: int
    x1: int

    @property
    def pixels(self) -> int:
        return (self.y1 - self.y0) * (self.x1 - self.x0)


class Raster(Protocol):
    """A random-access image source: ``read`` returns ``[C, y1-y0, x1-x0]`` float32 for an in-image window."""

    height: int
    width: int
    channels: int

    def read(self, y0: int, y1: int, x0: int, x1: int) -> torch.Tensor: ...


@dataclass(frozen=True)
class TileGrid:
    """Square tiles of ``tile`` pixels over a ``height × width`` image, read with ``halo`` pixels around each."""

    height: int
    width: int
    tile: int
    halo: int = 0

    def __post_init__(self) -> None:
        for name in ("height", "width", "tile"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"The tile grid's {name} should be an int greater than 0. Got {value!r}.")
        if not isinstance(self.halo, int) or self.halo < 0:
            raise ConfigError(f"data.halo should be an int ≥ 0 (pixels read around each tile). Got {self.halo!r}.")
        if self.halo >= self.tile:
            raise ConfigError(
                f"data.halo={self.halo} is not smaller than data.tile={self.tile}: each tile would read more "
                "halo than core. Use a larger tile or a smaller halo."
            )

    @property
    def rows(self) -> int:
        return -(-self.height // self.tile)

    @property
    def cols(self) -> int:
        return -(-self.width // self.tile)

    def __len__(self) -> int:
        return self.rows * self.cols

    @property
    def window(self) -> int:
        """Side of every window handed to the model: the tile plus its halo on both sides."""
        return self.tile + 2 * self.halo

    def __getitem__(self, index: int) -> Tile:
        if not 0 <= index < len(self):
            raise IndexError(f"tile {index} of a {self.rows}×{self.cols} grid")
        row, col = divmod(index, self.cols)
        y0, x0 = row * self.tile, col * self.tile
        return Tile(index, y0, min(y0 + self.tile, self.height), x0, min(x0 + self.tile, self.width))

    def __iter__(self) -> Iterator[Tile]:
        return (self[i] for i in range(len(self)))

    def for_rank(self, rank: int, world_size: int) -> list[Tile]:
        """This rank's tiles: contiguous runs of the row-major order, sizes differing by at most one."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a world of {world_size}")
        per, extra = divmod(len(self), world_size)
        start = rank * per + min(rank, extra)
        return [self[i] for i in range(start, start + per + (rank < extra))]

    # ------------------------------------------------------------------ pixels
    def read_window(self, raster: Raster, tile: Tile) -> torch.Tensor:
        """``[C, window, window]``: the core and its halo, zeros where the window leaves the image."""
        out = torch.zeros(raster.channels, self.window, self.window)
        wy0, wx0 = tile.y0 - self.halo, tile.x0 - self.halo  # the window's corner in image coordinates
        ry0, ry1 = max(wy0, 0), min(tile.y1 + self.halo, self.height)
        rx0, rx1 = max(wx0, 0), min(tile.x1 + self.halo, self.width)
        out[:, ry0 - wy0 : ry1 - wy0, rx0 - wx0 : rx1 - wx0] = raster.read(ry0, ry1, rx0, rx1)
        return out

    def core_of(self, window_output: torch.Tensor, tile: Tile) -> torch.Tensor:
        """Crop a model output over a window (``[..., window, window]``) to the tile's core pixels."""
        size = window_output.shape[-1]
        if window_output.shape[-2] != size or size != self.window:
            raise ValueError(f"a window output should be {self.window}×{self.window}, got {tuple(window_output.shape[-2:])}")
        h = self.halo
        return window_output[..., h : h + tile.y1 - tile.y0, h : h + tile.x1 - tile.x0]

    def valid_mask(self, tile: Tile) -> torch.Tensor:
        """``[tile, tile]`` booleans: which pixels of the padded core lie inside the image."""
        mask = torch.zeros(self.tile, self.tile, dtype=torch.bool)
        mask[: tile.y1 - tile.y0, : tile.x1 - tile.x0] = True
        return mask


def write_core(out: np.ndarray, grid: TileGrid, tile: Tile, window_output: torch.Tensor) -> None:
    """Write a tile's prediction (``[C, window, window]``) into its core of ``out`` (``[C, H, W]``, e.g. a memmap)."""
    out[:, tile.y0 : tile.y1, tile.x0 : tile.x1] = grid.core_of(window_output, tile).detach().float().numpy()


def coverage(grid: TileGrid, world_size: int) -> np.ndarray:
    """How many times each pixel is the core of some rank's tile (a correct plan: all ones)."""
    counts = np.zeros((grid.height, grid.width), dtype=np.uint8)
    for rank in range(world_size):
        for tile in grid.for_rank(rank, world_size):
            counts[tile.y0 : tile.y1, tile.x0 : tile.x1] += 1
    return counts
