"""Issue 35 item 2: what a pipeline rank and an optimizer step cost the CPU, as ``--calibrate`` measures them, and
where the shared-cores bound counts a pipeline's sends.

On the 2-CPU VM, 8 ranks of ``model=gpt`` used 40-50 ms of CPU per step each whatever the layout, where the planner
charged 22-27 ms of busy time: PyTorch's CPU AdamW took 4.4 ms per step (one process) where the planner streamed its
bytes in 0.6 ms, and every pipeline micro-batch was charged a one-process gradient-accumulation step."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parallelkit.distributed.parallel_dims import ParallelDims
from parallelkit.planner.calibrate_host import PARALLEL_POINTS, optimizer_element_time, parallel_overrides
from parallelkit.planner.hardware import Hardware, load_profile, save_profile
from parallelkit.planner.layout import Layout
from parallelkit.planner.search import evaluate
from parallelkit.planner.shapes import gpt_shape
from parallelkit.planner.workload import PRECISIONS, Workload

PP_TERMS = (0.001, 0.0005, 0.002)  # per step, per micro-batch, per block and micro-batch


def _gpt(**changes) -> Workload:
    return Workload(shape=gpt_shape({"n_layer": 4, "n_embd": 128, "n_head": 4}, 128, 64), seq_len=64, global_batch=32,
                    precision=PRECISIONS["fp32"], **changes)


def _cpu8(units: float = 2.0, **fields) -> Hardware:
    return Hardware(**{**load_profile("cpu_default").__dict__, "devices_per_node": 8, "compute_units_per_node": units, **fields})


def test_a_pipeline_ranks_measured_host_time_is_charged_per_block_and_micro_batch():
    w = _gpt()
    pipeline = Layout(ParallelDims(8, dp=2, pp=4), micro_batch=4, microbatches=4)
    before, after = evaluate(w, _cpu8(), pipeline).time, evaluate(w, _cpu8(pp_host_overhead={4: PP_TERMS}), pipeline).time
    # 1 block per stage, 4 micro-batches through it
    assert after.host - before.host == pytest.approx(PP_TERMS[0] + 4 * (PP_TERMS[1] + 1 * PP_TERMS[2]))
    assert after.total - before.total >= 8 * (after.host - before.host) / 2 * 0.99  # 8 ranks' worth on 2 cores
    # negative control: a layout without a pipeline is not charged it
    flat = Layout(ParallelDims(8, dp=8), micro_batch=4)
    assert evaluate(w, _cpu8(pp_host_overhead={4: PP_TERMS}), flat).time.host == evaluate(w, _cpu8(), flat).time.host


def test_the_shared_cores_bound_leaves_out_a_pipelines_waits_for_its_neighbour():
    """8 ranks on 2 cores: a send's wall time is a wait other ranks' work fills, so a slower point-to-point link does
    not move the bound. Negative control: with a core per rank the same link lengthens the step."""
    w, pipeline = _gpt(), Layout(ParallelDims(8, dp=2, pp=4), micro_batch=4, microbatches=4)
    fast, slow = ({"p2p": {2: (latency, 1e9)}} for latency in (1e-4, 5e-3))
    shared = [evaluate(w, _cpu8(collectives=c), pipeline).time for c in (fast, slow)]
    assert shared[0].shared_units_floor and shared[1].shared_units_floor
    assert shared[1].comm["pp"] > shared[0].comm["pp"]
    assert shared[1].total == pytest.approx(shared[0].total)
    own_cores = [evaluate(w, _cpu8(units=8.0, collectives=c), pipeline).time.total for c in (fast, slow)]
    assert own_cores[1] > own_cores[0] * 1.05


def test_a_measured_optimizer_step_replaces_the_streaming_estimate_per_element_held():
    w, per_element = _gpt(), 5e-9
    ddp, sharded = Layout(ParallelDims(8, dp=8), micro_batch=4), Layout(ParallelDims(8, dp=4, sharding=2), zero_stage=3, micro_batch=4)
    measured = _cpu8(optimizer_element_time=per_element)
    assert evaluate(w, measured, ddp).time.optimizer == pytest.approx(w.num_params * per_element, rel=1e-6)
    assert evaluate(w, measured, sharded).time.optimizer == pytest.approx(w.num_params * per_element / 2, rel=0.02)
    # measured: the memory bandwidth no longer enters; not measured (every GPU profile): the bytes at the bandwidth
    bandwidth = _cpu8().memory_bandwidth
    twice = _cpu8(optimizer_element_time=per_element, memory_bandwidth=2 * bandwidth)
    assert evaluate(w, twice, ddp).time.optimizer == evaluate(w, measured, ddp).time.optimizer
    streamed = [evaluate(w, _cpu8(memory_bandwidth=b), ddp).time.optimizer for b in (bandwidth, 2 * bandwidth)]
    assert streamed[1] == pytest.approx(streamed[0] / 2, rel=0.05)


def test_the_optimizer_step_is_timed_for_the_workloads_own_optimizer():
    """AdamW's step (moments, bias corrections, several passes per tensor) against plain SGD's single update on the
    same tensors: the measured per-element time is the configured optimizer's."""
    adamw = optimizer_element_time(_gpt(optimizer="torch.optim.AdamW"), threads=1, min_time=0.2)
    sgd = optimizer_element_time(_gpt(optimizer="torch.optim.SGD"), threads=1, min_time=0.2)
    assert 0 < sgd and adamw > 2 * sgd


class DecayingSGD(torch.optim.SGD):
    """An optimizer whose class requires an argument (no default): as a user's own may."""

    def __init__(self, params, lr, decay, **kwargs):
        super().__init__(params, lr=lr * decay, **kwargs)


def test_the_optimizer_is_timed_with_its_configured_arguments():
    """``optim.optimizer``'s arguments reach the timed optimizer: a class that requires one (``decay``) is built
    from the config's. Negative control: built as before, with ``lr`` alone, it cannot be."""
    from parallelkit.planner.inputs import compose_config
    from parallelkit.planner.workload import workload_from_config

    target = f"{__name__}.DecayingSGD"
    cfg = compose_config(["model=gpt", "data=chars", "optim=sgd", f"optim.optimizer._target_={target}", "+optim.optimizer.decay=0.5"])
    w = workload_from_config(cfg)
    assert w.optimizer == target and dict(w.optimizer_kwargs)["decay"] == 0.5 and "_target_" not in dict(w.optimizer_kwargs)
    assert optimizer_element_time(w, threads=1, min_time=0.05) > 0
    with pytest.raises(TypeError, match="decay"):
        optimizer_element_time(replace(w, optimizer_kwargs=()), threads=1, min_time=0.05)


def test_compute_scale_takes_the_blocks_optimizer_step_off_its_step_time(monkeypatch):
    from parallelkit.planner import calibrate_host
    from parallelkit.planner.cost_model import CostModel

    per_block_step = 7e-3
    monkeypatch.setattr(calibrate_host, "_train", lambda overrides, devices, threads: (
        (0.02 if "model.n_layer=1" in overrides else 0.02 + 3 * per_block_step),) * 2)
    w = _gpt()
    plain, measured = _cpu8(layer_overhead=1e-3), _cpu8(layer_overhead=1e-3, optimizer_element_time=5e-9)
    modelled = CostModel(w, plain).layer(w.global_batch // 8, 1, 1, False, False, False).total
    assert calibrate_host.compute_scale(w, plain, 8) == pytest.approx((per_block_step - 1e-3) / modelled, abs=1e-3)
    optimizer = 5e-9 * w.shape.dense_layer
    assert calibrate_host.compute_scale(w, measured, 8) == pytest.approx((per_block_step - 1e-3 - optimizer) / modelled, abs=1e-3)


def test_the_pipeline_runs_hold_the_points_blocks_per_rank():
    for blocks, microbatches in PARALLEL_POINTS:
        out = parallel_overrides("pp", 4, blocks, microbatches)
        assert f"model.n_layer={4 * blocks}" in out and f"strategy.microbatches={microbatches}" in out
        assert "strategy.pp=4" in out and "strategy.schedule=gpipe" in out  # 1 micro-batch: GPipe allows it
        assert f"data.global_batch_size={8 * microbatches}" in out  # 8 sequences per micro-batch, as one process
    assert "model.n_layer=4" in parallel_overrides("tp", 2, 4, 1) and "strategy.tp=2" in parallel_overrides("tp", 2, 4, 1)


def test_pipeline_host_terms_and_optimizer_time_round_trip_through_a_profile(tmp_path):
    hw = _cpu8(pp_host_overhead={2: PP_TERMS, 4: (0.0, 0.001, 0.003)}, optimizer_element_time=4.2e-9)
    assert load_profile(str(save_profile(hw, tmp_path / "hw.yaml"))) == hw


def test_the_workload_names_the_configured_optimizer():
    from parallelkit.planner.inputs import compose_config
    from parallelkit.planner.workload import workload_from_config

    for group, target in (("adamw", "torch.optim.AdamW"), ("sgd", "torch.optim.SGD")):
        cfg = compose_config(["model=gpt", "data=chars", f"optim={group}"])
        assert workload_from_config(cfg).optimizer == target
