"""The planner's memory terms against the published formulas they implement (no torch, no model built)."""

from __future__ import annotations

import pytest

from parallelkit.planner.layout import Layout, pipeline_stages
from parallelkit.planner.memory import korthikanti_per_layer, layer_activation_bytes, rank_memory
from parallelkit.planner.shapes import gpt_shape
from parallelkit.planner.workload import PRECISIONS, Workload

# GPT-3 175B's layer (Korthikanti et al. 2022, Table 3): s = 2048, h = 12288, a = 96.
GPT3 = {"n_layer": 96, "n_embd": 12288, "n_head": 96, "bias": True, "dropout": 0.1}


def workload(model=GPT3, precision="mixed", recompute="none", attention="dense", sp=False, seq=2048, batch=64) -> Workload:
    shape = gpt_shape(model, 51200, seq)
    return Workload(shape, seq, batch, PRECISIONS[precision], recompute=recompute, attention=attention, sequence_parallel=sp)


@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("sp", [False, True])
def test_activation_count_reproduces_korthikanti_et_al(tp, sp):
    """16-bit activations, dropout, dense attention: the component count is their closed form, exactly."""
    w = workload(sp=sp)
    for b in (1, 4):
        assert layer_activation_bytes(w, b, tp) == pytest.approx(korthikanti_per_layer(2048, b, 12288, 96, tp, sp), rel=1e-12)


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
    one = pipeline_stages(Layout(1, 1, 1, p, microbatches=m, schedule="1f1b"), L)
    assert [one.in_flight_layers[r] for r in range(p)] == [min(m, p - r) * L // p for r in range(p)]
    gpipe = pipeline_stages(Layout(1, 1, 1, p, microbatches=m, schedule="gpipe"), L)
    assert gpipe.in_flight_layers[3] == m * L // p
    for v in (2, 3, 4):
        inter = pipeline_stages(Layout(1, 1, 1, p, microbatches=m, schedule="interleaved_1f1b", virtual_stages=v), L)
        assert inter.in_flight_layers[0] == pytest.approx(L * (1 + (p - 1) / (p * v)))


def test_full_recompute_keeps_inputs_of_every_in_flight_micro_batch_and_one_working_set():
    w = workload(recompute="full")
    none = workload()
    layout = Layout(1, 1, 8, 8, microbatches=64, micro_batch=1, schedule="1f1b")
    stages = pipeline_stages(layout, 96, [3])
    kept = rank_memory(w, layout, stages, 0).activations
    inputs = stages.in_flight_layers[0] * 2 * 2048 * 12288  # 2sbh per layer and micro-batch in flight
    assert kept == pytest.approx(inputs + layer_activation_bytes(none, 1, 8))
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
    layout = Layout(1, n, 1, 1, zero_stage=stage, micro_batch=2)
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
    layout = Layout(1, 1, 1, 2, microbatches=4, micro_batch=2)
    stages = pipeline_stages(layout, 4)
    first, last = rank_memory(w, layout, stages, 0), rank_memory(w, layout, stages, 1)
    assert tied.head_params == 0
    assert first.param_elements - 2 * tied.dense_layer - tied.first_extra == tied.embed_params
    assert last.param_elements - 2 * tied.dense_layer - tied.last_extra == tied.embed_params
