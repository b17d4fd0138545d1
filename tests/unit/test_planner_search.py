"""The search's candidates: one ParallelDims per layout, what it refuses (physics, the model) and what it no longer
refuses (sequence parallel with pp or sharding, mixed-precision pipelines, tied embeddings under pp or tp), and the
cost terms those combinations bring (no torch, no model built)."""

from __future__ import annotations

import dataclasses

import pytest

from parallelkit.distributed.parallel_dims import PP, TP, ParallelDims
from parallelkit.errors import ConfigError
from parallelkit.planner.hardware import load_profile
from parallelkit.planner.layout import Layout
from parallelkit.planner.search import SearchOptions, degree_problem, evaluate, search
from parallelkit.planner.shapes import gpt_shape, hf_shape
from parallelkit.planner.workload import PRECISIONS, Workload

A100 = load_profile("a100_80gb_8x")
GPT = {"n_layer": 8, "n_embd": 1024, "n_head": 16, "dropout": 0.1}
# A tied Llama (transformers' tie_word_embeddings=true): a TP plan, a rebuilt decoder loop, one embedding matrix.
TIED_LLAMA = {"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
              "num_key_value_heads": 8, "intermediate_size": 2816, "vocab_size": 32000, "tie_word_embeddings": True}


def lay(dp: int = 1, sharding: int = 1, tp: int = 1, pp: int = 1, ep: int = 1, **options) -> Layout:
    return Layout(ParallelDims(dp * sharding * tp * pp, dp=dp, sharding=sharding, tp=tp, pp=pp, ep=ep), **options)


def workload(shape=None, precision="amp", **kw) -> Workload:
    return Workload(shape or gpt_shape(GPT, 51200, 1024), 1024, 64, PRECISIONS[precision], **kw)


# ------------------------------------------------------------------------------------ one carrier of degrees
def test_layout_carries_its_degrees_in_one_parallel_dims():
    dims = ParallelDims(16, dp=2, sharding=2, tp=2, pp=2)
    layout = Layout(dims, micro_batch=2, microbatches=4, sequence_parallel=True)
    names = {f.name for f in dataclasses.fields(Layout)}
    assert not names & {"dp", "sharding", "tp", "pp", "ep", "mesh_order"}  # no second copy of any degree
    assert layout.dims is dims and (layout.dp, layout.sharding, layout.tp, layout.pp, layout.ep) == (2, 2, 2, 2, 1)
    assert layout.degrees == dims.degrees and layout.world == 16 and layout.mesh_order == dims.mesh_order
    assert layout.as_dict()["sequence_parallel"] is True and layout.as_dict()["tp"] == 2
    with pytest.raises(ConfigError, match="must divide"):  # ParallelDims validates, not the layout
        lay(dp=3, ep=2)
    with pytest.raises(ValueError, match="needs tp > 1"):
        lay(dp=2, sequence_parallel=True)
    with pytest.raises(TypeError):
        Layout({"dp": 2})  # a dict of degrees is not a layout
    if hasattr(ParallelDims, "request"):  # a strategy's unresolved degrees are not a layout either
        with pytest.raises(ValueError, match="resolved"):
            Layout(ParallelDims.request(dp=-1, tp=2))


# ------------------------------------------------------------------------------------ what is refused
@pytest.mark.parametrize("layout", [
    lay(dp=2, tp=2, pp=2, microbatches=4, sequence_parallel=True),  # sequence parallel under a pipeline
    lay(sharding=4, tp=2, sequence_parallel=True, zero_stage=3),  # sequence parallel with FSDP2
    lay(dp=4, pp=2, microbatches=4),  # a pipeline under bf16-mixed
    lay(sharding=2, tp=2, pp=2, microbatches=4, sequence_parallel=True, zero_stage=3),  # all of them at once
])
def test_compositions_hybrid4d_now_runs_are_not_refused(layout):
    assert degree_problem(workload(), A100, layout, SearchOptions()) is None
    assert degree_problem(workload(precision="bf16"), A100, layout, SearchOptions()) is None


@pytest.mark.parametrize("layout", [lay(dp=4, pp=2, microbatches=4), lay(dp=4, tp=2), lay(dp=2, tp=2, pp=2, microbatches=4)])
def test_tied_embeddings_are_not_refused_under_pp_or_tp(layout):
    shape = hf_shape(TIED_LLAMA)
    assert shape.tied and shape.tp_plan is None and shape.pp_refusal is None
    assert degree_problem(workload(shape), A100, layout, SearchOptions()) is None


@pytest.mark.parametrize("layout,words", [
    (lay(dp=2, tp=32), "model.n_head=16"),  # tp must divide the heads
    (lay(dp=4, tp=3, pp=1), "does not divide"),
    (lay(dp=2, pp=16, microbatches=16), "only 8 blocks"),  # pp > layers
    (lay(dp=3, tp=2), "cannot be split evenly"),  # global batch 64 over 3 ranks
    (lay(dp=2, tp=8, sequence_parallel=True), None),  # 1024 tokens split 8 ways: fine
])
def test_physical_limits_stay_refused(layout, words):
    problem = degree_problem(workload(), A100, layout, SearchOptions(allow_tp_across_nodes=True))
    assert (problem is None) if words is None else (words in problem)


def test_sequence_parallel_needs_the_sequence_to_split_and_the_model_to_allow_it():
    w = workload().with_(seq_len=1000)
    assert "data.seq_len (block_size)=1000" in degree_problem(w, A100, lay(dp=2, tp=16, sequence_parallel=True), SearchOptions(allow_tp_across_nodes=True))
    moe = workload(gpt_shape({**GPT, "num_experts": 4}, 51200, 1024, moe=True))
    assert "routes the whole residual stream" in degree_problem(moe, A100, lay(dp=4, tp=2, sequence_parallel=True), SearchOptions())
    bloom = hf_shape({"model_type": "bloom", "hidden_size": 1024, "n_layer": 8, "n_head": 16, "vocab_size": 32000})
    assert "base_model_tp_plan" in degree_problem(workload(bloom), A100, lay(dp=4, tp=2), SearchOptions())
    assert "decoder loop" in degree_problem(workload(bloom), A100, lay(dp=4, pp=2, microbatches=4), SearchOptions())


def test_the_search_tries_sequence_parallel_both_ways_unless_it_is_fixed():
    w = workload()
    free = search(w, A100, 8, SearchOptions())
    costed = [c for c in free.candidates if c.invalid is None]
    assert {c.layout.sequence_parallel for c in costed if c.layout.tp > 1} == {False, True}
    assert not any(c.layout.sequence_parallel for c in costed if c.layout.tp == 1)
    assert any(c.layout.pp > 1 for c in costed)  # pipelines under bf16-mixed are costed
    off = search(w, A100, 8, SearchOptions(sequence_parallel=False))
    on = search(w, A100, 8, SearchOptions(sequence_parallel=True))
    assert not any(c.layout.sequence_parallel for c in off.candidates)
    assert all(c.layout.sequence_parallel == (c.layout.tp > 1) for c in on.candidates)
    assert free.as_dict()["sequence_parallel"] == free.chosen.layout.sequence_parallel


# ------------------------------------------------------------------------------------ their cost terms
def test_sequence_parallel_shards_the_stage_hand_off_and_the_replicated_activations():
    w = workload()
    plain = evaluate(w, A100, lay(dp=2, tp=4, pp=2, micro_batch=4, microbatches=8))
    sp = evaluate(w, A100, lay(dp=2, tp=4, pp=2, micro_batch=4, microbatches=8, sequence_parallel=True))
    sends = 8 * 2 * 4 * 1024 * 1024  # per micro-batch one b·s·h bf16 send (rank 0: forward out, backward in)
    assert plain.time.comm_bytes_by_rank[0][PP] == pytest.approx(sends)
    assert sp.time.comm_bytes_by_rank[0][PP] == pytest.approx(sends / 4)
    assert sp.memory["activations"] < plain.memory["activations"]
    assert sp.time.compute < plain.time.compute  # norms, residuals, dropout on a quarter of the sequence
    # Tensor-parallel traffic: the same bytes (reduce-scatter + all-gather), plus one sum of the norms' partial grads.
    replicated = 4 * gpt_shape(GPT, 51200, 1024).dense_layer_replicated * 4  # 4 layers on rank 0, fp32 grads
    assert sp.time.comm_bytes_by_rank[0][TP] - plain.time.comm_bytes_by_rank[0][TP] == pytest.approx(2 * replicated * 3 / 4)


def test_mixed_precision_pipelines_hand_off_16_bit_activations():
    layout = lay(dp=4, pp=2, micro_batch=4, microbatches=4)
    amp, fp32 = evaluate(workload(), A100, layout), evaluate(workload(precision="fp32"), A100, layout)
    assert fp32.time.comm_bytes[PP] == pytest.approx(2 * amp.time.comm_bytes[PP])
    assert fp32.memory_by_pp_rank[0]["activations"] > amp.memory_by_pp_rank[0]["activations"]


def test_tied_embeddings_under_a_pipeline_sum_their_gradient_between_the_first_and_last_stage():
    tied = hf_shape(TIED_LLAMA)
    untied = dataclasses.replace(tied, tied=False)  # the same shape, the copy on the last stage not synced
    layout = lay(dp=2, tp=2, pp=2, micro_batch=4, microbatches=8)
    a, b = evaluate(workload(tied), A100, layout), evaluate(workload(untied), A100, layout)
    embedding = tied.embed_params / 2 * PRECISIONS["amp"].grad  # vocabulary-split by tp
    for rank in (0, 1):  # the first and the last stage
        assert a.time.comm_bytes_by_rank[rank][PP] - b.time.comm_bytes_by_rank[rank][PP] == pytest.approx(embedding)
    assert a.time.comm[PP] > b.time.comm[PP] and a.total_time > b.total_time
    # Under tp alone one vocabulary-split weight serves both ends on the same rank: nothing extra.
    flat = lay(dp=4, tp=2, micro_batch=8)
    assert evaluate(workload(tied), A100, flat).time.comm == evaluate(workload(untied), A100, flat).time.comm


def test_dry_run_counts_sequence_shards_and_the_shared_embedding_between_stages():
    torch = pytest.importorskip("torch")

    from parallelkit.planner.dry_run import rank_comm_bytes, shared_stage_bytes

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(100, 8)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
            self.head = torch.nn.Linear(8, 100, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    options = {"stage_ids": {0: [0], 1: [1]}, "num_stages": 2, "tp_split": {"embed.weight": 2},
               "stage_names": {0: {"embed.weight", "blocks.0.weight", "blocks.0.bias"}, 1: {"embed.weight", "blocks.1.weight", "blocks.1.bias"}}}
    assert shared_stage_bytes(model, options) == {0: 100 * 8 * 4 / 2, 1: 100 * 8 * 4 / 2}
    dims = ParallelDims(4, tp=2, pp=2)
    options.update(zero_stage=0, model_cfg={"seq_len": 16, "n_embd": 8}, rank_batch=2, layers_per_pp_rank={0: 1, 1: 1},
                   moe_layers_per_pp_rank={0: 0, 1: 0}, shared_stage_bytes={})
    coords = dims.coordinates(0)
    whole = rank_comm_bytes(dims, coords, 0, {**options, "sequence_parallel": False})[PP]
    assert whole == 2 * 16 * 8 * 4  # one send of b·s·h fp32
    assert rank_comm_bytes(dims, coords, 0, {**options, "sequence_parallel": True})[PP] == whole / 2
    assert rank_comm_bytes(dims, coords, 0, {**options, "shared_stage_bytes": {0: 1600.0}})[PP] == whole + 1600
