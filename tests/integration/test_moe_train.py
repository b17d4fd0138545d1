"""End-to-end: ``python train.py model=moe_gpt strategy=moe ...`` against ``strategy=single``.

With a capacity factor that drops nothing, expert parallelism (ep=2 on 2 ranks; ep=2 × dp=2 on 4 ranks)
reproduces the single-process MoE ``train_loss`` within rel. 1e-5 over 20 steps, and logs routing metrics
(aux loss, dropped fraction, expert load) per step and its all-to-all traffic. Bad MoE settings stop the
run before any process starts, with exit code 2 and a message naming the values.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tests.integration.test_train import REL_TOL, TINY, max_rel_diff, run_ok, train

N_LAYER = 2  # TINY's model.n_layer
MOE = ["model=moe_gpt", "model.num_experts=4", "model.top_k=2", "trainer.limit_val_batches=0"]
NO_DROPS = "model.capacity_factor=2.0"  # num_experts / top_k: an expert can take every token


@pytest.fixture(scope="module")
def single_moe(tmp_path_factory) -> dict:
    return run_ok([*TINY, *MOE, NO_DROPS, "strategy=single"], tmp_path_factory.mktemp("single_moe") / "run")


def _metric_rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r.get("moe_dropped_frac")]


def test_moe_ep2_reproduces_single_process_loss_and_logs_routing(single_moe, tmp_path):
    run = run_ok([*TINY, *MOE, NO_DROPS, "strategy=moe", "strategy.ep=2", "trainer.devices=2"], tmp_path / "run")
    assert run["strategy"] == "moe" and run["dims"]["ep"] == 2 and run["dims"]["dp"] == 2
    assert run["steps"] == single_moe["steps"] == 20
    assert max_rel_diff(run["train_loss"], single_moe["train_loss"]) <= REL_TOL
    assert run["train_loss"][-1] < run["train_loss"][0] - 0.2
    assert single_moe["moe"]["dropped_frac"] == run["moe"]["dropped_frac"] == 0.0

    # 2 token all-to-alls per MoE layer in forward + 2 in backward, every step; none in one process.
    a2a = run["comm"]["by_kind"]["moe_all_to_all"]
    assert a2a["collectives_per_step"] == 4 * N_LAYER
    assert a2a["bytes_per_step"] > 0 and run["moe"]["all_to_all_bytes_per_step"] == a2a["bytes_per_step"]
    assert "moe_all_to_all" not in single_moe["comm"]["by_kind"]
    # Each rank holds half the experts: fewer parameter bytes than the full model.
    assert run["model_state_bytes"]["params"] < run["num_params"] * 4
    # Routing metrics: one metrics.csv row per step with the aux loss, drops and per-expert load.
    rows = _metric_rows(tmp_path / "run")
    assert [int(r["step"]) for r in rows] == list(range(20))
    for row in rows:
        load = [float(row[f"moe_load_e{e}"]) for e in range(4)]
        assert sum(load) == pytest.approx(8 * 16 * 2)  # global tokens × top_k per forward (mean over layers)
        assert float(row["moe_dropped_frac"]) == 0.0 and float(row["moe_aux_loss"]) > 0.9
    # ... and rank 0's all-to-all bytes of each step, which add up to the summary's total.
    assert sum(float(r["moe_all_to_all_bytes"]) for r in rows) == pytest.approx(a2a["bytes_per_step"] * 20)
    assert run["moe"]["tokens_per_expert"] == single_moe["moe"]["tokens_per_expert"]
    assert run["expert_parallel"]["local_experts"] == [0, 1]  # rank 0's


def test_moe_ep2_dp2_on_four_ranks_reproduces_single_process_loss(single_moe, tmp_path):
    run = run_ok([*TINY, *MOE, NO_DROPS, "strategy=moe", "strategy.ep=2", "trainer.devices=4"], tmp_path / "run")
    assert run["dims"]["ep"] == 2 and run["dims"]["dp"] == 4 and run["world_size"] == 4
    assert max_rel_diff(run["train_loss"], single_moe["train_loss"]) <= REL_TOL
    # Dense gradients over all 4 ranks, expert gradients over the 2 ranks holding the same experts.
    assert run["comm"]["by_kind"]["expert_grad_allreduce"]["bytes_per_step"] > 0
    assert run["comm"]["by_kind"]["grad_allreduce"]["bytes_per_step"] > 0


def test_negative_control_dropping_tokens_changes_the_loss(single_moe, tmp_path):
    """The parity check can fail: the same model with a capacity that drops tokens ends elsewhere."""
    run = run_ok([*TINY, *MOE, "model.capacity_factor=0.5", "strategy=single"], tmp_path / "run")
    assert run["moe"]["dropped_frac"] > 0.2
    assert max_rel_diff(run["train_loss"], single_moe["train_loss"]) > 1e-3
    assert max(float(r["moe_dropped_frac"]) for r in _metric_rows(tmp_path / "run")) > 0.2


# No trainer.devices: the other ranks would start early only to be stopped; the check runs before launch.
@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["model.num_experts=3", "strategy=moe", "strategy.ep=2"], ["num_experts=3", "strategy.ep=2"]),
        (["model.top_k=5", "strategy=moe"], ["top_k=5", "num_experts=4"]),
        (["model=gpt", "strategy=moe"], ["model=moe_gpt"]),
    ],
    ids=["experts_not_divisible_by_ep", "top_k_above_experts", "dense_model"],
)
def test_bad_moe_settings_exit_2_before_launch(overrides, words, tmp_path):
    moe = MOE if "model=gpt" not in overrides else MOE[3:]
    proc = train([*TINY, *moe, *overrides, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    for word in words:
        assert word in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize("model,says", [([*MOE, NO_DROPS], True), ([], False)], ids=["moe_gpt", "negative-control-dense-gpt"])
def test_tensor_parallel_says_once_that_the_experts_are_replicated(model, says, tmp_path):
    """strategy=tp splits attention and dense MLPs but keeps every expert whole on every tp rank: one line on
    rank 0 says so and where to go instead; a model without experts gets no such line."""
    proc = train([*TINY, *model, "strategy=tp", "strategy.tp=2", "trainer.devices=2",
                  "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "whole on every tensor-parallel rank" in line]
    assert len(said) == (1 if says else 0), said
    if says:
        assert "4 experts of each of the 2 MoE layers" in said[0] and "strategy=moe" in said[0] and "strategy.ep" in said[0]
