"""``callbacks=[amp]``, ``recompute=`` and ``compile=`` through ``train.py`` with the strategies they must work with."""

from __future__ import annotations

import csv

import pytest

from tests.integration.test_train import REL_TOL, TINY, max_rel_diff, run_ok


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return run_ok([*TINY, "strategy=single"], tmp_path_factory.mktemp("single") / "run")


def test_fp16_with_sharded_gradients_logs_a_moving_loss_scale(single, tmp_path):
    # ZeRO-2: each rank unscales and checks only its slice of the gradients; the flag is all-reduced.
    run = run_ok(
        [*TINY, "strategy=zero", "strategy.stage=2", "trainer.devices=2", "callbacks=[amp]", "callbacks.amp.dtype=fp16", "callbacks.amp.incr_every_n_steps=4"],
        tmp_path / "run",
    )
    rows = [r for r in csv.DictReader((tmp_path / "run" / "metrics.csv").open()) if r.get("loss_scale")]
    scales = [float(r["loss_scale"]) for r in rows]
    assert len(scales) == 20
    assert len(set(scales)) > 1  # it moved: grew after good steps (and shrank on overflows, if any)
    assert run["amp"]["dtype"] == "fp16" and run["amp"]["loss_scale"] == scales[-1]
    assert run["amp"]["skipped_steps"] == int(float(rows[-1]["skipped_steps"]))
    assert run["train_loss"][-1] < run["train_loss"][0] - 0.2
    # Half precision changes the numbers, but not the outcome: close to fp32 after 20 steps.
    assert abs(run["train_loss"][-1] - single["train_loss"][-1]) / single["train_loss"][-1] < 0.1


@pytest.mark.parametrize("strategy", [["strategy=ddp"], ["strategy=zero", "strategy.stage=3"], ["strategy=pp", "strategy.pp=2"]], ids=["ddp", "zero3", "pp2"])
def test_recompute_matches_no_recompute(single, strategy, tmp_path):
    run = run_ok([*TINY, *strategy, "trainer.devices=2", "recompute=full"], tmp_path / "run")
    assert max_rel_diff(run["train_loss"], single["train_loss"]) <= REL_TOL


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [["strategy=ddp"], ["strategy=zero", "strategy.stage=3"], ["strategy=tp", "strategy.tp=2"]], ids=["ddp", "zero3", "tp2"])
def test_compiled_blocks_match_eager(single, strategy, tmp_path):
    run = run_ok([*TINY, *strategy, "trainer.devices=2", "compile=true"], tmp_path / "run")
    assert max_rel_diff(run["train_loss"], single["train_loss"]) <= REL_TOL


def test_fused_adamw_matches_the_default_implementation(single, tmp_path):
    run = run_ok([*TINY, "strategy=ddp", "trainer.devices=2", "+optim.optimizer.fused=true"], tmp_path / "run")
    assert max_rel_diff(run["train_loss"], single["train_loss"]) <= REL_TOL
