"""The planner against published large-scale runs (parallelkit/planner/published/runs.yaml, docs/planner.md).

Each documented run's published layout, costed on its hardware profile with the run's precision, recomputation
and overlap, must be judged to fit and its predicted throughput per device must be within 25 % of the published
figure. 25 %: the issue's bar — the sources themselves report end-to-end throughput that varies by more than 5 %
between neighbouring configurations (Narayanan et al. 2021, Table 1: 135–148 TFLOP/s for 18B–145B on the same
machine), and the profiles carry vendor figures and third-party micro-benchmarks, not these clusters' own.
"""

from __future__ import annotations

import pytest

from parallelkit.planner.memory import layer_activation_bytes
from parallelkit.planner.validation import parallelkit_can_run, runs, validate

RUNS = runs()
# Documented misses: the planner judges the published layout not to fit (see docs/planner.md for the numbers).
KNOWN_MISSES = {
    "llama3_405b_8k_gpus": "with Llama 3's published pipeline measures modelled (embedding and loss as one layer each in the split, "
                           "V = 8, N = PP, asynchronous p2p, stage outputs freed) the planner needs 88.7 GiB on pipeline rank 1 "
                           "(141 one-block chunks of 0.50 GiB in flight, 17.8 GiB of gathered bf16 weights and fp32 gradients) "
                           "and predicts 1.41x the published throughput (plain 1F1B: 78.2 GiB, 1.02x)",
    "llama3_405b_128k_cp16": "the same pipeline measures at CP 16 (each rank's 8,192 tokens of a 131,072-token sequence): pipeline "
                             "rank 1 needs 81.8 GiB (all 128 one-block chunk-micro-batches of 0.50 GiB in flight with m = 16 = PP) "
                             "and the prediction is 1.31x the published 380 TFLOPs/GPU",
    "torchtitan_llama2_70b_selective_op": "local batch 1: predicted 469.2 tokens/s per GPU, published 355 (1.32x): an 8.73 s step "
                                          "against the measured 11.54 s. The 2.81 s gap is about the time of the step's FSDP "
                                          "traffic (542 GB per rank, 3.20 s at 169.6 GB/s), which the planner hides behind 8.4 s "
                                          "of compute; the same layout at batch 2 (full AC) is predicted within 16 %",
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=KNOWN_MISSES[n])) if n in KNOWN_MISSES
                                  else n for n in RUNS])
def test_published_run_is_predicted_within_25_percent_and_fits(name):
    result = validate(name, RUNS[name], with_auto=False)
    assert result.published.fits, f"{name}: needs {result.published.memory['total'] / 2**30:.1f} GiB per device"
    assert 0.75 <= result.ratio <= 1.25, (
        f"{name}: predicted {result.published.tokens_per_s_per_device:.1f} tokens/s per device, published {result.published_tokens_per_s:.1f}"
    )


def test_at_least_three_sizes_are_validated():
    sizes = {validate(n, r, with_auto=False).workload.num_params // 10**9 for n, r in RUNS.items() if n not in KNOWN_MISSES}
    assert len(sizes) >= 3 and max(sizes) >= 1000 and min(sizes) < 10  # from under 10B to a trillion parameters


def test_strategy_auto_answers_for_the_same_machine():
    """What strategy=auto would run instead of Megatron's 145.6B layout, on the same 1,536 A100s: a layout that fits."""
    result = validate("megatron_145.6b", RUNS["megatron_145.6b"])
    assert result.auto is not None and result.auto.chosen.fits and result.auto.chosen.layout.world == 1536
    assert result.auto.workload.precision.name == "amp"  # trainer.precision=bf16-mixed, pipelines included


def test_strategy_auto_is_never_predicted_slower_than_a_published_layout_parallelkit_can_run():
    """Where parallelkit can run the published degrees (not refused for its own workload, judged to fit), they are among
    the candidates strategy=auto costs, and its choice is predicted at least as fast as the published layout is."""
    compared = []
    for name, run in RUNS.items():
        result = validate(name, run)
        if parallelkit_can_run(result) is not None:
            continue
        compared.append(name)
        published, auto = result.published, result.auto.chosen
        assert any(c.layout.dims == published.layout.dims and c.time is not None for c in result.auto.candidates), name
        assert auto.tokens_per_s_per_device >= published.tokens_per_s_per_device, (
            f"{name}: strategy=auto's {auto.label} at {auto.tokens_per_s_per_device:.1f} tokens/s per device, the published "
            f"{published.label} at {published.tokens_per_s_per_device:.1f}")
    assert "megatron_1t" in compared and "megatron_145.6b" in compared  # pipelines under bf16-mixed are runnable


def test_bloom_cannot_be_split_for_reasons_of_the_model_not_of_its_tied_embeddings():
    """BLOOM's transformers config has no TP plan and parallelkit does not rebuild its decoder loop for pipeline stages;
    without either, 384 ranks of data parallelism cannot split 2,048 sequences. Tied embeddings are not a reason."""
    result = validate("bloom_176b", RUNS["bloom_176b"])
    assert "base_model_tp_plan" in parallelkit_can_run(result)
    assert result.auto is None
    for words in ("base_model_tp_plan", "decoder loop", "cannot be split evenly over dp × sharding = 384"):
        assert words in result.auto_note
    assert "tie" not in result.auto_note


def test_llama3_long_context_row_is_table_4s_context_parallel_layout():
    """Llama 3 405B's 128K stage (arXiv:2407.21783, Table 4): TP 8, CP 16, PP 16, DP 8 on 16,384 GPUs, 16 sequences of
    131,072 tokens per data-parallel rank, 380 TFLOPs/GPU by the paper's FLOP count (6N + 12·l·h·s per token)."""
    result = validate("llama3_405b_128k_cp16", RUNS["llama3_405b_128k_cp16"], with_auto=False)
    lay, w = result.published.layout, result.workload
    assert (lay.dims.data_parallel_size, lay.cp, lay.tp, lay.pp, lay.world) == (8, 16, 8, 16, 16384)
    assert (w.seq_len, w.global_batch) == (131072, 16 * 8)
    layers, hidden = 126, 16384  # the paper's Table 3
    assert result.published_tokens_per_s == pytest.approx(380e12 / (6 * w.num_params + 12 * layers * hidden * 131072))
    assert 405e9 < w.num_params < 406e9
    # Each rank holds s/cp tokens: the ring's keys and values travel, and the layer's activations are those of 8,192 tokens.
    assert result.published.comm_bytes["cp"] > 0 and result.published.time.comm["cp"] > 0
    # A block's activations per micro-batch: those of the 8K stage's 8,192-token sequences (flash attention keeps no scores).
    short = validate("llama3_405b_8k_gpus", RUNS["llama3_405b_8k_gpus"], with_auto=False).workload
    assert layer_activation_bytes(w, 1, 8, sequence_parallel=True, cp=16) == pytest.approx(
        layer_activation_bytes(short, 1, 8, sequence_parallel=True), rel=1e-12)
