"""``python -m parallelkit.plan``: the ranking, ``--json``, bad input, and ``--calibrate`` into a loadable profile."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from parallelkit.errors import ConfigError
from parallelkit.planner.calibrate import CONCURRENT_CALLS, COLLECTIVE_PASSES, fit_latency_bandwidth, interleaved_medians, profile_from_measurements
from parallelkit.planner.hardware import from_dict, load_profile, named_profiles, resolve_hardware, save_profile
from parallelkit.tools.plan import main

TINY = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "data.seq_len=16", "data.global_batch_size=16"]
MEGATRON_1T = ["model=gpt", "model.n_layer=128", "model.n_embd=25600", "model.n_head=160", "+model.vocab_size=51200",
               "data.seq_len=2048", "data.global_batch_size=8192", "recompute=full"]


def test_png_goes_beside_the_json_named_by_the_layout(tmp_path, monkeypatch, capsys):
    """Without --png the picture lands beside --json's file (else in the current directory), named by the degrees."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    assert main([*TINY, "strategy=auto", "trainer.devices=4", "--json", "out/plan.json"]) == 0
    chosen = json.loads((tmp_path / "out" / "plan.json").read_text())["chosen"]["layout"]
    beside = tmp_path / "out" / ("plan_" + "_".join(f"{a}{chosen[a]}" for a in ("dp", "sharding", "cp", "tp", "pp", "ep")) + ".png")
    assert beside.read_bytes()[:4] == b"\x89PNG"
    assert main([*TINY, "strategy=hybrid4d", "strategy.tp=2", "strategy.pp=1", "trainer.devices=2"]) == 0
    assert (tmp_path / "plan_dp1_sharding1_cp1_tp2_pp1_ep1.png").read_bytes()[:4] == b"\x89PNG"
    out, err = capsys.readouterr()
    assert f"rank grid drawn to {beside.relative_to(tmp_path)}" in out and err == ""  # one stream
    assert main([*TINY, "strategy=hybrid4d", "trainer.devices=4", "--json", "x.json"]) == 2  # nothing to write: refused
    assert "needs strategy=auto" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def test_json_has_every_candidate_and_the_choice(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main([*TINY, "strategy=auto", "trainer.devices=4", "--json", str(out), "--png", str(tmp_path / "g.png")]) == 0
    text = capsys.readouterr().out
    assert "deciding terms against the runner-up" in text and "every candidate written to" in text
    data = json.loads(out.read_text())
    assert data["chosen"]["layout"] == data["candidates"][0]["layout"]
    costed = [c for c in data["candidates"] if not c["invalid"]]
    refused = [c for c in data["candidates"] if c["invalid"]]
    assert costed and refused  # tp=4 cannot split 2 heads: listed with why
    for c in costed:
        assert {"dp", "sharding", "tp", "pp", "micro_batch", "microbatches", "accumulate"} <= set(c["layout"])
        assert {"state", "activations", "gathered", "total"} <= set(c["memory_bytes"])
        assert {"compute", "bubble", "comm_dp", "comm_tp", "optimizer", "total"} <= set(c["time_s"])
        assert isinstance(c["fits"], bool)
    assert data["workload"]["num_params"] > 0 and data["hardware"]["name"] == "cpu_default"


def test_a_16384_rank_trillion_parameter_plan_prints_without_a_rank_listing(capsys):
    code = main([*MEGATRON_1T, "strategy=auto", "strategy.hardware=h100_80gb_8x", "trainer.devices=8", "trainer.num_nodes=2048",
                 "trainer.precision=32-true", "strategy.schedule=interleaved_1f1b"])
    out = capsys.readouterr().out
    assert code == 0
    assert "strategy=auto: 16384 ranks" in out and "per-rank listing skipped" in out
    assert "chosen:" in out and "1,009,349,478,400 parameters" in out  # Megatron's 1T, untied (+ V·h)


@pytest.mark.parametrize("args,message", [
    (["strategy=auto", "strategy.hardware=no_such_profile"], "neither a named profile"),
    (["strategy=auto", "--top"], "--top needs a value"),
    (["strategy=auto", "--frobnicate"], "Unknown option --frobnicate"),
    (["strategy=auto", "strategy.max_microbatches=0"], "max_microbatches should be an int greater than 0"),
])
def test_bad_input_is_one_error_paragraph_and_exit_2(args, message, capsys):
    assert main([*TINY, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and message in err and "Traceback" not in err


def test_a_malformed_profile_file_is_refused(tmp_path):
    bad = tmp_path / "hw.yaml"
    bad.write_text("name: x\ndevices_per_node: 8\n")
    with pytest.raises(ConfigError, match="lacks"):
        load_profile(str(bad))
    bad.write_text(yaml.safe_dump({**load_profile("a100_80gb_8x").as_dict(), "memory_per_device": -1}))
    with pytest.raises(ConfigError, match="memory_per_device should be a number greater than 0"):
        load_profile(str(bad))


def test_named_profiles_cite_their_sources():
    assert {"a100_80gb_8x", "h100_80gb_8x"} <= set(named_profiles())
    for name in ("a100_80gb_8x", "h100_80gb_8x"):
        hw = load_profile(name)
        assert hw.devices_per_node == 8 and len(hw.sources) >= 4 and all("http" in s for s in hw.sources)
        assert hw.intra_node.bandwidth > 5 * hw.inter_node.bandwidth  # NVLink against one NIC per GPU


def test_latency_bandwidth_fit_recovers_known_links():
    latency, bandwidth = 2e-3, 5e8
    points = [(n, latency + n / bandwidth) for n in (4e3, 6.4e4, 5e5, 2e6)]
    fit = fit_latency_bandwidth(points)
    assert fit[0] == pytest.approx(latency, rel=1e-6) and fit[1] == pytest.approx(bandwidth, rel=1e-6)
    noisy = [(4e3, 9e-3), (6.4e4, 2e-3), (5e5, 3e-3), (2e6, 6e-3)]  # a slow small message must not make the link infinite
    assert fit_latency_bandwidth(noisy)[1] < 1e12


def test_a_calibrated_profile_round_trips_and_loads_as_strategy_hardware(tmp_path):
    raw = {op: {"2": [[4096.0, 1e-3], [2 * 2**20, 5e-3]]} for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")}
    result = {"matmul_measured": {"64,64,64,fp32": 1e-5}, "single_gemm_s": 0.05, "concurrent_wall_s": 2 * CONCURRENT_CALLS * 0.05, "add_s": 0.01,
              "tiny_op_s": 5e-6, "peak_gemm_s_fp32": 0.02, "collectives_raw": [raw] * 4,
              "host_overheads_s": {"step_overhead": 3e-3, "microbatch_overhead": 1e-3, "layer_step_overhead": 2e-4, "layer_overhead": 5e-4}}
    hw = profile_from_measurements(result, 4, ["fp32"])
    assert hw.compute_units_per_node == pytest.approx(2.0)  # four processes' GEMMs in twice one process's time
    assert hw.host_time(4, 2) == pytest.approx(3e-3 + 2 * 1e-3 + 4 * (2e-4 + 2 * 5e-4))  # the measured host time per step
    path = save_profile(hw, tmp_path / "hw.yaml")
    loaded = resolve_hardware(str(path), accelerator="cpu", devices_per_node=4)
    assert loaded == from_dict(yaml.safe_load(path.read_text()), "x") and loaded.collectives["p2p"][2] == hw.collectives["p2p"][2]


def test_compute_units_are_the_node_throughput_not_each_ranks_best_window():
    """8 ranks on 2 cores: every rank's GEMMs at the one-process rate over the wall time of all of them at once. Each
    rank's own best window summed (the old measure) counted a core for every rank timing while others had finished."""
    raw = {op: {"2": [[4096.0, 1e-3], [2 * 2**20, 5e-3]]} for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")}
    single, cores = 0.004, 2
    wall = 8 * CONCURRENT_CALLS * single / cores  # the work of 8 ranks on 2 cores at the one-process rate
    result = {"matmul_measured": {"64,64,64,fp32": 1e-5}, "single_gemm_s": single, "concurrent_wall_s": wall, "add_s": 0.01,
              "tiny_op_s": 5e-6, "peak_gemm_s_fp32": 0.002, "collectives_raw": [raw] * 8,
              # windows in which ranks ran alone: their rates sum to 8 ranks' worth, not the 2 cores'
              "concurrent_rates": [1 / single] * 8}
    assert profile_from_measurements(result, 8, ["fp32"]).compute_units_per_node == pytest.approx(cores)


def test_compute_units_above_what_the_ranks_threads_can_use_are_capped_and_said():
    """2 ranks of 1 thread on 2 CPUs measured 2.026 units once (the solo GEMM timed 1 % slow): the profile holds at
    most what the ranks can use — the ranks (none runs faster beside the others than alone), the CPUs over each rank's
    threads — and its source says what was measured. Below the bound the measurement is kept as it is."""
    raw = {op: {"2": [[4096.0, 1e-3], [2 * 2**20, 5e-3]]} for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")}
    single = 0.004
    base = {"matmul_measured": {"64,64,64,fp32": 1e-5}, "single_gemm_s": single, "add_s": 0.01, "tiny_op_s": 5e-6,
            "peak_gemm_s_fp32": 0.002, "collectives_raw": [raw] * 2, "threads_per_rank": 1, "cpus": 2}
    fast = profile_from_measurements({**base, "concurrent_wall_s": 2 * CONCURRENT_CALLS * single / 2.026}, 2, ["fp32"])
    assert fast.compute_units_per_node == 2 and "2.026 measured, capped at 2" in fast.sources[0]
    slow = profile_from_measurements({**base, "concurrent_wall_s": 2 * CONCURRENT_CALLS * single / 1.7}, 2, ["fp32"])
    assert slow.compute_units_per_node == pytest.approx(1.7) and "capped" not in slow.sources[0]  # negative control
    # 2 ranks of 2 threads on 2 CPUs: one rank alone already used both, so together they have one rank's worth
    threads = profile_from_measurements({**base, "threads_per_rank": 2, "concurrent_wall_s": 2 * CONCURRENT_CALLS * single / 1.3}, 2, ["fp32"])
    assert threads.compute_units_per_node == 1


def test_collective_timings_survive_a_disturbance_that_lasts_several_rounds():
    """Each collective's rounds are spread over passes through all of them: a disturbance on a shared machine that
    lasts three rounds' time (the other work slows every round 3x) leaves every median at its undisturbed value.
    Negative control: the same clock and disturbance with each job's rounds back to back (the old order) moves one."""
    true = {("all_gather", 8, n): 1e-3 * (1 + n / 2**20) for n in (4096, 65536, 524288, 2097152)}
    true.update({("all_reduce", 8, n): 2e-3 * (1 + n / 2**20) for n in (4096, 65536, 524288, 2097152)})

    class Collective:  # what a job calls; the fake round reads which one it is
        def __init__(self, key):
            self.key = key

        def __call__(self):
            pass

    jobs = [(key, Collective(key), key[2]) for key in true]

    def timer():
        clock = {"rounds": 0}

        def time_round(fn, nbytes):
            clock["rounds"] += 1
            disturbed = 11 <= clock["rounds"] <= 13  # three consecutive rounds, whatever they time
            return true[fn.key] * (3 if disturbed else 1)
        return time_round

    assert interleaved_medians(jobs, timer()) == true
    back_to_back = {}
    time_round = timer()
    for key, fn, nbytes in jobs:
        back_to_back[key] = sorted(time_round(fn, nbytes) for _ in range(COLLECTIVE_PASSES))[COLLECTIVE_PASSES // 2]
    assert back_to_back != true  # the job whose rounds the disturbance covers keeps a 3x median


def test_calibrate_measures_this_machine(tmp_path):
    """The whole command on 2 processes: the profile it writes loads, and holds measured matmuls and collectives."""
    out = tmp_path / "hw.yaml"
    proc = subprocess.run([sys.executable, "-m", "parallelkit.plan", "--calibrate", *TINY, "trainer.devices=2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hw = load_profile(str(out))
    assert hw.backend == "gloo" and hw.devices_per_node == 2 and hw.matmul_measured
    assert set(hw.collectives) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"}
    assert all(lat > 0 and bw > 0 for by_g in hw.collectives.values() for lat, bw in by_g.values())
    assert "measured by" in hw.sources[0]
    # the host work tensor parallelism, FSDP2 and a pipeline add over 2 ranks, the optimizer's step, the workload's
    # kernels inside a step
    assert set(hw.tp_host_overhead) == set(hw.sharding_host_overhead) == set(hw.pp_host_overhead) == set(hw.dp_host_overhead) == {2}
    assert hw.optimizer_element_time > 0 and hw.compute_scale > 0
    assert 0 < hw.compute_units_per_node <= (os.cpu_count() or 1)  # 2 ranks' GEMMs can use at most the machine's CPUs
