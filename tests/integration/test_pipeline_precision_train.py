"""Mixed precision under a pipeline: one loss scale for every stage, and an overflow on one stage skips the step
everywhere.

The schedule runs forward and backward itself, so the strategy applies the precision plugin inside it (autocast
around each stage's forward and the loss, the loss scale on the last stage's loss); the plugin's overflow check is
all-reduced over every rank. Here an inf is put into one gradient of one rank only — a rank of the *last* stage,
whose pipeline peers hold other parameters and whose data-parallel peers averaged nothing of it yet — and every
rank must skip that step and halve its scale, exactly as one process that sees the same inf does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from test_composition_matrix import half_tolerance
from test_train import TINY, max_rel_diff, run_ok

HERE = Path(__file__).resolve().parent
FP16 = ["callbacks=[amp]", "callbacks.amp.dtype=fp16", "callbacks.amp.decr_every_n_nan_or_inf=1", "trainer.limit_val_batches=0"]
ENV = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
STEPS, AT = 6, 2
TOL = half_tolerance("fp16", steps=STEPS, tokens=8 * 16)  # fp16 round-off over these steps (test_composition_matrix.py)


def _inject(rank: int) -> list[str]:
    return ["+callbacks.inf._target_=fault_injection.InfGradient", f"+callbacks.inf.rank={rank}", f"+callbacks.inf.at_step={AT}"]


def _scalers(run_dir: Path, world: int) -> list[dict]:
    return [json.loads((run_dir / f"amp_rank{r}.json").read_text()) for r in range(world)]


def test_overflow_on_one_stage_skips_the_step_on_every_rank(tmp_path):
    common = [*TINY, *FP16, f"trainer.max_steps={STEPS}"]
    single = run_ok([*common, "strategy=single", *_inject(0)], tmp_path / "single", env=ENV)
    # pp=2 × dp=2; mesh (pp, dp, sharding, tp): ranks 2 and 3 hold the last stage. Only rank 3 sees the inf.
    pipe = run_ok([*common, "strategy=pp", "strategy.pp=2", "strategy.microbatches=2", "trainer.devices=4", *_inject(3)],
                  tmp_path / "pipe", env=ENV)
    init = 32768.0
    assert _scalers(tmp_path / "single", 1) == [{"rank": 0, "loss_scale": init / 2, "skipped_steps": 1}]
    for record in _scalers(tmp_path / "pipe", 4):
        assert record["skipped_steps"] == 1 and record["loss_scale"] == init / 2, record
    assert pipe["amp"]["skipped_steps"] == 1
    # The skipped step is the same step: the trajectories agree within fp16 round-off.
    assert max_rel_diff(pipe["train_loss"], single["train_loss"]) <= TOL
    # Negative control: the same pipeline without the inf steps every time, and its losses leave the skipped run's.
    clean = run_ok([*common, "strategy=pp", "strategy.pp=2", "strategy.microbatches=2", "trainer.devices=4",
                    "+callbacks.inf._target_=fault_injection.InfGradient", "+callbacks.inf.rank=3", "+callbacks.inf.at_step=-1"],
                   tmp_path / "clean", env=ENV)
    assert all(r["skipped_steps"] == 0 and r["loss_scale"] == init for r in _scalers(tmp_path / "clean", 4))
    assert max_rel_diff(clean["train_loss"], pipe["train_loss"]) > 10 * TOL


def test_torch_grad_scaler_is_refused_under_a_pipeline_with_the_fix(tmp_path):
    # Lightning's 16-mixed on a GPU uses torch's GradScaler, which decides per rank: refused with what to use instead.
    from types import SimpleNamespace

    import pytest
    import torch

    from parallelkit.errors import ConfigError
    from parallelkit.strategies.pp import PipelineStrategy

    strategy = PipelineStrategy(pp=2)
    strategy._parallel_dims = strategy.plan(2)
    strategy._precision_plugin = SimpleNamespace(scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ConfigError, match="callbacks.amp.dtype=fp16"):
        strategy.check_pipeline_precision()


def test_black_and_white_lists_work_under_a_pipeline(tmp_path):
    # The lists wrap whole modules' forward (the MLPs kept in fp32, the LayerNorms forced into bf16: both the opposite
    # of what autocast does to them); the pipeline cut keeps those modules, and the stage's autocast is the outer
    # context they override.
    lists = ["callbacks=[amp]", "callbacks.amp.dtype=bf16", "callbacks.amp.custom_black_list=[MLP]",
             "callbacks.amp.custom_white_list=[LayerNorm]", "trainer.limit_val_batches=0", f"trainer.max_steps={STEPS}"]
    single = run_ok([*TINY, *lists, "strategy=single"], tmp_path / "single")
    pipe = run_ok([*TINY, *lists, "strategy=pp", "strategy.pp=2", "strategy.microbatches=2", "trainer.devices=2"], tmp_path / "pipe")
    assert pipe["amp"]["black_listed"] == single["amp"]["black_listed"] and pipe["amp"]["white_listed"] == single["amp"]["white_listed"]
    assert single["amp"]["white_listed"] and single["amp"]["black_listed"]
    matched = max_rel_diff(pipe["train_loss"], single["train_loss"])
    assert matched <= half_tolerance("bf16", steps=STEPS, tokens=8 * 16)
    # Negative control: the same pipeline without the lists follows another trajectory, further from the one above
    # than the pipeline is from one process with the same lists (CPU runs are deterministic: measured 3.9e-5 vs 8.9e-6).
    plain = run_ok([*TINY, *lists[:2], *lists[-2:], "strategy=pp", "strategy.pp=2", "strategy.microbatches=2", "trainer.devices=2"],
                   tmp_path / "plain")
    assert max_rel_diff(plain["train_loss"], pipe["train_loss"]) > 3 * matched


def test_the_loss_scale_is_checkpointed_and_resumed_under_a_pipeline(tmp_path):
    # The scale grows every 2 good steps here, so it moves within the run; a run resumed from its step-3 checkpoint
    # must go on with the scale and the losses of the uninterrupted one (the AMP plugin's state is in the checkpoint).
    common = [*TINY, "callbacks=[amp]", "callbacks.amp.dtype=fp16", "callbacks.amp.incr_every_n_steps=2", "trainer.limit_val_batches=0",
              "strategy=pp", "strategy.pp=2", "strategy.microbatches=2", "trainer.devices=2", "checkpoint.every_n_steps=3",
              f"trainer.max_steps={STEPS}"]
    straight = run_ok(common, tmp_path / "straight")
    step3 = next((tmp_path / "straight" / "checkpoints").glob("*step=3.ckpt"))
    resumed = run_ok([*common, f"ckpt_path={step3.rename(tmp_path / 'step3.ckpt')}"], tmp_path / "resumed")
    assert straight["amp"]["loss_scale"] == 32768.0 * 2 ** (STEPS // 2)  # it moved: 3 growths in 6 good steps
    assert resumed["amp"]["loss_scale"] == straight["amp"]["loss_scale"]
    assert resumed["train_loss"][-3:] == straight["train_loss"][-3:]  # bit for bit: same layout
    # Negative control: a run that starts over (scale from its initial value) ends at another scale.
    fresh = run_ok([*common[:-1], "trainer.max_steps=3"], tmp_path / "fresh")
    assert fresh["amp"]["loss_scale"] != resumed["amp"]["loss_scale"]
