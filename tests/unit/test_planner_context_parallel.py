"""Context parallelism in the planner: the degree in the search (where the sequence and the model allow it), its
memory (activations ÷ cp, state sharded over sharding × cp) and its time terms (ring hops overlapped with block
compute, all-to-alls for Ulysses, the gradient all-reduce over dp × cp). No model is built."""

from __future__ import annotations

import pytest
import torch

from parallelkit.distributed.context_parallel import ring_payload_bytes
from parallelkit.distributed.parallel_dims import CP, DP, ParallelDims
from parallelkit.errors import ConfigError
from parallelkit.planner.cost_model import CostModel
from parallelkit.planner.hardware import Link, load_profile
from parallelkit.planner.layout import Layout, group_crosses_nodes, pipeline_stages
from parallelkit.planner.memory import layer_activation_bytes, logits_bytes, rank_memory
from parallelkit.planner.search import SearchOptions, degree_problem, evaluate, search
from parallelkit.planner.shapes import gpt_shape, hf_shape
from parallelkit.planner.workload import PRECISIONS, Workload

A100 = load_profile("a100_80gb_8x")
# A small Llama: 16 heads, 4 key/value heads (GQA), rotary positions (nothing in the state grows with the sequence).
LLAMA = {"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
         "num_key_value_heads": 4, "intermediate_size": 2816, "vocab_size": 32000}


def lay(dp: int = 1, sharding: int = 1, cp: int = 1, tp: int = 1, pp: int = 1, **options) -> Layout:
    return Layout(ParallelDims(dp * sharding * cp * tp * pp, dp=dp, sharding=sharding, cp=cp, tp=tp, pp=pp), **options)


def llama(seq: int, batch: int = 8, **kw) -> Workload:
    return Workload(hf_shape(LLAMA), seq, batch, PRECISIONS["amp"], **kw)


# ------------------------------------------------------------------------------------ the search
def test_the_search_proposes_cp_for_a_sequence_that_fits_no_other_way_and_not_for_a_short_one():
    long = llama(1 << 20, recompute="full")  # 1,048,576 tokens per sequence on 8 A100s
    with pytest.raises(ConfigError, match="no layout of 8 ranks fits"):
        search(long, A100, 8, SearchOptions(max_cp=1))  # dp, sharding, tp (≤ 4 key/value heads), pp: none fits
    chosen = search(long, A100, 8).chosen
    assert chosen.fits and chosen.layout.cp > 1
    short = search(llama(2048), A100, 8)
    assert short.chosen.layout.cp == 1
    # Not pruned away: cp layouts were costed, fit, and lost on time.
    assert any(c.fits and c.layout.cp > 1 for c in short.candidates)


def test_cp_is_searched_only_where_the_sequence_and_the_model_allow_it():
    w = llama(4096)
    assert degree_problem(w, A100, lay(cp=8), SearchOptions()) is None
    assert "2·cp = 16" in degree_problem(llama(4104), A100, lay(cp=8), SearchOptions())  # 4104 = 8·513: not by 16
    plan = search(llama(4104, batch=1), A100, 8)
    assert {c.layout.cp for c in plan.candidates} == {1, 2, 4}  # 2·cp divides 4104 for cp = 1, 2, 4 only
    dropout = Workload(gpt_shape({"n_layer": 2, "n_embd": 256, "n_head": 8, "dropout": 0.1}, 1000, 1024), 1024, 8, PRECISIONS["amp"])
    assert "attention dropout" in degree_problem(dropout, A100, lay(cp=2), SearchOptions())
    assert {c.layout.cp for c in search(dropout, A100, 8).candidates} == {1}
    moe = Workload(gpt_shape({"n_layer": 2, "n_embd": 256, "n_head": 8}, 1000, 1024, moe=True), 1024, 8, PRECISIONS["amp"])
    assert "context_parallel_plan" in degree_problem(moe, A100, lay(cp=2), SearchOptions())
    no_loop = Workload(hf_shape({**LLAMA, "model_type": "mistral"}), 4096, 8, PRECISIONS["amp"])
    assert "decoder loop" in degree_problem(no_loop, A100, lay(cp=2), SearchOptions())
    # Sequence parallelism splits each rank's s/cp tokens over tp.
    assert "data.seq_len / cp" in degree_problem(llama(48), A100, lay(cp=8, tp=4, sequence_parallel=True), SearchOptions())


def test_ulysses_is_searched_only_where_the_heads_divide():
    w = llama(8192, batch=1)
    assert degree_problem(w, A100, lay(cp=8, cp_mode="ulysses"), SearchOptions()) is None  # 16 heads, 4 kv heads divide 8
    assert "attention heads" in degree_problem(w, A100, lay(cp=8, tp=4, cp_mode="ulysses"), SearchOptions())  # 4 heads per tp rank
    assert "key/value heads" in degree_problem(gqa(heads=12, kv=3), A100, lay(cp=4, cp_mode="ulysses"), SearchOptions())
    modes = {(c.layout.cp, c.layout.tp, c.layout.cp_mode) for c in search(w, A100, 8).candidates if c.layout.cp > 1}
    assert {(8, 1, "ulysses"), (8, 1, "ring"), (2, 4, "ulysses")} <= modes  # 1 kv head per tp rank is repeated up to cp
    twelve = {(c.layout.cp, c.layout.tp, c.layout.cp_mode) for c in search(gqa(heads=12, kv=4), A100, 8).candidates}
    assert {(8, 1, "ring"), (4, 2, "ring")} <= twelve  # 12 heads (6 per tp rank) do not divide by 8 or 4: ring only
    assert not {(8, 1, "ulysses"), (4, 2, "ulysses")} & twelve
    fixed = search(w, A100, 8, SearchOptions(cp_mode="ring"))
    assert {c.layout.cp_mode for c in fixed.candidates} == {"ring"}


def gqa(heads: int, kv: int) -> Workload:
    return Workload(hf_shape({**LLAMA, "num_attention_heads": heads, "num_key_value_heads": kv, "hidden_size": 64 * heads}),
                    8192, 1, PRECISIONS["amp"])


# ------------------------------------------------------------------------------------ memory
@pytest.mark.parametrize("cp", [2, 4, 16])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_activations_and_logits_are_divided_by_cp(cp, recompute):
    w = llama(16384, recompute=recompute)
    assert layer_activation_bytes(w, 1, 2, cp=cp) == pytest.approx(layer_activation_bytes(w, 1, 2) / cp, rel=1e-12)
    assert logits_bytes(w, 1, 2, cp) == pytest.approx(logits_bytes(w, 1, 2) / cp, rel=1e-12)
    one, split = lay(tp=2), lay(cp=cp, tp=2)
    mem_one = rank_memory(w, one, pipeline_stages(one, w.shape.layers, [0]), 0)
    mem_cp = rank_memory(w, split, pipeline_stages(split, w.shape.layers, [0]), 0)
    assert mem_cp.activations == pytest.approx(mem_one.activations / cp, rel=1e-12)
    assert mem_cp.logits == pytest.approx(mem_one.logits / cp, rel=1e-12)
    assert mem_cp.state == pytest.approx(mem_one.state, rel=1e-12)  # no sharding: every cp rank holds the whole state


def test_dense_attention_scores_follow_the_mode():
    """Ring attention keeps no score matrix (blocks recomputed from the log-sum-exp); Ulysses keeps heads/cp heads' rows."""
    w = llama(4096, attention="dense")
    a, s, e, cp = LLAMA["num_attention_heads"], 4096, 2, 4
    flash = llama(4096)
    assert layer_activation_bytes(w, 1, 1, cp=cp, cp_mode="ulysses") == pytest.approx(layer_activation_bytes(w, 1, 1) / cp)
    assert layer_activation_bytes(w, 1, 1, cp=cp, cp_mode="ring") == pytest.approx(layer_activation_bytes(flash, 1, 1) / cp)
    assert layer_activation_bytes(w, 1, 1) - layer_activation_bytes(flash, 1, 1) == pytest.approx(e * a * s * s - 4 * a * s)


def test_fsdp_shards_the_state_over_sharding_times_cp():
    w = llama(4096)
    plain, with_cp = lay(sharding=2, zero_stage=3), lay(sharding=2, cp=4, zero_stage=3)
    m2 = rank_memory(w, plain, pipeline_stages(plain, w.shape.layers, [0]), 0)
    m8 = rank_memory(w, with_cp, pipeline_stages(with_cp, w.shape.layers, [0]), 0)
    assert m8.optimizer == pytest.approx(m2.optimizer / 4, rel=1e-12) and m8.params == pytest.approx(m2.params / 4, rel=1e-12)


# ------------------------------------------------------------------------------------ time and bytes
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_ring_bytes_are_the_runtimes_ring_payload(cp):
    """Per layer and micro-batch, (3·cp − 2) hops of k and v (the gradients' in fp32): ring_payload_bytes of this rank's
    real key tensor."""
    w, tp, b = llama(8192, batch=8 // cp), 1, 1
    layout = lay(cp=cp, tp=tp, dp=8 // cp, micro_batch=b, accumulate=1)
    c = evaluate(w, A100, layout)
    k_local = torch.empty(b, LLAMA["num_key_value_heads"] // tp, 8192 // cp, 1024 // 16, dtype=torch.bfloat16)
    k_bytes = k_local.numel() * k_local.element_size()  # the gradients travel in fp32: twice a bf16 key's bytes
    expected = LLAMA["num_hidden_layers"] * ring_payload_bytes(k_bytes, cp, grad_kv_bytes=k_local.float().numel() * 4)
    assert c.comm_bytes[CP] == pytest.approx(expected, rel=1e-12)
    assert c.time.comm[CP] > 0  # the last gradient hop home has nothing to hide behind


def test_ring_hops_hide_behind_block_compute_and_ulysses_pays_its_all_to_alls_in_line():
    w, cp = llama(65536, batch=1), 8
    model = CostModel(w, A100)
    ring = model.layer(1, 1, 1, False, False, False, False, cp, "ring", False)
    k = 2 * 65536 / cp * 4 * 64  # bf16 keys of this rank: s/cp tokens × 4 key/value heads × 64
    hop = A100.collective_time("p2p", 2 * k, 2, False)
    gradient_hop = A100.collective_time("p2p", 2 * 2 * k, 2, False)  # the gradients travel in fp32: twice the bytes
    assert ring.comm_cp == pytest.approx(gradient_hop, rel=1e-9)  # every hop hidden but the last gradient hop home
    slow = CostModel(w, A100.with_overrides(inter_node=Link(1e8, 1e-5)))  # hops slower than a ring step's blocks
    assert slow.layer(1, 1, 1, False, False, False, False, cp, "ring", True).comm_cp > 10 * hop
    uly = model.layer(1, 1, 1, False, False, False, False, cp, "ulysses", False)
    q = 2 * 65536 / cp * 16 * 64
    kv = k * 2  # 4 key/value heads repeated up to cp = 8
    assert uly.cp_bytes == pytest.approx(2 * (2 * q + 2 * kv) * (cp - 1) / cp)  # 4 all-to-alls forward, 4 backward
    per_pass = sum(A100.collective_time("all_to_all", x, cp, False) for x in (q, kv, kv, q))
    assert uly.comm_cp == pytest.approx(2 * per_pass)


def test_cp_ranks_join_the_gradient_all_reduce():
    """Without sharding the gradients are all-reduced over dp × cp: a cp-only layout still reduces, over cp ranks."""
    w = llama(8192, batch=8)
    c = evaluate(w, A100, lay(cp=8, micro_batch=8, accumulate=1))
    grads = c.memory_by_pp_rank[0]["grads"]
    assert c.comm_bytes[DP] == pytest.approx(2 * grads * 7 / 8, rel=1e-9)
    nodes = ParallelDims(64, dp=4, cp=2, tp=8)
    assert group_crosses_nodes(nodes, (DP, "sharding", CP), 8)  # dp × cp = 8 groups of stride 8: across nodes
    assert not group_crosses_nodes(ParallelDims(8, dp=2, cp=2, tp=2), (DP, "sharding", CP), 8)


def test_the_chosen_layout_reaches_hybrid4d_with_its_cp():
    from parallelkit.tools.plan import chosen_as_hybrid4d

    layout = lay(dp=2, cp=4, cp_mode="ulysses")
    overrides = chosen_as_hybrid4d(["model=hf"], layout)
    assert "strategy.cp=4" in overrides and "strategy.cp_mode=ulysses" in overrides and "strategy=hybrid4d" in overrides
    assert layout.as_dict()["cp"] == 4 and layout.as_dict()["cp_mode"] == "ulysses"


def test_the_dry_run_counts_the_ring_and_the_gradient_all_reduce_over_dp_times_cp():
    """Fake backend, 4 ranks: cp groups partition the ranks, each sends ring_payload_bytes per layer of its real keys,
    and the gradient all-reduce spans dp × cp = 4 ranks, as dp = 4 alone."""
    from parallelkit.planner.dry_run import build_plan

    tiny = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "data.seq_len=16", "data.global_batch_size=16",
            "strategy=hybrid4d", "strategy.tp=1", "strategy.pp=1", "trainer.devices=4"]
    with_cp, plain = build_plan([*tiny, "strategy.cp=2"]), build_plan([*tiny, "strategy.dp=4"])
    assert sorted(sorted(g) for g in {tuple(r.groups[CP]) for r in with_cp.ranks}) == [[0, 1], [2, 3]]
    k_local = torch.empty(16 // 2, 2, 16 // 2, 32 // 2, dtype=torch.float32)  # rank batch, heads, s/cp, head dim
    for r, p in zip(with_cp.ranks, plain.ranks):
        assert r.comm_bytes[CP] == 2 * ring_payload_bytes(k_local.numel() * k_local.element_size(), 2)
        assert r.comm_bytes[DP] == p.comm_bytes[DP] > 0 and p.comm_bytes[CP] == 0


def test_strategy_auto_trains_hybrid4d_at_the_chosen_cp_and_mode(monkeypatch):
    """What the search chose (here: cp 2 with all-to-all attention) is what hybrid4d is built with; strategy.cp is refused."""
    from hydra.utils import instantiate

    from parallelkit.planner.auto import workload_of
    from parallelkit.planner.inputs import compose_config
    from parallelkit.planner.search import AutoPlan
    from parallelkit.strategies.auto import AutoStrategy

    cfg = compose_config(["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.dropout=0", "data.seq_len=16",
                          "data.global_batch_size=16", "strategy=auto"])
    w = workload_of(cfg)
    chosen = evaluate(w, A100, lay(cp=2, cp_mode="ulysses", micro_batch=16))
    monkeypatch.setattr("parallelkit.strategies.auto.choose_layout", lambda *args, **kwargs: AutoPlan(2, A100, w, [chosen]))
    auto = instantiate(cfg.strategy)
    strategy = auto.resolve(cfg, 2, 1)
    assert strategy.plan(2).as_dict() == {"dp": 1, "sharding": 1, "cp": 2, "tp": 1, "pp": 1, "ep": 1}
    assert strategy.options.cp_mode == "ulysses" and auto.auto_plan.as_dict()["cp_mode"] == "ulysses"
    with pytest.raises(ConfigError, match="chooses strategy.cp itself"):
        AutoStrategy(cp=2)
