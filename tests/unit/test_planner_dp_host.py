"""Issue 35 item 2: the CPU the gradient all-reduce adds to a rank, as ``--calibrate`` measures it, and how the
shared-cores bound counts it.

On the 2-CPU VM, ``strategy=hybrid4d`` with ``dp = g`` on ``model=gpt`` (3.3 MB of gradients per rank) used 8 / 11 / 20
ms more CPU per rank and step than one process at g = 2 / 4 / 8 (three interleaved rounds), and dp = 8 stepped in
218-226 ms: the ranks' CPU over the 2 cores with nothing on top. The planner charged none of it and added the
all-reduce's wall (24 ms) instead: dp-heavy layouts were estimated 20-35 % fast while pipelines were right."""

from __future__ import annotations

import pytest

from parallelkit.distributed.parallel_dims import ParallelDims
from parallelkit.planner import calibrate_host
from parallelkit.planner.hardware import Hardware, load_profile, save_profile
from parallelkit.planner.layout import Layout
from parallelkit.planner.search import evaluate
from parallelkit.planner.shapes import gpt_shape
from parallelkit.planner.workload import PRECISIONS, Workload

DP_TERMS = (0.004, 0.0, 0.003)  # per step, (no per micro-batch term), per block


def _gpt() -> Workload:
    return Workload(shape=gpt_shape({"n_layer": 4, "n_embd": 128, "n_head": 4}, 128, 64), seq_len=64, global_batch=32,
                    precision=PRECISIONS["fp32"])


def _cpu8(**fields) -> Hardware:
    return Hardware(**{**load_profile("cpu_default").__dict__, "devices_per_node": 8, "compute_units_per_node": 2.0, **fields})


def test_the_gradient_all_reduces_cpu_is_charged_once_per_step_per_block_held():
    w, measured = _gpt(), _cpu8(dp_host_overhead={8: DP_TERMS})
    for accumulate in (1, 2):  # the all-reduce runs once per step, whatever the micro-steps
        ddp = Layout(ParallelDims(8, dp=8), micro_batch=4 // accumulate, accumulate=accumulate)
        before, after = evaluate(w, _cpu8(), ddp).time, evaluate(w, measured, ddp).time
        assert after.host - before.host == pytest.approx(DP_TERMS[0] + 4 * DP_TERMS[2])
    # a pipeline rank holds its stage's blocks: 1 of 4 under pp = 4 (dp = 2: the nearest measured group stands in)
    pipeline = Layout(ParallelDims(8, dp=2, pp=4), micro_batch=4, microbatches=4)
    assert (evaluate(w, measured, pipeline).time.host - evaluate(w, _cpu8(), pipeline).time.host
            == pytest.approx(DP_TERMS[0] + 1 * DP_TERMS[2]))
    # negative controls: FSDP2 reduces the gradients (sharding > 1), and without replicas nothing is all-reduced
    for layout in (Layout(ParallelDims(8, dp=4, sharding=2), zero_stage=3, micro_batch=4),
                   Layout(ParallelDims(8, dp=1, pp=8), micro_batch=4, microbatches=8)):
        assert evaluate(w, measured, layout).time.host == evaluate(w, _cpu8(), layout).time.host


def test_where_its_cpu_is_measured_the_all_reduces_wall_is_not_added_to_the_shared_cores_bound():
    """8 ranks on 2 units: the bound is every rank's busy time over the units; the measured dp CPU is in it, so the
    all-reduce's wall (the ranks waking for each ring step on the same cores) is not added again."""
    w, ddp = _gpt(), Layout(ParallelDims(8, dp=8), micro_batch=4)
    before, after = evaluate(w, _cpu8(), ddp).time, evaluate(w, _cpu8(dp_host_overhead={8: DP_TERMS}), ddp).time
    assert before.shared_units_floor and after.shared_units_floor and before.comm["dp"] > 0
    extra = after.host - before.host
    assert after.shared_units_floor == pytest.approx(before.shared_units_floor + 8 * extra / 2 - before.comm["dp"])
    # with a core per rank the bound does not apply: the wall stays on the critical path beside the CPU
    own = [evaluate(w, _cpu8(compute_units_per_node=8.0, **f), ddp).time for f in ({}, {"dp_host_overhead": {8: DP_TERMS}})]
    assert own[1].total == pytest.approx(own[0].total + extra) and own[1].comm["dp"] == own[0].comm["dp"] > 0


def test_dp_host_terms_round_trip_through_a_profile(tmp_path):
    hw = _cpu8(dp_host_overhead={2: (0.002, 0.0, 0.001), 8: DP_TERMS})
    assert load_profile(str(save_profile(hw, tmp_path / "hw.yaml"))) == hw


def test_calibration_takes_the_median_of_interleaved_rounds_on_the_workloads_own_blocks(monkeypatch):
    """A fake ``python -m parallelkit``: one process costs 10 ms + 5 ms per block; a dp = g rank 2g ms + g ms per block
    more. One round is disturbed (every run 30 ms slower, as a busy neighbour makes it): the median drops it."""
    calls: list[tuple[int, list[str]]] = []

    def fake_train(overrides, devices, threads):
        calls.append((devices, overrides))
        blocks = int(next(o for o in overrides if o.startswith("model.n_layer=")).split("=")[1])
        round_ = len(calls) // 8 if len(calls) % 8 else len(calls) // 8 - 1  # 8 runs per round (below)
        cpu = 0.010 + 0.005 * blocks + (0.002 * devices + 0.001 * devices * blocks if devices > 1 else 0.0)
        cpu += 0.030 if round_ == 1 and devices > 1 else 0.0  # the disturbed round slows the dp runs only
        return cpu, cpu

    monkeypatch.setattr(calibrate_host, "_train", fake_train)
    terms = calibrate_host.data_parallel_terms(_gpt(), 8, repeats=3)
    assert set(terms) == {2, 4, 8}
    for g, (step, microbatch, block) in terms.items():
        assert step == pytest.approx(0.002 * g) and microbatch == 0 and block == pytest.approx(0.001 * g)
    # the workload's own blocks (width 128, 4 heads, sequence 64), one sequence per rank, dp alone
    dp_runs = [o for d, o in calls if d > 1]
    assert all("model.n_embd=128" in o and "model.n_head=4" in o and "data.seq_len=64" in o for _, o in calls)
    assert all(f"strategy.dp={d}" in o for d, o in calls if d > 1)
    assert all("strategy.sharding=1" in o and "strategy.tp=1" in o and "strategy.pp=1" in o for o in dp_runs)
    assert [o[-1] for o in dp_runs[:6]] == [f"data.global_batch_size={g}" for g in (2, 2, 4, 4, 8, 8)]
    # interleaved: each round measures one process, then every group, before the next round
    assert [d for d, _ in calls] == [1, 1, 2, 2, 4, 4, 8, 8] * 3
