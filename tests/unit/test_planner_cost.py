"""The planner's time terms: matmul efficiency by shape, recomputation, pipeline bubbles, overlap, the search."""

from __future__ import annotations

import subprocess
import sys

import pytest

from parallelkit.planner.cost_model import CostModel
from parallelkit.planner.hardware import Hardware, Link, load_profile
from parallelkit.distributed.parallel_dims import ParallelDims
from parallelkit.planner.layout import Layout
from parallelkit.planner.search import SearchOptions, evaluate, search
from parallelkit.planner.shapes import gpt_shape
from parallelkit.planner.workload import PRECISIONS, Runtime, Workload


def lay(dp: int = 1, sharding: int = 1, tp: int = 1, pp: int = 1, **options) -> Layout:
    """A layout of these degrees (their product the world size) and options."""
    return Layout(ParallelDims(dp * sharding * tp * pp, dp=dp, sharding=sharding, tp=tp, pp=pp), **options)

A100 = load_profile("a100_80gb_8x")
GPT = {"n_layer": 8, "n_embd": 4096, "n_head": 32}


def workload(**kw) -> Workload:
    base = dict(shape=gpt_shape(GPT, 51200, 2048), seq_len=2048, global_batch=64, precision=PRECISIONS["mixed"])
    return Workload(**{**base, **kw})


def test_gemm_efficiency_follows_the_shape():
    """Large GEMMs run at the profile's achievable rate; thin ones are memory-bound; tiny ones pay the launch."""
    big = A100.gemm_time(8192, 8192, 8192, 2, "bf16")
    assert 2 * 8192**3 / big == pytest.approx(A100.matmul_flops["bf16"], rel=0.01)
    thin = A100.gemm_time(8192, 8192, 16, 2, "bf16")  # k = 16: bytes dominate
    assert 2 * 8192 * 8192 * 16 / thin < 0.2 * A100.matmul_flops["bf16"]
    assert A100.gemm_time(1, 1, 1, 2, "bf16") == pytest.approx(A100.kernel_overhead, rel=0.01)
    measured = Hardware(**{**A100.__dict__, "matmul_measured": {"64,64,64,bf16": 1.0}})
    assert measured.gemm_time(64, 64, 64, 2, "bf16", batch=3) == 3.0  # a calibrated shape is used as measured


def test_tensor_parallelism_shrinks_gemms_and_lowers_their_efficiency():
    w = workload(global_batch=8)
    model = CostModel(w, A100)
    one, eight = model.layer(1, 1, 1, False, False, False), model.layer(1, 8, 1, False, False, False)
    compute_1 = one.forward - one.comm_tp / 2
    compute_8 = eight.forward - eight.comm_tp / 3
    assert compute_8 > compute_1 / 8  # 1/8 of the work, done less efficiently
    assert eight.comm_tp > 0 and one.comm_tp == 0


def test_full_recompute_adds_one_forward_per_layer():
    none, full = workload(), workload(recompute="full")
    layout = lay(8, 1, 1, 1, micro_batch=8)
    t_none, t_full = evaluate(none, A100, layout).time, evaluate(full, A100, layout).time
    layer = CostModel(none, A100).layer(8, 1, 1, False, False, False)
    assert t_full.recompute == pytest.approx(8 * layer.forward)  # 8 layers, one micro-step
    assert t_full.total - t_none.total == pytest.approx(t_full.recompute, rel=1e-6)


@pytest.mark.parametrize("schedule,v,factor", [("1f1b", 1, 1.0), ("interleaved_1f1b", 2, 0.5), ("interleaved_1f1b", 4, 0.25), ("zero_bubble", 2, 1 / 6)])
def test_pipeline_bubble_is_p_minus_1_over_v_micro_batches(schedule, v, factor):
    """Narayanan et al. 2021 §2.2: bubble (p − 1)/(v·m) of the ideal time; zero bubble (ZB-H1) a third of that.
    32 layers and a 128-token vocabulary: the embedding and head are negligible, the stages balanced."""
    w = workload(shape=gpt_shape({"n_layer": 32, "n_embd": 4096, "n_head": 32}, 128, 2048))
    p, m = 4, 16
    c = evaluate(w, A100, lay(1, 1, 1, p, microbatches=m, micro_batch=4, schedule=schedule, virtual_stages=v))
    ideal = c.time.compute + sum(c.time.comm[a] for a in ("tp", "pp"))
    assert c.time.bubble / ideal == pytest.approx((p - 1) * factor / m, rel=0.02)


def test_overlap_hides_sharding_traffic_behind_compute_and_parallelkits_dp_is_not_overlapped():
    w = workload(global_batch=64)
    layout = lay(1, 8, 1, 1, zero_stage=3, micro_batch=8)
    overlapped = evaluate(w, A100, layout).time
    exposed = evaluate(w.with_(runtime=Runtime(overlap_sharding=False)), A100, layout).time
    assert 0 < overlapped.comm["sharding"] < exposed.comm["sharding"]
    dp = evaluate(w, A100, lay(8, 1, 1, 1, micro_batch=8)).time
    dp_overlapped = evaluate(w.with_(runtime=Runtime(overlap_dp=True)), A100, lay(8, 1, 1, 1, micro_batch=8)).time
    assert dp.comm["dp"] > dp_overlapped.comm["dp"] > 0


def test_async_p2p_hides_the_steady_states_sends_not_the_bubbles():
    """Llama 3 §3.3.2's asynchronous point-to-point: sends run behind the compute (one left exposed); the pipeline's
    fill and drain still wait on them, so the bubble is unchanged."""
    w = workload(shape=gpt_shape({"n_layer": 32, "n_embd": 4096, "n_head": 32}, 128, 2048))
    layout = lay(1, 1, 1, 16, microbatches=32, micro_batch=2, schedule="interleaved_1f1b", virtual_stages=2)
    sync = evaluate(w, A100, layout).time
    async_ = evaluate(w.with_(runtime=Runtime(async_p2p=True)), A100, layout).time
    assert sync.crosses["pp"] and async_.bubble == pytest.approx(sync.bubble)
    assert async_.comm["pp"] == pytest.approx(sync.comm["pp"] / (32 * 4))  # one of 32 micro-batches × 4 sends
    # The step saves the hidden sends (the slowest stage may change: the first and last rank send less).
    assert sync.total - async_.total == pytest.approx(sync.comm["pp"] - async_.comm["pp"], rel=0.05)


def test_groups_across_nodes_use_the_inter_node_link():
    w = workload(global_batch=16)
    slow = Hardware(**{**A100.__dict__, "inter_node": Link(1e9, 1e-4)})
    inside = evaluate(w, slow, lay(1, 8, 1, 1, zero_stage=3, micro_batch=2)).time
    across = evaluate(w, slow, lay(1, 16, 1, 1, zero_stage=3, micro_batch=1)).time
    assert across.crosses["sharding"] and not inside.crosses["sharding"]
    assert across.comm["sharding"] > 10 * inside.comm["sharding"]


def test_shared_compute_units_bound_the_step():
    """Eight CPU processes on two cores: the node's compute divided by its units is a floor on the step."""
    w = workload(shape=gpt_shape({"n_layer": 4, "n_embd": 128, "n_head": 4}, 128, 64), seq_len=64, global_batch=32, precision=PRECISIONS["fp32"])
    cpu = load_profile("cpu_default")
    own = Hardware(**{**cpu.__dict__, "devices_per_node": 8})
    shared = Hardware(**{**own.__dict__, "compute_units_per_node": 2.0})
    layout = lay(8, 1, 1, 1, micro_batch=4)
    alone, together = evaluate(w, own, layout).time, evaluate(w, shared, layout).time
    assert together.shared_units_floor > 0 and together.total == pytest.approx(together.shared_units_floor)
    assert together.total > 3 * alone.total  # 8 ranks' compute on 2 units


def test_pruned_degree_sets_are_not_costed(monkeypatch):
    calls = []
    original = CostModel.step
    monkeypatch.setattr(CostModel, "step", lambda self, *a: calls.append(a[0]) or original(self, *a))
    w = workload(shape=gpt_shape({"n_layer": 4, "n_embd": 256, "n_head": 4}, 512, 256), seq_len=256, global_batch=64)
    plan = search(w, load_profile("h100_80gb_8x"), 64, SearchOptions())
    costed = [c for c in plan.candidates if c.time is not None]
    assert len(calls) == len(costed) and plan.invalid_layouts > 0
    assert all(c.invalid and c.time is None for c in plan.candidates if c.layout.tp > 4 or c.layout.pp > 4)


def test_planning_imports_no_torch():
    """What keeps a 16,384-rank plan of a trillion parameters arithmetic: the search never imports torch."""
    code = (
        "import sys\n"
        "from parallelkit.planner.hardware import load_profile\n"
        "from parallelkit.planner.search import search, SearchOptions\n"
        "from parallelkit.planner.shapes import gpt_shape\n"
        "from parallelkit.planner.workload import Workload, PRECISIONS\n"
        "w = Workload(gpt_shape({'n_layer': 128, 'n_embd': 25600, 'n_head': 160}, 51200, 2048), 2048, 8192, PRECISIONS['mixed'], recompute='full')\n"
        "plan = search(w, load_profile('h100_80gb_8x'), 16384, SearchOptions())\n"
        "assert plan.chosen.fits, plan.chosen\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
