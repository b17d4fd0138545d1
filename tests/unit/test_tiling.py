"""Large-image slicing: the tiles cover the image exactly once, each rank reads only its part, and tiled
prediction with a halo reassembles into exactly the whole-image prediction (seams without one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from parallelkit.data.raster import NpyRaster, RasterTilesDataModule, SyntheticRaster
from parallelkit.data.tiling import TileGrid, coverage, write_core
from parallelkit.errors import ConfigError
from parallelkit.models.segmenter import TileSegmenter


@pytest.mark.parametrize(
    "height,width,tile,halo,world",
    [(64, 64, 16, 0, 1), (70, 53, 16, 3, 3), (5, 300, 7, 2, 4), (1, 1, 4, 0, 1), (33, 31, 32, 5, 2), (8192, 8192, 1000, 16, 8)],
)
def test_tiles_cover_the_image_exactly_once(height, width, tile, halo, world):
    grid = TileGrid(height, width, tile, halo)
    counts = coverage(grid, world)
    assert counts.shape == (height, width)
    assert counts.min() == 1 and counts.max() == 1
    # every tile belongs to exactly one rank, and the ranks' shares differ by at most one tile
    shares = [grid.for_rank(r, world) for r in range(world)]
    assert sorted(t.index for share in shares for t in share) == list(range(len(grid)))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_negative_control_coverage_sees_a_gap_and_an_overlap(monkeypatch):
    grid = TileGrid(40, 40, 16, 2)
    # a broken assignment: every rank takes rank 0's tiles → those counted twice, the rest never
    monkeypatch.setattr(TileGrid, "for_rank", lambda self, rank, world: [self[i] for i in range(len(self) // 2)])
    counts = coverage(grid, 2)
    assert counts.max() == 2 and counts.min() == 0


def test_a_window_is_the_image_around_the_core_with_zeros_outside():
    raster = SyntheticRaster(37, 29, channels=3, seed=5)
    full = raster.read(0, 37, 0, 29)
    grid = TileGrid(37, 29, 10, 3)
    padded = F.pad(full, (3, 3 + 10, 3, 3 + 10))  # image placed at (halo, halo); room for short edge tiles
    for tile in grid:
        window = grid.read_window(raster, tile)
        assert window.shape == (3, 16, 16)
        torch.testing.assert_close(window, padded[:, tile.y0 : tile.y0 + 16, tile.x0 : tile.x0 + 16], rtol=0, atol=0)


def test_the_synthetic_raster_is_the_same_whichever_window_reads_it():
    raster = SyntheticRaster(4096, 4096, channels=3, seed=1)
    big = raster.read(1000, 1064, 2000, 2064)
    small = raster.read(1010, 1020, 2030, 2045)
    torch.testing.assert_close(small, big[:, 10:20, 30:45], rtol=0, atol=0)
    other_seed = SyntheticRaster(4096, 4096, channels=3, seed=2).read(1010, 1020, 2030, 2045)
    assert not torch.equal(small, other_seed)  # the seed matters (negative control)


def test_each_rank_reads_only_its_tiles_of_an_8192_raster():
    """Rank 5 of 64 reads its tiles' windows of an 8192 × 8192 raster — never the image."""
    raster = SyntheticRaster(8192, 8192, channels=3, seed=0)
    grid = TileGrid(8192, 8192, 512, 8)
    mine = grid.for_rank(5, 64)
    for tile in mine:
        grid.read_window(raster, tile)
    core = sum(t.pixels for t in mine)
    assert core == 8192 * 8192 // 64
    clipped = sum((min(t.y1 + 8, 8192) - max(t.y0 - 8, 0)) * (min(t.x1 + 8, 8192) - max(t.x0 - 8, 0)) for t in mine)
    assert raster.pixels_read == clipped  # the core plus its halo, nothing else
    assert raster.pixels_read <= core * (1 + 2 * 8 / 512) ** 2


def _tiled_prediction(model, raster, grid, world):
    out = np.full((1, grid.height, grid.width), np.nan, dtype=np.float32)
    with torch.no_grad():
        for rank in range(world):
            for tile in grid.for_rank(rank, world):
                write_core(out, grid, tile, model(grid.read_window(raster, tile)[None])[0])
    return out


def test_tiled_prediction_with_a_halo_equals_whole_image_prediction():
    torch.manual_seed(0)
    model = TileSegmenter(in_channels=3, width=8, layers=3).eval()
    r = model.receptive_radius
    raster = SyntheticRaster(70, 53, channels=3, seed=3)
    with torch.no_grad():
        whole = model(raster.read(0, 70, 0, 53)[None])[0].numpy()
    tiled = _tiled_prediction(model, raster, TileGrid(70, 53, 16, r), world=3)
    assert not np.isnan(tiled).any()  # every pixel written
    np.testing.assert_allclose(tiled, whole, rtol=0, atol=1e-5)

    # negative control: without a halo the tiles' borders see zeros instead of their neighbours — seams,
    # and only there (within the receptive radius of an inner tile border)
    seams = _tiled_prediction(model, raster, TileGrid(70, 53, 16, 0), world=3)
    wrong = np.abs(seams - whole)[0] > 1e-4
    assert wrong.any()
    ys, xs = np.nonzero(wrong)
    near_y = np.minimum(ys % 16, 15 - ys % 16) < r
    near_x = np.minimum(xs % 16, 15 - xs % 16) < r
    assert (near_y | near_x).all()


def test_an_npy_image_is_read_window_by_window(tmp_path):
    image = np.random.default_rng(0).standard_normal((45, 38, 2)).astype(np.float32)
    np.save(tmp_path / "img.npy", image)
    raster = NpyRaster(tmp_path / "img.npy")
    assert (raster.height, raster.width, raster.channels) == (45, 38, 2)
    window = raster.read(10, 20, 5, 9)
    np.testing.assert_array_equal(window.numpy(), image[10:20, 5:9].transpose(2, 0, 1))
    assert raster.pixels_read == 40


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"tile": 0}, "tile should be an int greater than 0"),
        ({"tile": 8, "halo": 8}, "halo=8 is not smaller than data.tile=8"),
        ({"halo": -1}, "halo should be an int"),
        ({"image": "/nonexistent/big.tif"}, "not an existing .npy file"),
        ({"height": 0}, "height should be an int greater than 0"),
    ],
)
def test_bad_tiling_input_is_a_clear_error(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        RasterTilesDataModule(**{"height": 64, "width": 64, "tile": 16, "halo": 2, **kwargs})


def test_training_on_an_image_file_without_labels_is_refused_before_launch(tmp_path):
    np.save(tmp_path / "img.npy", np.zeros((32, 32), dtype=np.float32))
    dm = RasterTilesDataModule(image=str(tmp_path / "img.npy"), tile=16, halo=2, global_batch_size=2)
    dm.check_mode("predict")  # predicting an unlabelled image is what it is for
    with pytest.raises(ConfigError, match="needs data.labels"):
        dm.check_mode("train")
    np.save(tmp_path / "labels.npy", np.ones((32, 32), dtype=np.float32))
    labelled = RasterTilesDataModule(image=str(tmp_path / "img.npy"), labels=str(tmp_path / "labels.npy"), tile=16, halo=2, global_batch_size=2, val_every=0)
    labelled.check_mode("train")
    labelled.configure(1, 1)
    window, target = labelled.train_set[3]
    assert window.shape == (1, 20, 20) and target[0].sum() == 16 * 16  # labels read from the file
