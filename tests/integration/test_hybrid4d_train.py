"""strategy=hybrid4d end to end: every 2-axis composition on 4 ranks reproduces strategy=single's losses.

Each run uses the same seed, tiny model, data and global batch as the single-process reference computed in
this module, and clips gradients by norm at a value that really clips (so the whole-model norm must be
right on every layout: it moves the loss by 7e-3 when it is off). The degrees' traffic must show up in
``comm.by_kind``: the parallelism really ran.

GPT: dp × sharding, dp × tp, dp × pp, sharding × tp, sharding × pp, tp × pp. MoE GPT (experts spread over
``ep`` data-parallel ranks, so ep comes with dp or sharding): ep × dp, ep × sharding, ep × tp, ep × pp.
"""

from __future__ import annotations

import re

import pytest

from test_train import REL_TOL, TINY, max_rel_diff, run_ok, train

CLIP = ["trainer.gradient_clip_val=0.5"]
# Capacity factor num_experts / top_k: no token is ever dropped, so the split of the batch cannot matter.
MOE = ["model=moe_gpt", "model.num_experts=4", "model.top_k=2", "model.capacity_factor=2.0", "trainer.limit_val_batches=0"]
# Without the load-balancing loss, which a pipeline computes per micro-batch (test_moe_pipeline_carries_... below).
MOE_NO_AUX = [*MOE, "model.aux_loss_weight=0"]


@pytest.fixture(scope="module")
def single_reference(tmp_path_factory) -> dict:
    return run_ok([*TINY, *CLIP, "strategy=single"], tmp_path_factory.mktemp("single") / "run")


@pytest.fixture(scope="module")
def single_moe(tmp_path_factory) -> dict:
    return run_ok([*TINY, *MOE_NO_AUX, "strategy=single"], tmp_path_factory.mktemp("single_moe") / "run")


def _hybrid(tmp_path, *args: str, devices: int = 4) -> dict:
    return run_ok([*TINY, "strategy=hybrid4d", *args, f"trainer.devices={devices}"], tmp_path / "run")


def _kinds(summary: dict) -> set[str]:
    return {kind for kind, entry in summary["comm"]["by_kind"].items() if entry["bytes_per_step"] > 0}


def _degrees(dp: int = 1, sharding: int = 1, tp: int = 1, pp: int = 1, ep: int = 1) -> tuple[list[str], dict]:
    args = [f"strategy.{k}={v}" for k, v in dict(dp=dp, sharding=sharding, tp=tp, pp=pp, ep=ep).items()]
    return args, dict(dp=dp, sharding=sharding, cp=1, tp=tp, pp=pp, ep=ep)


TP, PP = "tp_block.all_reduce", "pp_p2p"
GATHER, DP_AVG = "param_all_gather", "grad_allreduce"

GPT_LAYOUTS = {
    # name: (degrees, traffic kinds that must appear, model-state share of the largest rank at most)
    "dp2_sharding2": (dict(dp=2, sharding=2), {GATHER, "grad_all_reduce"}, 0.5),
    "dp2_tp2": (dict(dp=2, tp=2), {TP, DP_AVG}, 0.75),
    "dp2_pp2": (dict(dp=2, pp=2), {PP, DP_AVG}, 0.75),
    "sharding2_tp2": (dict(sharding=2, tp=2), {GATHER, TP}, 1 / 3),
    "sharding2_pp2": (dict(sharding=2, pp=2), {GATHER, PP}, 1 / 3),
    "tp2_pp2": (dict(tp=2, pp=2), {TP, PP}, 0.5),
}
SLOW_GPT = {"dp2_sharding2", "dp2_pp2"}  # compositions that strategy=zero and strategy=pp also test


@pytest.mark.parametrize(
    "layout", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_GPT else name for name in GPT_LAYOUTS]
)
def test_gpt_two_axis_layouts_match_single(single_reference, tmp_path, layout):
    degrees, kinds, share = GPT_LAYOUTS[layout]
    args, dims = _degrees(**degrees)
    run = _hybrid(tmp_path, *args, *CLIP)
    assert run["strategy"] == "hybrid4d" and run["dims"] == dims and run["steps"] == 20
    assert max_rel_diff(run["train_loss"], single_reference["train_loss"]) <= REL_TOL
    assert kinds <= _kinds(run), _kinds(run)
    # The model really is split: the most loaded rank holds at most this share of the parameter bytes.
    assert run["model_state_bytes"]["params"] <= share * run["num_params"] * 4 * 1.1


MOE_LAYOUTS = {
    # name: (degrees, devices, traffic kinds that must appear)
    "ep2_dp2": (dict(dp=2, ep=2), 2, {"moe_all_to_all", DP_AVG}),
    "ep2_sharding2": (dict(sharding=2, ep=2), 2, {"moe_all_to_all", GATHER}),
    "ep2_tp2": (dict(dp=2, tp=2, ep=2), 4, {"moe_all_to_all", TP, DP_AVG}),
    "ep2_pp2": (dict(dp=2, pp=2, ep=2), 4, {"moe_all_to_all", PP, DP_AVG}),
}


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_moe_layouts_with_expert_parallel_match_single(single_moe, tmp_path, layout):
    degrees, devices, kinds = MOE_LAYOUTS[layout]
    args, dims = _degrees(**degrees)
    run = _hybrid(tmp_path, *MOE_NO_AUX, *args, devices=devices)
    assert run["dims"] == dims
    assert max_rel_diff(run["train_loss"], single_moe["train_loss"]) <= REL_TOL
    assert kinds <= _kinds(run), _kinds(run)
    # Rank 0 holds experts 0 and 1 of 4 (the other ep rank holds 2 and 3).
    assert run["expert_parallel"] == {"ep": 2, "local_experts": [0, 1]}


def test_moe_pipeline_carries_every_stage_aux_loss(tmp_path):
    """A pipeline adds the aux losses of all stages' MoE layers to the last stage's loss, per micro-batch.

    With 4 micro-batches that is one process accumulating 4 micro-batches: equal within round-off. The
    negative control is the plain single-process run, whose aux loss is taken over the whole batch.
    """
    moe = [*MOE, "model.aux_loss_weight=0.1"]
    accumulated = run_ok([*TINY, *moe, "strategy=single", "trainer.accumulate_grad_batches=4"], tmp_path / "acc4")
    whole = run_ok([*TINY, *moe, "strategy=single"], tmp_path / "whole")
    run = _hybrid(tmp_path, *moe, *_degrees(pp=2)[0], "strategy.microbatches=4", devices=2)
    assert max_rel_diff(run["train_loss"], accumulated["train_loss"]) <= REL_TOL
    assert max_rel_diff(run["train_loss"], whole["train_loss"]) > 10 * REL_TOL


def test_negative_control_different_seed_is_caught(single_reference, tmp_path):
    # The comparison above can fail: a run that differs only in its initial weights is far outside REL_TOL,
    # and so is one that does not clip.
    run = run_ok([*TINY, *CLIP, "strategy=single", "seed=7"], tmp_path / "run")
    assert max_rel_diff(run["train_loss"], single_reference["train_loss"]) > 100 * REL_TOL
    unclipped = run_ok([*TINY, "strategy=single"], tmp_path / "unclipped")
    assert max_rel_diff(unclipped["train_loss"], single_reference["train_loss"]) > 100 * REL_TOL


@pytest.mark.parametrize(
    ("degrees", "moe", "message"),
    [
        (dict(tp=3, pp=1, dp=-1), False, "tp(3)"),
        (dict(tp=4, pp=1, dp=1), False, "strategy.tp=4 does not divide"),
        (dict(tp=1, pp=2, dp=2, sequence_parallel=True), False, "sequence_parallel=true needs strategy.tp > 1"),
        (dict(tp=2, pp=-1, dp=1), False, "explicit strategy.pp"),
        (dict(tp=1, pp=1, dp=2, sharding=2, ep=4), False, "Mixture-of-Experts"),
        (dict(tp=1, pp=1, dp=2, sharding=2, ep=3), True, "strategy.ep=3 must divide dp(2) × sharding(2)"),
        (dict(tp=2, pp=1, dp=2, ep=2, sequence_parallel=True), True, "does not work with model=moe_gpt"),
    ],
)
def test_unsupported_or_invalid_combinations_raise_config_error(degrees, moe, message):
    # In-process, as run.py does before launch: construct, plan for 4 ranks, check the tiny model (2 heads).
    from parallelkit.errors import ConfigError
    from parallelkit.models.gpt.model import GPT
    from parallelkit.models.moe_gpt.model import MoEGPT
    from parallelkit.strategies.hybrid4d import hybrid4d

    sizes = dict(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32)
    model = MoEGPT(**sizes, num_experts=2) if moe else GPT(**sizes)
    with pytest.raises(ConfigError, match=re.escape(message)):
        strategy = hybrid4d(**degrees)
        strategy.plan(4)
        strategy.check_model(model, 4)


def test_more_pipeline_stages_than_blocks_is_a_config_error():
    from parallelkit.errors import ConfigError
    from parallelkit.models.gpt.model import GPT
    from parallelkit.strategies.hybrid4d import hybrid4d

    strategy = hybrid4d(dp=1, tp=1, pp=4)
    strategy.plan(4)
    with pytest.raises(ConfigError, match=re.escape("4 stages but the model has only 2 blocks")):
        strategy.check_workload(GPT(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32))


def test_experts_that_ep_does_not_divide_exit_2_before_launch(tmp_path):
    # Through train.py: model.num_experts=3 cannot be spread over ep=2 ranks; exit code 2, nothing written.
    args = [*MOE, "model.num_experts=3", "model.top_k=1", "strategy=hybrid4d", *_degrees(dp=2, ep=2)[0]]
    proc = train([*TINY, *args, "trainer.devices=2", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model.num_experts=3 is not divisible by strategy.ep=2" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("layout", [None, dict(sharding=2, tp=2, pp=2)], ids=["defaults_dp2_tp2_pp2", "sharding2_tp2_pp2"])
def test_three_axes_on_8_ranks_match_single(single_reference, tmp_path, layout):
    # The default degrees on 8 ranks (tp=2 × pp=2 × dp=2, DESIGN's example) and the sharded twin. 8 processes
    # on 2 cores: slow.
    args, dims = _degrees(**(layout or dict(dp=2, tp=2, pp=2)))
    run = _hybrid(tmp_path, *(args if layout else []), *CLIP, devices=8)
    assert run["dims"] == dims
    assert max_rel_diff(run["train_loss"], single_reference["train_loss"]) <= 1e-4
