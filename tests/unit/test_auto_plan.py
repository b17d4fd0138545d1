"""``strategy=auto``'s planner (parallelkit.auto_plan) on cases whose answer is known, in one process (meta models)."""

from __future__ import annotations

import pytest

from parallelkit.auto_plan import Candidate, Hardware, choose_layout, crosses_nodes, format_ranking, layouts
from parallelkit.distributed.parallel_dims import DP, PP, SHARDING, TP, ParallelDims
from parallelkit.errors import ConfigError
from parallelkit.plan import build_plan, build_workload, compose_config, model_shape, plan_options, rank_state_bytes
from parallelkit.strategies.auto import AutoStrategy

TINY = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "data.seq_len=16", "data.global_batch_size=16"]
# ~100M parameters (16Ψ ≈ 1.6 GB with fp32 AdamW), a small batch so the model state dominates.
LARGE = ["model.n_layer=8", "model.n_embd=1024", "model.n_head=16", "data.seq_len=64", "data.global_batch_size=16"]
# ~200M parameters with a real batch: gradient traffic matters.
DEEP = ["model.n_layer=16", "model.n_embd=1024", "model.n_head=16", "data.seq_len=256", "data.global_batch_size=256"]
GiB = 2**30


def hardware(**kw) -> Hardware:
    base = dict(devices_per_node=8, memory_per_device=80 * GiB, intra_node_bandwidth=1e11, inter_node_bandwidth=1e11,
                intra_node_latency=1e-5, inter_node_latency=1e-5, flops_per_device=5e13)
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
    # Put dp outermost instead: now dp crosses and pp stays inside a node of 8.
    moved = ParallelDims(16, dp=2, tp=2, pp=4, mesh_order=("dp", "pp", "sharding", "tp"))
    assert crosses_nodes(moved, DP, 8) and not crosses_nodes(moved, PP, 8)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_follows_the_zero_formulas(stage):
    cfg = compose_config(TINY)
    datamodule, model = build_workload(cfg)
    psi = sum(p.numel() for p in model.parameters())
    n = 4
    dims = ParallelDims(n, dp=1, sharding=n)
    options = plan_options(model, dims, shape=model_shape(model, datamodule), rank_batch=4, slots=2, zero_stage=stage)
    state, _, _ = rank_state_bytes(model, dims, {PP: 0}, options)
    zero = {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]
    assert sum(state.values()) == pytest.approx(zero, abs=3)  # int() truncation of three terms


def test_tiny_model_picks_pure_data_parallel():
    plan = choose_layout(compose_config(TINY), 4, hardware(devices_per_node=4))
    assert plan.chosen.degrees == {DP: 4, SHARDING: 1, TP: 1, PP: 1}
    assert plan.chosen.fits and plan.chosen.invalid is None
    # Every other valid layout was considered and estimated slower.
    others = [c for c in plan.candidates[1:] if c.invalid is None]
    assert others and all(c.total_time > plan.chosen.total_time for c in others)
    # tp=4 cannot split 2 heads: refused by hybrid4d's own check, with its reason.
    tp4 = next(c for c in plan.candidates if c.degrees[TP] == 4)
    assert tp4.invalid and "head" in tp4.invalid
    text = format_ranking(plan)
    assert "chosen" in text and "dp=4 sharding=1 tp=1 pp=1" in text


def test_model_too_large_for_one_device_is_sharded_or_split():
    """Pure dp needs 16Ψ per rank > the device: the chosen layout splits the model state (sharding, tp, or a
    pipeline — which of them is the cost model's trade-off between traffic and bubble)."""
    cfg = compose_config(LARGE)
    memory = 1 * GiB
    plan = choose_layout(cfg, 8, hardware(memory_per_device=memory))
    pure_dp = next(c for c in plan.candidates if c.degrees[DP] == 8)
    assert pure_dp.invalid is None and not pure_dp.fits
    assert pure_dp.memory["state"] >= 16 * plan.num_params  # the whole fp32 AdamW state on every rank
    assert "doesn't fit" in format_ranking(plan, top=3)
    chosen = plan.chosen
    assert chosen.fits and chosen.memory["total"] <= memory
    assert chosen.degrees[SHARDING] * chosen.degrees[TP] * chosen.degrees[PP] > 1
    assert chosen.memory["state"] < memory < pure_dp.memory["state"]
    # Without a pipeline to fall back on (pp needs blocks ≥ pp), only sharding or tp remain.
    no_pp = [c for c in plan.candidates if c.fits and c.degrees[PP] == 1]
    assert no_pp and all(c.degrees[SHARDING] > 1 or c.degrees[TP] > 1 for c in no_pp)


def test_many_nodes_with_slow_links_put_the_pipeline_across_nodes():
    cfg = compose_config(DEEP)
    slow = choose_layout(cfg, 32, hardware(inter_node_bandwidth=1e9, inter_node_latency=2e-5)).chosen
    assert slow.degrees[PP] > 1 and slow.crosses_nodes[PP]
    # The heavy traffic stays on the fast links: sharding's gathers and reduce-scatters and tp's all-reduces.
    # (With sharding inside the node, the dp all-reduce across nodes carries only the 1/sharding gradient
    # shard: the planner may let it cross, as it does here with sharding=8 × pp=2.)
    assert not any(slow.crosses_nodes[a] for a in (SHARDING, TP))
    if slow.crosses_nodes[DP]:
        assert slow.degrees[SHARDING] >= 8
    # Control: with fast links everywhere the planner lets far more bytes cross the nodes (plain dp over 16).
    fast = choose_layout(cfg, 32, hardware()).chosen

    def across_nodes(c) -> float:
        return sum(v for axis, v in c.comm_bytes.items() if c.crosses_nodes.get(axis))

    assert across_nodes(slow) * 5 < across_nodes(fast)


def test_nothing_fits_names_the_smallest_memory_needed():
    cfg = compose_config(LARGE)
    plan = choose_layout(cfg, 8, hardware(memory_per_device=1e15))
    smallest = min((c for c in plan.candidates if c.invalid is None), key=lambda c: c.memory["total"])
    need = smallest.memory["total"]
    with pytest.raises(ConfigError, match="no layout of 8 ranks fits") as err:
        choose_layout(cfg, 8, hardware(memory_per_device=need * 0.999))
    assert f"{need / GiB:.2f} GiB" in str(err.value) and smallest.label in str(err.value)
    # At exactly that memory only layouts needing that little fit: one of them is chosen.
    chosen = choose_layout(cfg, 8, hardware(memory_per_device=need)).chosen
    assert chosen.fits and chosen.memory["total"] == need


def test_auto_strategy_refuses_degrees_and_bad_hardware():
    with pytest.raises(ConfigError, match="chooses strategy.tp itself"):
        AutoStrategy(tp=2)
    with pytest.raises(ConfigError, match="strategy.hardware has no"):
        AutoStrategy(hardware={"bandwidth": 1})
    with pytest.raises(ConfigError, match="flops_per_device should be a number greater than 0"):
        AutoStrategy(hardware={"flops_per_device": 0}).resolve_hardware(2)


def test_auto_strategy_resolves_to_hybrid4d_at_the_chosen_degrees():
    cfg = compose_config([*TINY, "strategy=auto"])
    from hydra.utils import instantiate

    auto = instantiate(cfg.strategy)
    strategy = auto.resolve(cfg, 2, 1)
    assert strategy.strategy_name == "hybrid4d"
    assert strategy.plan(2).as_dict() == {**auto.auto_plan.chosen.degrees, "ep": 1}
    assert strategy.summary_metrics(None)["auto_plan"]["chosen"] == auto.auto_plan.chosen.degrees


def test_dry_run_shows_the_layout_auto_would_train():
    plan = build_plan([*TINY, "strategy=auto", "trainer.devices=4"])
    assert plan.strategy == "hybrid4d"
    assert plan.dims.as_dict() == {DP: 4, SHARDING: 1, TP: 1, PP: 1, "ep": 1}  # tiny model: pure dp, as above


def test_candidate_reports_why_it_does_not_fit():
    c = Candidate({DP: 1, SHARDING: 1, TP: 1, PP: 1}, memory={"total": 3 * GiB})
    assert "3.00 GiB" in c.why_not(2 * GiB)
