"""strategy=hybrid4d end to end: each 2-axis composition on 4 ranks reproduces strategy=single's losses.

Every run uses the same seed, tiny GPT, data and global batch as the single-process reference computed
in this module; the degrees' traffic must show up in ``comm.by_kind`` (the parallelism really ran).
"""

from __future__ import annotations

import re

import pytest

from test_train import REL_TOL, TINY, max_rel_diff, run_ok, train


@pytest.fixture(scope="module")
def single_reference(tmp_path_factory) -> dict:
    return run_ok([*TINY, "strategy=single"], tmp_path_factory.mktemp("single") / "run")


def _hybrid(tmp_path, *degrees: str, devices: int = 4) -> dict:
    return run_ok([*TINY, "strategy=hybrid4d", *degrees, f"trainer.devices={devices}"], tmp_path / "run")


def _kinds(summary: dict) -> set[str]:
    return {kind for kind, entry in summary["comm"]["by_kind"].items() if entry["bytes_per_step"] > 0}


def test_tp_x_dp_matches_single(single_reference, tmp_path):
    run = _hybrid(tmp_path, "strategy.tp=2", "strategy.pp=1", "strategy.dp=2")
    assert run["strategy"] == "hybrid4d" and run["dims"] == {"dp": 2, "sharding": 1, "tp": 2, "pp": 1, "ep": 1}
    assert run["steps"] == 20
    assert max_rel_diff(run["train_loss"], single_reference["train_loss"]) <= REL_TOL
    kinds = _kinds(run)
    assert any(k.startswith("tp_block") for k in kinds), kinds  # TP collectives inside the blocks
    assert "grad_allreduce" in kinds, kinds  # dp gradient average
    # TP really split the model: the largest rank holds less than the whole model.
    assert run["model_state_bytes"]["params"] < run["num_params"] * 4


def test_tp_x_sharding_matches_single(single_reference, tmp_path):
    run = _hybrid(tmp_path, "strategy.tp=2", "strategy.pp=1", "strategy.dp=1", "strategy.sharding=2")
    assert run["dims"] == {"dp": 1, "sharding": 2, "tp": 2, "pp": 1, "ep": 1}
    assert max_rel_diff(run["train_loss"], single_reference["train_loss"]) <= REL_TOL
    kinds = _kinds(run)
    assert "param_all_gather" in kinds and any(k.startswith("tp_block") for k in kinds), kinds
    # FSDP2 × TP: each rank holds about a quarter of the parameters (vocabulary-parallel embeddings too).
    assert run["model_state_bytes"]["params"] <= run["num_params"] * 4 / 3


def test_pp_x_tp_matches_single(single_reference, tmp_path):
    run = _hybrid(tmp_path, "strategy.tp=2", "strategy.pp=2", "strategy.dp=1")
    assert run["dims"] == {"dp": 1, "sharding": 1, "tp": 2, "pp": 2, "ep": 1}
    assert max_rel_diff(run["train_loss"], single_reference["train_loss"]) <= REL_TOL
    kinds = _kinds(run)
    assert any(k.startswith("tp_block") for k in kinds) and any(k.startswith("pp") for k in kinds), kinds
    assert run["pipeline"]["pp"] == 2
    assert run["model_state_bytes"]["params"] < run["num_params"] * 4 / 2


def test_negative_control_different_seed_is_caught(single_reference, tmp_path):
    # The comparison above can fail: a run that differs only in its initial weights is far outside REL_TOL.
    run = run_ok([*TINY, "strategy=single", "seed=7"], tmp_path / "run")
    assert max_rel_diff(run["train_loss"], single_reference["train_loss"]) > 100 * REL_TOL


@pytest.mark.parametrize(
    ("degrees", "message"),
    [
        (dict(tp=2, pp=2, sharding=2, dp=1), "strategy.sharding=2 with strategy.pp=2"),
        (dict(tp=3, pp=1, dp=-1), "tp(3)"),
        (dict(tp=2, pp=1, dp=1, ep=2), "strategy.ep=2"),
        (dict(tp=4, pp=1, dp=1), "strategy.tp=4 does not divide"),
        (dict(tp=2, pp=2, dp=1, sequence_parallel=True), "sequence_parallel=true with strategy.pp=2"),
        (dict(tp=2, pp=-1, dp=1), "explicit strategy.pp"),
    ],
)
def test_unsupported_or_invalid_combinations_raise_config_error(degrees, message):
    # In-process, as run.py does before launch: construct, plan for 4 ranks, check the tiny GPT (2 heads).
    from parallelkit.errors import ConfigError
    from parallelkit.models.gpt.model import GPT
    from parallelkit.strategies.hybrid4d import hybrid4d

    with pytest.raises(ConfigError, match=re.escape(message)):
        strategy = hybrid4d(**degrees)
        strategy.plan(4)
        strategy.check_model(GPT(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32), 4)


def test_refused_combination_exits_2_before_launch(tmp_path):
    # Through train.py: norm clipping with tp inside a pipeline is refused with exit code 2, nothing written.
    args = ["strategy.tp=2", "strategy.pp=2", "strategy.dp=1", "trainer.gradient_clip_val=1.0"]
    proc = train([*TINY, "strategy=hybrid4d", *args, "trainer.devices=4", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "gradient_clip_val=1.0 by norm" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow  # the same compositions strategy=pp and strategy=zero test; here hybrid4d's routing to them
@pytest.mark.parametrize(
    ("degrees", "dims", "kind"),
    [
        (["strategy.tp=1", "strategy.pp=2", "strategy.dp=2"], {"dp": 2, "sharding": 1, "tp": 1, "pp": 2, "ep": 1}, "pp_p2p"),
        (["strategy.tp=1", "strategy.pp=1", "strategy.dp=2", "strategy.sharding=2"], {"dp": 2, "sharding": 2, "tp": 1, "pp": 1, "ep": 1}, "param_all_gather"),
    ],
)
def test_other_two_axis_combinations_match_single(single_reference, tmp_path, degrees, dims, kind):
    run = _hybrid(tmp_path, *degrees)
    assert run["dims"] == dims
    assert max_rel_diff(run["train_loss"], single_reference["train_loss"]) <= REL_TOL
    assert kind in _kinds(run)


@pytest.mark.slow
def test_default_degrees_on_8_ranks_match_single(single_reference, tmp_path):
    # The defaults: tp=2 × pp=2 × dp=2 (DESIGN's 8-rank example). 8 processes on 2 cores: slow.
    run = _hybrid(tmp_path, devices=8)
    assert run["dims"] == {"dp": 2, "sharding": 1, "tp": 2, "pp": 2, "ep": 1}
    assert max_rel_diff(run["train_loss"], single_reference["train_loss"]) <= 1e-4
