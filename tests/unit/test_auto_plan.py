"""``strategy=auto``'s choice (parallelkit.planner.auto over the rest of parallelkit.planner) on cases whose answer is known, in one process."""

from __future__ import annotations

import pytest

from parallelkit.distributed.parallel_dims import DP, PP, SHARDING, TP, ParallelDims
from parallelkit.errors import ConfigError
from parallelkit.planner.auto import choose_layout, crosses_nodes, layouts, workload_of
from parallelkit.planner.dry_run import build_plan
from parallelkit.planner.hardware import Hardware, Link
from parallelkit.planner.inputs import compose_config
from parallelkit.planner.layout import Layout
from parallelkit.planner.report import format_ranking
from parallelkit.planner.search import Candidate, evaluate
from parallelkit.strategies.auto import AutoStrategy


def lay(dp: int = 1, sharding: int = 1, tp: int = 1, pp: int = 1, **options) -> Layout:
    """A layout of these degrees (their product the world size) and options."""
    return Layout(ParallelDims(dp * sharding * tp * pp, dp=dp, sharding=sharding, tp=tp, pp=pp), **options)

TINY = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "data.seq_len=16", "data.global_batch_size=16"]
# ~100M parameters (16Ψ ≈ 1.6 GB with fp32 AdamW), a small batch so the model state dominates.
LARGE = ["model.n_layer=8", "model.n_embd=1024", "model.n_head=16", "data.seq_len=64", "data.global_batch_size=16"]
# ~200M parameters with a real batch: gradient traffic matters.
DEEP = ["model.n_layer=16", "model.n_embd=1024", "model.n_head=16", "data.seq_len=256", "data.global_batch_size=256"]
GiB = 2**30


def hardware(**kw) -> Hardware:
    base = dict(name="test", devices_per_node=8, memory_per_device=80 * GiB, matmul_flops={"fp32": 5e13, "bf16": 5e13},
                memory_bandwidth=1e12, intra_node=Link(1e11, 1e-5), inter_node=Link(1e11, 1e-5))
    return Hardware(**{**base, **kw})


def test_layouts_are_every_factorisation_once():
    found = layouts(8)
    assert len({tuple(d.values()) for d in found}) == len(found)
    assert all(d[DP] * d[SHARDING] * d[TP] * d[PP] == 8 for d in found)
    assert len(found) == 20  # ordered factorisations of 2**3 into 4 factors: C(3 + 3, 3)


def test_axis_crosses_nodes_by_mesh_order():
    dims = ParallelDims(16, dp=2, tp=2, pp=4)  # mesh pp, dp, sharding, tp: strides 4, 2, 1, 1
    assert not crosses_nodes(dims, TP, 4) and not crosses_nodes(dims, DP, 4)
    assert crosses_nodes(dims, PP, 4)  # pp groups are ranks 4 apart: one per node
    assert not crosses_nodes(dims, PP, 16)  # one node holds the whole job
    assert not crosses_nodes(dims, SHARDING, 1)  # degree 1: no group to cross with
    moved = ParallelDims(16, dp=2, tp=2, pp=4, mesh_order=("dp", "pp", "sharding", "tp"))
    assert crosses_nodes(moved, DP, 8) and not crosses_nodes(moved, PP, 8)


def test_tiny_model_is_not_split():
    """A model that fits every rank whole gains nothing from tp (in-line collectives) or pp (a bubble)."""
    plan = choose_layout(compose_config(TINY), 4, hardware(devices_per_node=4))
    chosen = plan.chosen
    assert chosen.fits and chosen.invalid is None
    assert chosen.degrees[TP] == 1 and chosen.degrees[PP] == 1 and chosen.layout.accumulate == 1
    others = [c for c in plan.candidates[1:] if c.invalid is None and c.fits]
    assert others and all(c.total_time >= chosen.total_time for c in others)
    tp4 = next(c for c in plan.candidates if c.degrees[TP] == 4)  # 2 heads cannot be split 4 ways: refused, with why
    assert tp4.invalid and "model.n_head=2" in tp4.invalid
    text = format_ranking(plan)
    assert "chosen" in text and chosen.label in text and "deciding terms" in text


def test_model_too_large_for_one_device_is_sharded_or_split():
    """Pure dp needs 16Ψ per rank > the device: the chosen layout splits the model state."""
    cfg = compose_config(LARGE)
    memory = 1 * GiB
    plan = choose_layout(cfg, 8, hardware(memory_per_device=memory))
    pure_dp = next(c for c in plan.candidates if c.degrees[DP] == 8 and c.invalid is None)
    assert not pure_dp.fits and pure_dp.memory["state"] >= 16 * plan.num_params  # the whole fp32 AdamW state everywhere
    assert "doesn't fit" in format_ranking(plan, top=3)
    chosen = plan.chosen
    assert chosen.fits and chosen.memory["total"] <= memory
    assert chosen.degrees[SHARDING] * chosen.degrees[TP] * chosen.degrees[PP] > 1
    assert chosen.memory["state"] < memory < pure_dp.memory["state"]


def test_many_nodes_with_slow_links_keep_heavy_traffic_inside_nodes():
    cfg = compose_config(DEEP)
    slow = choose_layout(cfg, 32, hardware(inter_node=Link(1e9, 2e-5))).chosen
    # tp never crosses (refused unless allowed). Sharding may: a ring across nodes runs over every member's own
    # network card (members per node × the per-GPU inter-node bandwidth, docs/planner.md), so only the bytes are held.
    assert not slow.crosses_nodes[TP]
    fast = choose_layout(cfg, 32, hardware()).chosen

    def across_nodes(c) -> float:
        return sum(v for axis, v in c.comm_bytes.items() if c.crosses_nodes.get(axis))

    # Control: with fast links everywhere the planner lets several times more bytes cross the nodes.
    assert across_nodes(slow) * 3 < across_nodes(fast)


def test_tp_groups_stay_inside_a_node_unless_allowed():
    cfg = compose_config(["model.n_layer=2", "model.n_embd=256", "model.n_head=16", "data.seq_len=16", "data.global_batch_size=16"])
    hw = hardware(devices_per_node=2)
    plan = choose_layout(cfg, 8, hw)
    tp8 = next(c for c in plan.candidates if c.degrees[TP] == 8)
    assert tp8.invalid and "span nodes" in tp8.invalid
    allowed = choose_layout(cfg, 8, hw, allow_tp_across_nodes=True)
    tp8 = next(c for c in allowed.candidates if c.degrees[TP] == 8)
    assert tp8.invalid is None and tp8.crosses_nodes[TP]


def test_nothing_fits_names_the_smallest_memory_needed():
    cfg = compose_config(LARGE)
    plan = choose_layout(cfg, 8, hardware(memory_per_device=1e15))
    smallest = min((c for c in plan.candidates if c.invalid is None), key=lambda c: c.memory["total"])
    need = smallest.memory["total"]
    with pytest.raises(ConfigError, match="no layout of 8 ranks fits") as err:
        choose_layout(cfg, 8, hardware(memory_per_device=need * 0.999))
    assert f"{need / GiB:.2f} GiB" in str(err.value) and smallest.label in str(err.value)
    chosen = choose_layout(cfg, 8, hardware(memory_per_device=need)).chosen  # at exactly that memory, it fits
    assert chosen.fits and chosen.memory["total"] == need


def test_tight_memory_makes_the_search_accumulate_gradients():
    """Gradient accumulation is a free parameter: with memory for 2 sequences' activations, not 4, pure dp
    cuts its per-rank batch of 4 into 2 micro-batches."""
    cfg = compose_config(["model.n_layer=2", "model.n_embd=64", "model.n_head=2", "data.seq_len=512", "data.global_batch_size=8"])
    hw = hardware(devices_per_node=2)
    whole = evaluate_dp(cfg, hw, accumulate=1)
    half = evaluate_dp(cfg, hw, accumulate=2)
    assert half.memory["activations"] < whole.memory["activations"]
    limit = (whole.memory["total"] + half.memory["total"]) / 2
    plan = choose_layout(cfg, 2, hardware(devices_per_node=2, memory_per_device=limit))
    dp_only = [c for c in plan.candidates if c.fits and c.degrees[DP] == 2]
    assert dp_only and all(c.layout.accumulate >= 2 for c in dp_only)


def evaluate_dp(cfg, hw, accumulate: int):
    w = workload_of(cfg)
    return evaluate(w, hw, lay(2, 1, 1, 1, micro_batch=4 // accumulate, accumulate=accumulate))


def test_auto_strategy_refuses_degrees_and_bad_hardware():
    with pytest.raises(ConfigError, match="chooses strategy.tp itself"):
        AutoStrategy(tp=2)
    with pytest.raises(ConfigError, match="strategy.hardware has no"):
        AutoStrategy(hardware={"bandwidth": 1})
    with pytest.raises(ConfigError, match="flops_per_device should be a number greater than 0"):
        AutoStrategy(hardware={"flops_per_device": 0})
    with pytest.raises(ConfigError, match="neither a named profile"):
        AutoStrategy(hardware="no_such_profile").resolve_hardware(2)


def test_auto_strategy_resolves_to_hybrid4d_at_the_chosen_degrees_and_accumulation():
    from hydra.utils import instantiate

    cfg = compose_config([*TINY, "strategy=auto"])
    auto = instantiate(cfg.strategy)
    strategy = auto.resolve(cfg, 2, 1)
    assert strategy.strategy_name == "hybrid4d"
    assert strategy.plan(2).as_dict() == {**auto.auto_plan.chosen.degrees, "ep": 1}
    assert strategy.summary_metrics(None)["auto_plan"]["chosen"] == auto.auto_plan.chosen.degrees
    trainer_cfg = {"accumulate_grad_batches": 7}
    strategy.bind_trainer_config(trainer_cfg)  # run.py cuts the batch and builds the Trainer from this afterwards
    assert trainer_cfg["accumulate_grad_batches"] == auto.auto_plan.chosen.layout.accumulate


def test_dry_run_shows_the_layout_auto_would_train():
    plan = build_plan([*TINY, "strategy=auto", "trainer.devices=4"])
    assert plan.strategy == "hybrid4d"
    assert plan.dims.as_dict()[TP] == 1 and plan.dims.as_dict()[PP] == 1  # tiny model: not split, as above


def test_candidate_reports_why_it_does_not_fit():
    c = Candidate(lay(1, 1, 1, 1), memory={"total": 3 * GiB})
    assert "3.00 GiB" in c.why_not(2 * GiB)
