"""Distributed inference: a checkpoint trained at N ranks with one strategy is loaded at M ranks with another
(``mode=predict``), scores the validation set exactly as the training run did, and generates text."""

from __future__ import annotations

import json

import pytest

from tests.integration.test_train import TINY, run_ok, train

TRAIN = [*TINY, "trainer.max_steps=10"]


def _predict(args: list[str], ckpt, run_dir) -> dict:
    proc = train(
        [*TRAIN, "mode=predict", f"ckpt_path='{ckpt}'", "predict.samples=1", "predict.new_tokens=40", *args, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((run_dir / "predict.json").read_text())


@pytest.mark.parametrize(
    "trained,predicting",
    [
        (["strategy=zero", "strategy.stage=3", "trainer.devices=4"], ["strategy=single"]),  # 4 → 1
        (["strategy=tp", "strategy.tp=2", "trainer.devices=2"], ["strategy=ddp", "trainer.devices=2"]),  # 2 → 2, other strategy
    ],
    ids=["zero3x4-to-single", "tp2-to-ddp2"],
)
def test_checkpoint_scores_and_generates_on_another_layout(trained, predicting, tmp_path):
    run = run_ok([*TRAIN, *trained], tmp_path / "train")
    ckpt = tmp_path / "train" / "checkpoints" / "last.ckpt"
    result = _predict(predicting, ckpt, tmp_path / "predict")
    assert result["world_size"] == (1 if predicting == ["strategy=single"] else 2)
    # The same validation batches and weights: the training run's final validation loss, to round-off.
    assert result["val_loss"] == pytest.approx(run["val_loss"], rel=1e-5)
    assert len(result["samples"]) == 1 and result["samples"][0].startswith("def ") and len(result["samples"][0]) == 44

    # Negative control: the untrained model scores far worse, so the weights really were loaded.
    untrained = run_ok([*TRAIN, "strategy=single", "trainer.max_steps=1", "trainer.val_check_interval=1", "optim.optimizer.lr=0"], tmp_path / "untrained")
    assert untrained["val_loss"] > result["val_loss"] + 0.3


def test_predict_needs_a_checkpoint(tmp_path):
    proc = train([*TRAIN, "mode=predict", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2 and "mode=predict needs ckpt_path=PATH" in proc.stderr, proc.stderr[-2000:]
