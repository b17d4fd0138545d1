"""Issue 35 item 8: per-GPU and node-aggregate bandwidth across nodes, torchtitan's selective op checkpointing,
a compute-bound step that scales with the batch, and the host time per step that ``--calibrate`` measures."""

from __future__ import annotations

import pytest

from parallelkit.distributed.parallel_dims import DP, SHARDING, ParallelDims
from parallelkit.planner.calibrate import HOST_POINTS, host_time_terms
from parallelkit.planner.calibrate_host import PARALLEL_POINTS, extra_terms
from parallelkit.planner.hardware import Hardware, load_profile
from parallelkit.planner.layout import Layout, members_per_node
from parallelkit.planner.memory import layer_activation_bytes
from parallelkit.planner.search import evaluate
from parallelkit.planner.selective_op import recomputed_matmuls, saved_matmuls
from parallelkit.planner.shapes import gpt_shape
from parallelkit.planner.validation import runs, validate, workload_of_run
from parallelkit.planner.workload import PRECISIONS, Workload

A100 = load_profile("a100_80gb_8x")
RUNS = runs()


def test_a_ring_across_nodes_gets_its_members_share_of_the_nodes_adapters():
    """nccl-tests' 84.8 GB/s over 4 HDR adapters per node is a node aggregate: 21.2 GB/s per adapter (per GPU on a DGX
    A100). A ring with all 8 GPUs of each node on it gets 8 × 21.2; one GPU per node 21.2; p2p and all-to-all 21.2."""
    assert A100.inter_node.bandwidth == pytest.approx(84.8e9 / 4)
    assert A100.ring_bandwidth(8) == pytest.approx(8 * 21.2e9)
    assert A100.ring_bandwidth(1) == pytest.approx(21.2e9)
    assert A100.ring_bandwidth(16) == A100.intra_node.bandwidth  # never above the node's own bus bandwidth
    n, g = 2**30, 64
    ring8 = A100.collective_time("all_gather", n, g, True, per_node=8)
    ring1 = A100.collective_time("all_gather", n, g, True, per_node=1)
    latency = A100.inter_node.latency * 7  # 1 + log2(64) start-ups
    assert (ring1 - latency) / (ring8 - latency) == pytest.approx(8)
    assert A100.collective_time("p2p", n, 2, True, per_node=8) == A100.collective_time("p2p", n, 2, True)
    assert A100.collective_time("all_to_all", n, g, True, per_node=8) == A100.collective_time("all_to_all", n, g, True)


def test_members_per_node_follow_the_mesh_order():
    fsdp = ParallelDims(64, sharding=64)
    assert members_per_node(fsdp, (SHARDING,), 8) == 8
    megatron = ParallelDims(256, dp=32, tp=8)  # tp innermost: each dp group has one GPU per node
    assert members_per_node(megatron, (DP,), 8) == 1
    assert members_per_node(ParallelDims(8, dp=2, sharding=2, tp=2), (SHARDING,), 8) == 2


def test_torchtitans_fsdp_rows_are_compute_bound_with_the_node_aggregate():
    """FSDP over 64 A100s: every GPU of each node on the ring, 169.6 GB/s; the gathers and reduce-scatters hide behind
    compute (the 21.2 GB/s reading made these rows communication-bound)."""
    for name in ("torchtitan_llama3_8b", "torchtitan_llama3_70b"):
        t = validate(name, RUNS[name], with_auto=False).published.time
        assert t.comm["sharding"] < 0.05 * t.total, name


def test_a_compute_bound_step_scales_with_the_batch():
    """Llama 2 70B on 64 A100s at local batch 1 and 2 (same recomputation): the step is twice as long at twice the batch."""
    run = RUNS["torchtitan_llama2_70b"]
    one = validate("x", {**run, "overrides": [o.replace("global_batch_size=128", "global_batch_size=64") for o in run["overrides"]],
                         "layout": {**run["layout"], "micro_batch": 1}}, with_auto=False)
    two = validate("x", run, with_auto=False)
    assert two.published.time.total / one.published.time.total == pytest.approx(2.0, rel=0.05)


def test_selective_op_saves_every_other_matmul_of_a_llama_block():
    """torchtitan's policy: mm outputs saved except every second one. Llama: q, k, v, o, w1, w3, w2 → q, v, w1, w2 saved."""
    w = workload_of_run(RUNS["torchtitan_llama3_8b"])
    h, f, kv = 4096, 14336, 8 * 128
    assert [out for _, out, _ in saved_matmuls(w.shape, 1)] == [h, kv, f, h]  # q (a·d = h), v, w1, w2
    assert [out for _, out, _ in recomputed_matmuls(w.shape, 1)] == [kv, h, f]  # k, o, w3
    none, op, full = (layer_activation_bytes(w, 1, 1, recompute=r) for r in ("none", "selective_op", "full"))
    assert op < none
    per_token = 2 * (h + h + kv + f + h + h) + 4 * 32  # input, q, v, w1, w2, attention output; fp32 log-sum-exp
    assert op == pytest.approx(w.seq_len * per_token)


def test_selective_op_recomputes_less_than_full_and_more_than_korthikantis_selective():
    w = workload_of_run(RUNS["torchtitan_llama3_8b"])
    layout = Layout(ParallelDims(64, sharding=64), zero_stage=3, micro_batch=1)
    times = {r: evaluate(w.with_(recompute=r), A100, layout).time for r in ("selective", "selective_op", "full")}
    assert times["selective"].recompute == 0  # fused attention: Korthikanti's selective recomputes nothing
    assert 0 < times["selective_op"].recompute < 0.5 * times["full"].recompute


def test_host_time_terms_are_solved_from_four_measured_points():
    truth = {"step_overhead": 3e-3, "microbatch_overhead": 1e-3, "layer_step_overhead": 2e-4, "layer_overhead": 5e-4}
    hw = Hardware(**{**A100.__dict__, **truth})
    times = {(layers, a): hw.host_time(layers, a) for layers, a in HOST_POINTS}
    assert host_time_terms(times) == pytest.approx(truth)


def test_the_estimate_includes_the_host_time_on_the_critical_path_and_in_the_shared_units_bound():
    w = Workload(shape=gpt_shape({"n_layer": 4, "n_embd": 128, "n_head": 4}, 128, 64), seq_len=64, global_batch=32,
                 precision=PRECISIONS["fp32"])
    cpu = Hardware(**{**load_profile("cpu_default").__dict__, "devices_per_node": 8, "compute_units_per_node": 2.0})
    host = Hardware(**{**cpu.__dict__, "step_overhead": 0.01, "layer_overhead": 0.005})
    layout = Layout(ParallelDims(8, dp=4, pp=2), micro_batch=4, microbatches=2)
    without, with_host = evaluate(w, cpu, layout).time, evaluate(w, host, layout).time
    assert with_host.host == pytest.approx(0.01 + 2 * 2 * 0.005)  # 2 blocks per stage, 2 micro-batches
    # 8 ranks' host time shared by 2 cores: the step grows by at least the node's host work over its units
    assert with_host.total - without.total >= 8 * with_host.host / 2 * 0.99


# ---- issue 35 item 2: the CPU a rank's tensor parallelism and FSDP2 cost on the host, and kernels inside a step
def _small_gpt() -> Workload:
    return Workload(shape=gpt_shape({"n_layer": 4, "n_embd": 128, "n_head": 4}, 128, 64), seq_len=64, global_batch=32,
                    precision=PRECISIONS["fp32"])


def _cpu8(**fields) -> Hardware:
    return Hardware(**{**load_profile("cpu_default").__dict__, "devices_per_node": 8, "compute_units_per_node": 2.0,
                       "dtensor_op_overhead": 1e-5, **fields})


def test_measured_tensor_parallel_and_fsdp_host_time_is_charged_on_every_rank():
    """A tp rank's measured CPU per micro-batch and per block replaces the DTensor op count; in the shared-cores bound
    8 ranks' worth of it is spread over the node's 2 cores."""
    w, tp_terms, sh_terms = _small_gpt(), (0.001, 0.004, 0.01), (0.0005, 0.002, 0.003)
    measured = _cpu8(tp_host_overhead={2: tp_terms}, sharding_host_overhead={2: sh_terms})
    tp = Layout(ParallelDims(8, dp=4, tp=2), micro_batch=8)
    both = Layout(ParallelDims(8, dp=2, sharding=2, tp=2), zero_stage=3, micro_batch=8)
    before, after = evaluate(w, _cpu8(), tp).time, evaluate(w, measured, tp).time
    assert after.dispatch == pytest.approx(tp_terms[0] + tp_terms[1] + 4 * tp_terms[2])  # 1 micro-batch, 4 blocks
    assert after.total - before.total >= 8 * (after.dispatch - before.dispatch) / 2 * 0.99
    fsdp = evaluate(w, measured, both).time
    assert fsdp.dispatch == pytest.approx(sum(tp_terms[:2]) + 4 * tp_terms[2] + sum(sh_terms[:2]) + 4 * sh_terms[2])
    accumulated = evaluate(w, measured, Layout(ParallelDims(8, dp=4, tp=2), micro_batch=4, accumulate=2)).time
    assert accumulated.dispatch == pytest.approx(tp_terms[0] + 2 * (tp_terms[1] + 4 * tp_terms[2]))  # per micro-batch
    # a group size not measured takes the nearest measured one's figures
    assert evaluate(w, measured, Layout(ParallelDims(8, dp=2, tp=4), micro_batch=16)).time.dispatch == pytest.approx(after.dispatch)


def test_compute_scale_multiplies_the_compute():
    w, layout = _small_gpt(), Layout(ParallelDims(8, dp=4, pp=2), micro_batch=4, microbatches=2)
    one, scaled = evaluate(w, _cpu8(), layout).time, evaluate(w, _cpu8(compute_scale=1.7), layout).time
    assert scaled.compute == pytest.approx(1.7 * one.compute)
    assert scaled.total > one.total


def test_gpu_profiles_measure_no_host_terms_and_keep_their_estimates():
    """Negative control: the published GPU profiles carry none of the CPU terms, so their estimates are what the
    profile's own figures give (dispatch 0, compute unscaled)."""
    w = workload_of_run(RUNS["torchtitan_llama3_8b"])
    layout = Layout(ParallelDims(64, sharding=32, tp=2), zero_stage=3, micro_batch=1)
    for name in ("a100_80gb_8x", "h100_80gb_8x", "gpu_default"):
        hw = load_profile(name)
        assert hw.tp_host_overhead == {} and hw.sharding_host_overhead == {} and hw.compute_scale == 1.0, name
        assert hw.parallel_host_time("tp", 2, 4, 1) is None
        t = evaluate(w, hw, layout).time
        assert t.dispatch == pytest.approx(0.0) if hw.dtensor_op_overhead == 0 else t.dispatch > 0


def test_parallel_host_terms_are_solved_from_one_and_four_block_runs():
    single = {(1, 1): 0.005, (4, 1): 0.011, (1, 2): 0.008}  # CPU per step, one process
    truth = (0.002, 0.004, 0.013)  # per step, per micro-batch, per block and micro-batch
    parallel = {(layers, a): single[layers, a] + truth[0] + a * (truth[1] + layers * truth[2]) for layers, a in PARALLEL_POINTS}
    assert extra_terms(single, parallel) == pytest.approx(truth)


def test_parallel_host_terms_and_compute_scale_round_trip_through_a_profile(tmp_path):
    from parallelkit.planner.hardware import save_profile

    hw = _cpu8(tp_host_overhead={2: (0.001, 0.004, 0.01), 4: (0.002, 0.006, 0.02)}, sharding_host_overhead={2: (0.0, 0.001, 0.002)},
               compute_scale=1.6)
    assert load_profile(str(save_profile(hw, tmp_path / "hw.yaml"))) == hw


def test_compute_scale_is_robust_to_one_disturbed_pair_of_runs(monkeypatch):
    """compute_scale from the median of interleaved (1-block, 4-block) pairs: a pair disturbed by the machine (the
    first one here: 4.1 against 7.1-7.6 ms per block, as measured one quarter-hour apart on the same VM) moves it
    no more than the spread of the others; from the first pair alone (the old measure) it would."""
    from parallelkit.planner import calibrate_host
    from parallelkit.planner.cost_model import CostModel

    per_block = iter([4.1e-3, 7.1e-3, 7.6e-3])
    runs = []

    def fake_train(overrides, devices, threads):
        layers = int(next(o for o in overrides if o.startswith("model.n_layer=")).split("=")[1])
        runs.append(layers)
        step = 0.02 if layers == 1 else 0.02 + 3 * next(per_block)
        return step, step

    monkeypatch.setattr(calibrate_host, "_train", fake_train)
    w, hw = _small_gpt(), _cpu8(layer_step_overhead=1e-3, layer_overhead=1e-3)
    modelled = CostModel(w, hw).layer(w.global_batch // 8, 1, 1, False, False, False).total
    scale = calibrate_host.compute_scale(w, hw, 8)
    assert runs == [1, 4] * calibrate_host.SCALE_REPEATS  # pairs, back to back
    assert scale == pytest.approx((7.1e-3 - 2e-3) / modelled, abs=1e-3)  # the median pair's, less the host per block
    assert abs(scale - (4.1e-3 - 2e-3) / modelled) > 0.3 * scale  # negative control: the disturbed pair alone is far off
