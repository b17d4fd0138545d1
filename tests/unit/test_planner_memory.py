"""The planner's memory terms against the published formulas they implement (no torch, no model built)."""

from __future__ import annotations

import pytest

from parallelkit.distributed.parallel_dims import ParallelDims
from parallelkit.planner.layout import Layout, interleaved_peak, pipeline_stages, representative_ranks, stage_layers
from parallelkit.planner.memory import korthikanti_per_layer, layer_activation_bytes, rank_memory
from parallelkit.planner.shapes import gpt_shape
from parallelkit.planner.workload import PRECISIONS, Runtime, Workload


def lay(dp: int = 1, sharding: int = 1, tp: int = 1, pp: int = 1, **options) -> Layout:
    """A layout of these degrees (their product the world size) and options."""
    return Layout(ParallelDims(dp * sharding * tp * pp, dp=dp, sharding=sharding, tp=tp, pp=pp), **options)

# GPT-3 175B's layer (Korthikanti et al. 2022, Table 3): s = 2048, h = 12288, a = 96.
GPT3 = {"n_layer": 96, "n_embd": 12288, "n_head": 96, "bias": True, "dropout": 0.1}


def workload(model=GPT3, precision="mixed", recompute="none", attention="dense", seq=2048, batch=64) -> Workload:
    shape = gpt_shape(model, 51200, seq)
    return Workload(shape, seq, batch, PRECISIONS[precision], recompute=recompute, attention=attention)


@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("sp", [False, True])
def test_activation_count_reproduces_korthikanti_et_al(tp, sp):
    """16-bit activations, dropout, dense attention: the component count is their closed form, exactly."""
    w = workload()
    for b in (1, 4):
        assert layer_activation_bytes(w, b, tp, sequence_parallel=sp) == pytest.approx(korthikanti_per_layer(2048, b, 12288, 96, tp, sp), rel=1e-12)


def test_selective_recompute_drops_exactly_the_attention_scores():
    full, selective = workload(), workload(recompute="selective")
    s, b, a, t = 2048, 1, 96, 8
    assert layer_activation_bytes(full, b, t) - layer_activation_bytes(selective, b, t) == pytest.approx(5 * a * s * s * b / t)


def test_flash_attention_keeps_no_score_matrix_and_no_dropout_means_no_masks():
    shape_cfg = {**GPT3, "dropout": 0.0}
    dense, flash = workload(shape_cfg), workload(shape_cfg, attention="flash")
    s, h, a, t = 2048, 12288, 96, 8
    # dense: softmax output 2·a·s²/t; flash: its output O (2·s·h/t) and fp32 log-sum-exp (4·a·s/t) instead
    assert layer_activation_bytes(dense, 1, t) - layer_activation_bytes(flash, 1, t) == pytest.approx(2 * a * s * s / t - 4 * a * s / t)
    assert layer_activation_bytes(dense, 1, t) == pytest.approx(korthikanti_per_layer(s, 1, h, a, t) - 2 * s * h - 3 * a * s * s / t)


def test_fp32_activations_double_the_16_bit_tensors():
    cfg = {**GPT3, "dropout": 0.0}
    assert layer_activation_bytes(workload(cfg, precision="fp32"), 1, 8) == pytest.approx(2 * layer_activation_bytes(workload(cfg), 1, 8))


def test_in_flight_micro_batches_per_schedule():
    """1F1B: min(m, p − r) (Narayanan et al. §2.2.1); GPipe: m; interleaved on rank 0: L·(1 + (p − 1)/(p·v))
    layer-micro-batches (Korthikanti et al. §4.2.3) once m is large enough."""
    L, p, m = 96, 8, 64
    one = pipeline_stages(lay(1, 1, 1, p, microbatches=m, schedule="1f1b"), L)
    assert [one.in_flight_layers[r] for r in range(p)] == [min(m, p - r) * L // p for r in range(p)]
    gpipe = pipeline_stages(lay(1, 1, 1, p, microbatches=m, schedule="gpipe"), L)
    assert gpipe.in_flight_layers[3] == m * L // p
    for v in (2, 3, 4):
        inter = pipeline_stages(lay(1, 1, 1, p, microbatches=m, schedule="interleaved_1f1b", virtual_stages=v), L)
        assert inter.in_flight_layers[0] == pytest.approx(L * (1 + (p - 1) / (p * v)))


def test_full_recompute_keeps_inputs_of_every_in_flight_micro_batch_and_one_working_set():
    w = workload(recompute="full")
    none = workload()
    layout = lay(1, 1, 8, 8, microbatches=64, micro_batch=1, schedule="1f1b")
    stages = pipeline_stages(layout, 96, [3])
    kept = rank_memory(w, layout, stages, 0).activations
    inputs = stages.in_flight_layers[0] * 2 * 2048 * 12288  # 2sbh per layer and micro-batch in flight
    outputs = stages.in_flight_outputs[0] * 2 * 2048 * 12288  # the stage's output per micro-batch in flight (kept)
    assert stages.in_flight_outputs[0] == 8 - 3
    assert kept == pytest.approx(inputs + outputs + layer_activation_bytes(none, 1, 8))
    assert kept < rank_memory(none, layout, stages, 0).activations / 5  # not one working set per micro-batch


@pytest.mark.parametrize("precision,per_param", [("fp32", (4, 4, 0, 8)), ("mixed", (2, 2, 4, 8)), ("mixed_fp32_grads", (2, 4, 4, 8))])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_follows_the_zero_paper(precision, per_param, stage):
    """Rajbhandari et al. 2020, §5: stage 1 shards optimizer state (and master weights), 2 also gradients, 3 also
    weights — for fp32 Adam 16Ψ → 8Ψ+8Ψ/N → 4Ψ+12Ψ/N → 16Ψ/N; for mixed precision 4Ψ + 12Ψ/N at stage 1 (K = 12)."""
    cfg = {"n_layer": 4, "n_embd": 64, "n_head": 4}
    shape = gpt_shape(cfg, 128, 32)
    w = Workload(shape, 32, 8, PRECISIONS[precision])
    n = 4
    layout = lay(1, n, 1, 1, zero_stage=stage, micro_batch=2)
    mem = rank_memory(w, layout, pipeline_stages(layout, 4), 0)
    psi = shape.num_params
    p, g, master, opt = per_param
    shards = {k: (n if stage >= need else 1) for k, need in (("p", 3), ("g", 2), ("o", 1))}
    expected = psi * (p / shards["p"] + g / shards["g"] + (master + opt) / shards["o"])
    assert mem.state == pytest.approx(expected)


def test_tied_embeddings_put_a_copy_on_the_last_stage():
    from parallelkit.planner.shapes import hf_shape

    tied = hf_shape({"model_type": "bloom", "hidden_size": 64, "n_layer": 4, "n_head": 4, "vocab_size": 1000})
    w = Workload(tied, 32, 8, PRECISIONS["fp32"])
    layout = lay(1, 1, 1, 2, microbatches=4, micro_batch=2)
    stages = pipeline_stages(layout, 4)
    first, last = rank_memory(w, layout, stages, 0), rank_memory(w, layout, stages, 1)
    assert tied.head_params == 0
    assert first.param_elements - 2 * tied.dense_layer - tied.first_extra == tied.embed_params
    assert last.param_elements - 2 * tied.dense_layer - tied.last_extra == tied.embed_params


def test_stage_outputs_are_kept_per_chunk_in_flight_unless_deallocated():
    """torch.distributed.pipelining keeps each chunk's output until its backward; Megatron's deallocate_pipeline_outputs
    (and Llama 3, §3.3.2) frees it once sent. Sequence parallelism keeps 1/t of it; the last stage sends none."""
    stages = pipeline_stages(lay(1, 1, 8, 4, microbatches=8, schedule="1f1b"), 96)
    for sp in (False, True):
        layout = lay(1, 1, 8, 4, microbatches=8, schedule="1f1b", sequence_parallel=sp)
        kept, freed = workload(), workload().with_(runtime=Runtime(deallocate_stage_outputs=True))
        for r in range(4):
            extra = rank_memory(kept, layout, stages, r).activations - rank_memory(freed, layout, stages, r).activations
            assert extra == pytest.approx((min(8, 4 - r) if r < 3 else 0) * 2 * 2048 * 12288 / (8 if sp else 1))


def test_embedding_and_loss_take_a_layer_each_in_the_split():
    """Llama 3 405B (§3.3.2): 126 blocks + embedding + loss = 16 ranks × 8 one-block chunks; the first chunk holds only
    the embedding, the last only the loss, so the first and last rank hold 7 blocks, the others 8."""
    blocks = stage_layers(126, 128, embedding_and_loss=True)
    assert len(blocks[0]) == len(blocks[127]) == 0 and all(len(b) == 1 for b in blocks[1:127])
    assert [len(b) for b in stage_layers(126, 16, True)] == [7] + [8] * 14 + [7]
    assert sorted(layer for b in stage_layers(10, 4, True) for layer in b) == list(range(10))
    layout = lay(1, 1, 8, 16, microbatches=32, schedule="interleaved_1f1b", virtual_stages=8, embedding_and_loss_as_layers=True)
    stages = pipeline_stages(layout, 126)
    assert [len(x) for x in stages.layers] == [7] + [8] * 14 + [7]
    # Rank 0's embedding-only chunk keeps nothing of a block: fewer blocks in flight than rank 1, which now bounds memory.
    assert stages.in_flight_layers[1] == (8 - 1) * 16 + 2 * 14 + 1
    assert stages.in_flight_layers[0] < stages.in_flight_layers[1]
    assert representative_ranks(16, True) == ([0, 1, 8, 15], [1, 1, 13, 1])


@pytest.mark.parametrize("weights", [[0, 1, 1, 1], [2, 1, 1], [1, 1, 0], [3, 3]])
def test_interleaved_peak_follows_the_schedule(weights):
    """The peak of the blocks in flight, against a step-by-step run of Megatron's interleaved order (N = p)."""
    for p, m, r in ((4, 8, 0), (4, 12, 1), (8, 16, 7)):
        v, total = len(weights), m * len(weights)
        warmup = min(total, (v - 1) * p + 2 * (p - 1 - r))
        fwd = [weights[(k // p) % v] for k in range(total)]
        kept = peak = sum(fwd[:warmup])
        for j in range(total):
            kept += fwd[warmup + j] if warmup + j < total else 0
            peak = max(peak, kept)
            kept -= weights[v - 1 - (j // p) % v]
        assert interleaved_peak([float(x) for x in weights], m, p, warmup) == peak
