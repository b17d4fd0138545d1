"""``data=raster``: train and predict on an image too large for one device, one tile at a time.

The image is either a seeded synthetic raster, computed on demand from pixel coordinates (an 8192 × 8192
raster is never held in memory), or a ``.npy`` file a user points at, opened as a memory map so a rank reads
only the windows of its tiles from disk. The tile geometry is :class:`~parallelkit.data.tiling.TileGrid`.

- Training: the tiles are the samples. The data-parallel sampler hands each rank its share of every global
  batch, and a tile's pixels are read only when that rank loads it.
- ``mode=predict``: each rank predicts the tiles of its contiguous share and writes their cores into one
  shared ``predictions.npy`` (a memory map created by rank 0), which appears under its name only once every
  rank has written and the written pixels add up to the image — reassembly without gathering the image.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Subset
from typing_extensions import override

from parallelkit.data.base import DataParallelDataModule
from parallelkit.data.tiling import Tile, TileGrid, write_core
from parallelkit.errors import ConfigError


def _hash_uniform(y: torch.Tensor, x: torch.Tensor, salt: int) -> torch.Tensor:
    """A uniform [0, 1) value per (y, x, salt), the same whichever window asks (int64 arithmetic wraps)."""
    h = y * 0x9E3779B1 + x * 0x85EBCA77 + salt * 0xC2B2AE3D
    h = (h ^ (h >> 15)) * 0x27D4EB2F
    h = h ^ (h >> 13)
    return (h & 0xFFFFFF).to(torch.float32) / float(1 << 24)


class SyntheticRaster:
    """A seeded multi-channel raster and its per-pixel labels, computed from the coordinates alone.

    Two smooth fields ``a`` and ``b`` (sums of seeded plane waves) appear in channels 0 and 1 under
    noise; channel 2 is noise only. The label is ``a·b > 0``: it needs both channels and some spatial
    averaging against the noise, so a convolutional model has something to learn.
    """

    def __init__(self, height: int, width: int, channels: int = 3, seed: int = 0, noise: float = 0.5) -> None:
        if channels < 2:
            raise ConfigError(f"data.channels should be at least 2 for the synthetic raster. Got {channels}.")
        self.height, self.width, self.channels, self.seed, self.noise = height, width, channels, seed, noise
        g = torch.Generator().manual_seed(seed)
        # wave vectors with periods of 24–96 pixels, and phases
        self._waves = [(2 * math.pi / (24 + 72 * torch.rand(2, generator=g)), 2 * math.pi * torch.rand(2, generator=g)) for _ in range(4)]
        self.pixels_read = 0

    def _fields(self, y: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        yf, xf = y.to(torch.float64), x.to(torch.float64)
        (k0, p0), (k1, p1), (k2, p2), (k3, p3) = self._waves
        a = torch.sin(k0[0] * yf + k0[1] * xf + p0[0]) + torch.sin(k1[0] * yf - k1[1] * xf + p1[0])
        b = torch.sin(k2[0] * yf + k2[1] * xf + p2[0]) + torch.sin(k3[0] * yf - k3[1] * xf + p3[0])
        return a.float(), b.float()

    def _grid(self, y0: int, y1: int, x0: int, x1: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.meshgrid(torch.arange(y0, y1, dtype=torch.int64), torch.arange(x0, x1, dtype=torch.int64), indexing="ij")

    def read(self, y0: int, y1: int, x0: int, x1: int) -> torch.Tensor:
        self.pixels_read += (y1 - y0) * (x1 - x0)
        y, x = self._grid(y0, y1, x0, x1)
        a, b = self._fields(y, x)
        noise = [self.noise * 4 * (_hash_uniform(y, x, self.seed * 131 + c) - 0.5) for c in range(self.channels)]
        channels = [a + noise[0], b + noise[1], *noise[2:]]
        return torch.stack(channels)

    def labels(self, y0: int, y1: int, x0: int, x1: int) -> torch.Tensor:
        a, b = self._fields(*self._grid(y0, y1, x0, x1))
        return (a * b > 0).float()


class NpyRaster:
    """An image stored as ``.npy`` (``H×W`` or ``H×W×C``), memory-mapped: a read touches only its window."""

    def __init__(self, path: str | os.PathLike, labels: str | os.PathLike | None = None) -> None:
        self.path = Path(path)
        if self.path.suffix != ".npy" or not self.path.is_file():
            raise ConfigError(
                f"data.image={str(path)!r} is not an existing .npy file. Give a .npy array of shape H×W or H×W×C "
                "(convert another format once with numpy.save), or data.image=synthetic."
            )
        self.array = np.load(self.path, mmap_mode="r")
        if self.array.ndim not in (2, 3):
            raise ConfigError(f"data.image={str(path)!r} has shape {self.array.shape}; expected H×W or H×W×C.")
        self.height, self.width = self.array.shape[:2]
        self.channels = 1 if self.array.ndim == 2 else self.array.shape[2]
        self.label_array = None
        if labels is not None:
            self.label_array = np.load(labels, mmap_mode="r")
            if self.label_array.shape != (self.height, self.width):
                raise ConfigError(f"data.labels has shape {self.label_array.shape}, but the image is {self.height}×{self.width}.")
        self.pixels_read = 0

    def read(self, y0: int, y1: int, x0: int, x1: int) -> torch.Tensor:
        self.pixels_read += (y1 - y0) * (x1 - x0)
        window = torch.from_numpy(np.array(self.array[y0:y1, x0:x1], dtype=np.float32))
        return window[None] if window.ndim == 2 else window.permute(2, 0, 1).contiguous()

    def labels(self, y0: int, y1: int, x0: int, x1: int) -> torch.Tensor:
        if self.label_array is None:
            raise ConfigError("Training on an image file needs data.labels=PATH.npy (H×W, 0/1 per pixel); mode=predict does not.")
        return torch.from_numpy(np.array(self.label_array[y0:y1, x0:x1], dtype=np.float32))


class TileDataset(Dataset):
    """Tile ``i`` → (window ``[C, w, w]``, target ``[2, tile, tile]`` = label and in-image mask), read lazily."""

    def __init__(self, grid: TileGrid, raster: Any, with_labels: bool = True) -> None:
        self.grid, self.raster, self.with_labels = grid, raster, with_labels

    def __len__(self) -> int:
        return len(self.grid)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tile = self.grid[index]
        window = self.grid.read_window(self.raster, tile)
        target = torch.zeros(2, self.grid.tile, self.grid.tile)
        if self.with_labels:
            target[0, : tile.y1 - tile.y0, : tile.x1 - tile.x0] = self.raster.labels(tile.y0, tile.y1, tile.x0, tile.x1)
        target[1] = self.grid.valid_mask(tile).float()
        return window, target


class RasterTilesDataModule(DataParallelDataModule):
    """Tiles of one large image as training samples; tiled prediction reassembled into ``predictions.npy``.

    Args:
        image: ``synthetic`` or a path to an ``.npy`` image (``H×W`` or ``H×W×C``), memory-mapped.
        labels: for an image file, a ``.npy`` of 0/1 labels (``H×W``) to train on.
        height / width / channels: the synthetic raster's size.
        tile: side of each tile's core; halo: pixels read around it (≥ the model's receptive radius for
            prediction equal to whole-image prediction).
        val_every: every ``val_every``-th tile is held out for validation (0: validate on all tiles).

    Example::

        python train.py +experiment=tiles data.height=8192 data.width=8192 data.tile=512 data.halo=8
    """

    def __init__(
        self,
        image: str = "synthetic",
        labels: str | None = None,
        height: int = 1024,
        width: int = 1024,
        channels: int = 3,
        tile: int = 64,
        halo: int = 4,
        val_every: int = 8,
        noise: float = 0.5,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.image, self.label_path = image, labels
        self.height, self.width, self.channels, self.noise = height, width, channels, noise
        self.tile, self.halo = tile, halo
        if not isinstance(val_every, int) or val_every < 0:
            raise ConfigError(f"data.val_every should be an int ≥ 0 (hold out every n-th tile; 0 = none). Got {val_every!r}.")
        self.val_every = val_every
        self.raster = self._open()
        self.grid = TileGrid(self.raster.height, self.raster.width, tile, halo)

    def _open(self) -> Any:
        if self.image == "synthetic":
            for name in ("height", "width"):
                if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                    raise ConfigError(f"data.{name} should be an int greater than 0. Got {getattr(self, name)!r}.")
            return SyntheticRaster(self.height, self.width, self.channels, self.seed, self.noise)
        return NpyRaster(self.image, self.label_path)

    @property
    def labelled(self) -> bool:
        return getattr(self.raster, "label_array", True) is not None

    def check_mode(self, mode: str) -> None:
        """Called by ``parallelkit.run`` before launch: an image without labels can be predicted, not trained on."""
        if mode == "train" and not self.labelled:
            raise ConfigError(
                f"Training on data.image={self.image!r} needs data.labels=PATH.npy (H×W, 0/1 per pixel). "
                "Without labels use mode=predict ckpt_path=CHECKPOINT to predict the image tile by tile."
            )

    @override
    def build(self) -> None:
        tiles = TileDataset(self.grid, self.raster, with_labels=self.labelled)
        if not self.labelled:  # prediction only: nothing to score against
            self.train_set, self.val_set = tiles, Subset(tiles, [])
        elif self.val_every and len(self.grid) > 1:
            held_out = set(range(0, len(self.grid), self.val_every))
            self.train_set = Subset(tiles, [i for i in range(len(self.grid)) if i not in held_out])
            self.val_set = Subset(tiles, sorted(held_out))
        else:
            self.train_set = self.val_set = tiles

    @override
    def model_kwargs(self) -> dict[str, Any]:
        return {"in_channels": self.raster.channels}

    # ------------------------------------------------------------------ tiled prediction
    def write_predictions(self, model: torch.nn.Module, strategy: Any, out: Path, batch: int = 4) -> dict[str, Any]:
        """Predict this rank's tiles with ``model`` and write their cores into ``out/predictions.npy``.

        Every rank calls this. The output is a ``[1, H, W]`` float32 memory map of probabilities.
        """
        rank = strategy.global_rank
        world = strategy.world_size
        final, tmp = out / "predictions.npy", out / "predictions.npy.tmp"
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(1, self.grid.height, self.grid.width)).flush()
        strategy.barrier("predictions-created")
        target = np.lib.format.open_memmap(tmp, mode="r+")
        mine: list[Tile] = self.grid.for_rank(rank, world)
        read_before = self.raster.pixels_read
        model.eval()
        with torch.no_grad():
            for start in range(0, len(mine), batch):
                tiles = mine[start : start + batch]
                windows = torch.stack([self.grid.read_window(self.raster, t) for t in tiles])
                probabilities = torch.sigmoid(model(windows).float())
                for tile, prediction in zip(tiles, probabilities):
                    write_core(target, self.grid, tile, prediction)
        target.flush()
        del target
        written = torch.tensor([sum(t.pixels for t in mine)], dtype=torch.float64, device=strategy.root_device)
        written = int(strategy.reduce(written, reduce_op="sum").item()) if world > 1 else int(written.item())
        strategy.barrier("predictions-written")
        expected = self.grid.height * self.grid.width
        if written != expected:  # cannot happen with a correct grid; never publish a half-written image
            raise RuntimeError(f"the ranks wrote {written} pixels of a {self.grid.height}×{self.grid.width} image")
        if rank == 0:
            os.replace(tmp, final)
        return {
            "predictions": str(final),
            "tiles": len(self.grid),
            "tile": self.tile,
            "halo": self.halo,
            "pixels_written": written,
            "pixels_read_rank0": self.raster.pixels_read - read_before,
        }
