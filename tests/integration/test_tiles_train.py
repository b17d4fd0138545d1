"""End-to-end large-image slicing: train on tiles of a raster on 2 ranks, then predict it tile by tile on 2
ranks and on 1; the reassembled ``predictions.npy`` equals the whole-image prediction of the same weights,
computed here in one piece."""

from __future__ import annotations

import json

import numpy as np
import torch

from parallelkit.data.raster import SyntheticRaster
from parallelkit.data.tiling import TileGrid
from parallelkit.distributed.checkpoint_io import load_unsharded
from parallelkit.models.segmenter import TileSegmenter
from tests.integration.test_train import run_ok, train

H, W, SEED = 150, 131, 1234
TILES = [
    "+experiment=tiles",
    f"data.height={H}",
    f"data.width={W}",
    "data.tile=32",
    "data.halo=3",  # = the receptive radius of 3 unpadded 3×3 convolutions
    "data.val_every=3",
    "data.global_batch_size=4",
    "model.width=8",
    f"seed={SEED}",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]


def _whole_image_prediction(ckpt) -> np.ndarray:
    model = TileSegmenter(in_channels=3, width=8, layers=3)
    state = load_unsharded(ckpt)["state_dict"]
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    with torch.no_grad():
        return torch.sigmoid(model(SyntheticRaster(H, W, channels=3, seed=SEED).read(0, H, 0, W)[None]))[0].numpy()


def test_train_on_tiles_then_predict_reassembles_the_whole_image(tmp_path):
    summary = run_ok([*TILES, "trainer.max_steps=24", "trainer.val_check_interval=24", "trainer.devices=2"], tmp_path / "train")
    losses = summary["train_loss"]
    assert len(losses) == 24 and summary["world_size"] == 2
    assert summary["comm"]["by_kind"]["grad_allreduce"]["bytes_per_step"] > 0  # the ranks really averaged
    ckpt = tmp_path / "train" / "checkpoints" / "last.ckpt"
    whole = _whole_image_prediction(ckpt)

    for devices in (2, 1):
        run_dir = tmp_path / f"predict{devices}"
        strategy = "ddp" if devices > 1 else "single"
        proc = train(
            [*TILES, "mode=predict", f"ckpt_path={ckpt}", f"strategy={strategy}", f"trainer.devices={devices}", f"hydra.run.dir={run_dir}"], cwd=tmp_path
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = json.loads((run_dir / "predict.json").read_text())
        assert report["world_size"] == devices and report["val_loss"] is not None
        tiles = report["tiles"]
        assert tiles["pixels_written"] == H * W and tiles["tiles"] == 5 * 5
        # rank 0 read exactly its tiles' windows (cores + halos, clipped to the image) to predict them
        grid = TileGrid(H, W, 32, 3)
        windows = sum((min(t.y1 + 3, H) - max(t.y0 - 3, 0)) * (min(t.x1 + 3, W) - max(t.x0 - 3, 0)) for t in grid.for_rank(0, devices))
        assert tiles["pixels_read_rank0"] == windows
        assert devices == 1 or windows < H * W
        predicted = np.load(run_dir / "predictions.npy")
        assert not (run_dir / "predictions.npy.tmp").exists()
        np.testing.assert_allclose(predicted, whole, rtol=0, atol=1e-5)

    # negative control: the same checkpoint predicted without a halo shows seams at the tile borders
    run_dir = tmp_path / "nohalo"
    proc = train([*TILES, "data.halo=0", "mode=predict", f"ckpt_path={ckpt}", "trainer.devices=2", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert np.abs(np.load(run_dir / "predictions.npy") - whole).max() > 1e-3


def test_a_trained_segmenter_beats_chance_on_held_out_tiles(tmp_path):
    summary = run_ok([*TILES, "trainer.max_steps=60", "trainer.val_check_interval=60", "trainer.devices=1", "strategy=single"], tmp_path / "run")
    first, last = summary["train_loss"][0], summary["train_loss"][-1]
    assert first > 0.6 and last < 0.9 * first  # BCE starts near ln 2 and falls
    assert summary["val_loss"] is not None and summary["val_loss"] < 0.95 * first
