"""End-to-end: ``python train.py ...`` in a subprocess, as a user runs it.

The correctness contract: with the same seed, model, data and global batch, ``strategy=ddp`` on 2
processes reproduces ``strategy=single``'s per-step ``train_loss`` (fp32 round-off), also with gradient
accumulation and with a per-device batch size.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from warm_launcher import run_train  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# A tiny GPT for 20 steps: seconds per run, yet every part of the stack is exercised.
TINY = [
    "+experiment=smoke",
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "data.seq_len=16",
    "data.global_batch_size=8",
    "trainer.max_steps=20",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]
REL_TOL = 1e-5


def train(args: list[str], cwd: Path, timeout: float = 240, env: dict | None = None, cold: bool = False) -> subprocess.CompletedProcess:
    """Run train.py to completion (killed after ``timeout`` seconds: a hang is a failure, not a wait).

    From the warm launcher (``warm_launcher.py``: the job and its ranks forked from a process that has
    imported torch and Lightning), or as a plain subprocess with ``cold=True``.
    """
    full_env = {**os.environ, "HYDRA_FULL_ERROR": "0", **(env or {})}
    return run_train(args, cwd, full_env, timeout, cold=cold)


def run_ok(args: list[str], run_dir: Path, env: dict | None = None, cold: bool = False) -> dict:
    proc = train([*args, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent, env=env, cold=cold)
    assert proc.returncode == 0, f"train.py {' '.join(args)} exited {proc.returncode}\n{proc.stderr[-4000:]}"
    return json.loads((run_dir / "summary.json").read_text())


def max_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def single_reference(tmp_path_factory) -> dict:
    return run_ok([*TINY, "strategy=single"], tmp_path_factory.mktemp("single") / "run")


def test_ddp_reproduces_single_process_loss(single_reference, tmp_path):
    # cold: a real `python train.py` whose rank 1 is started and handed the config as a user's run does.
    ddp = run_ok([*TINY, "strategy=ddp", "trainer.devices=2"], tmp_path / "run", cold=True)

    assert ddp["strategy"] == "ddp" and ddp["world_size"] == 2
    assert ddp["dims"] == {"dp": 2, "sharding": 1, "cp": 1, "tp": 1, "pp": 1, "ep": 1}
    assert ddp["steps"] == single_reference["steps"] == 20
    assert max_rel_diff(ddp["train_loss"], single_reference["train_loss"]) <= REL_TOL
    # Training did something: the loss fell.
    assert ddp["train_loss"][-1] < ddp["train_loss"][0] - 0.2
    # Communication was measured: one fp32 gradient all-reduce of every parameter per step (a ring on 2 ranks
    # sends each byte once), plus gloo's headers (12 of 48 bytes per all-reduce); that this is what the processes
    # wrote is checked in test_wire_traffic.py.
    grad = ddp["comm"]["by_kind"]["grad_allreduce"]
    assert grad["collectives_per_step"] >= 1
    assert grad["bytes_per_step"] == ddp["num_params"] * 4 + grad["collectives_per_step"] * 12 * 48
    assert single_reference["comm"]["bytes_sent_per_step"] == 0
    # Every rank holds the whole model under DDP: params bytes = 4 × parameters.
    assert ddp["model_state_bytes"]["params"] == ddp["num_params"] * 4
    # p.grad and DDP's gradient buckets (gradient_as_bucket_view=false, the default): every gradient twice.
    assert ddp["model_state_bytes"]["grads"] == 2 * ddp["num_params"] * 4
    assert ddp["model_state_bytes"]["optimizer"] >= 2 * ddp["num_params"] * 4  # AdamW: two moments
    for key in ("step_time_s_median", "samples_per_s", "peak_rss_bytes", "final_loss", "global_batch_size"):
        assert ddp[key] is not None and ddp[key] > 0, key

    # metrics.csv carries the same global-mean trajectory, one row per step.
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train_loss")]
    assert [float(r["train_loss"]) for r in rows] == pytest.approx(ddp["train_loss"], rel=1e-7)
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()


def test_ddp_with_gradient_accumulation_keeps_parity(single_reference, tmp_path):
    ddp = run_ok([*TINY, "strategy=ddp", "trainer.devices=2", "trainer.accumulate_grad_batches=2"], tmp_path / "run")
    assert ddp["global_batch_size"] == single_reference["global_batch_size"]
    assert max_rel_diff(ddp["train_loss"], single_reference["train_loss"]) <= REL_TOL
    # Lightning syncs gradients only on the last micro-batch of a step: still one all-reduce per step.
    grad = ddp["comm"]["by_kind"]["grad_allreduce"]
    assert grad["bytes_per_step"] == ddp["num_params"] * 4 + grad["collectives_per_step"] * 12 * 48


def test_per_device_batch_size_grows_global_batch(single_reference, tmp_path):
    args = [*TINY, "strategy=ddp", "trainer.devices=2", "data.global_batch_size=null", "data.per_device_batch_size=4"]
    ddp = run_ok(args, tmp_path / "run")
    assert ddp["global_batch_size"] == 8  # 4 per rank × 2 ranks: the same global batch as the reference
    assert max_rel_diff(ddp["train_loss"], single_reference["train_loss"]) <= REL_TOL


def test_negative_control_different_seed_breaks_parity(single_reference, tmp_path):
    """The parity check can fail: another seed (other data order and weights) is far off."""
    other = run_ok([*TINY, "strategy=ddp", "trainer.devices=2", "seed=7"], tmp_path / "run")
    assert max_rel_diff(other["train_loss"], single_reference["train_loss"]) > 1e-3


def test_multirun_sweep_writes_one_summary_per_job(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", *TINY, "strategy=single,ddp", f"hydra.sweep.dir={sweep}"]
    proc = train(args, cwd=tmp_path, timeout=300, cold=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summaries = {}
    for path in sorted(sweep.glob("*/summary.json")):
        summary = json.loads(path.read_text())
        summaries[summary["strategy"]] = summary
    assert set(summaries) == {"single", "ddp"}, list(sweep.iterdir())
    assert summaries["ddp"]["world_size"] == 2
    assert max_rel_diff(summaries["ddp"]["train_loss"], summaries["single"]["train_loss"]) <= REL_TOL
    # Each job has its own directory; no rank started a sweep of its own.
    assert len(list(sweep.glob("*/summary.json"))) == 2
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "outputs").exists()


def test_multirun_with_early_started_ranks(single_reference, tmp_path):
    """With an integer trainer.devices the ranks start before the heavy imports (parallelkit.launch.local_ranks);
    each job of a sweep must start its own ranks from a clean environment."""
    sweep = tmp_path / "sweep"
    proc = train(["-m", *TINY, "strategy=ddp,ddp_fp16", "trainer.devices=2", f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=300, cold=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summaries = {s["comm"]["by_kind"]["grad_allreduce"]["bytes_per_step"]: s for s in (json.loads(p.read_text()) for p in sweep.glob("*/summary.json"))}
    assert len(summaries) == 2  # fp32 and fp16 gradients: two different jobs, both on 2 ranks
    for summary in summaries.values():
        assert summary["world_size"] == 2
    fp32 = summaries[max(summaries)]
    assert max_rel_diff(fp32["train_loss"], single_reference["train_loss"]) <= REL_TOL


def test_default_run_dir_is_deterministic(tmp_path):
    """Without hydra.run.dir, every rank (and a rerun) composes the same directory from the overrides."""
    proc = train([*TINY, "strategy=ddp", "trainer.devices=2", "trainer.max_steps=3"], cwd=tmp_path, cold=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = list((tmp_path / "outputs").glob("*/summary.json"))
    assert len(runs) == 1, runs
    assert "strategy=ddp" in runs[0].parent.name
    assert (runs[0].parent / "train_rank1.log").exists()  # rank 1 wrote into the same directory


def test_collector_is_back_on_on_every_rank_when_training_starts(tmp_path):
    """train.py and an early-started rank pause the garbage collector for their start-up
    (parallelkit.launch.startup_gc); both must train with it on again. Real processes (cold): the entry points
    themselves are what is tested."""
    import gc

    from fault_injection import RequireCollector

    gc.disable()  # negative control: the callback does fail a rank that trains with the collector off
    try:
        with pytest.raises(RuntimeError, match="still off"):
            RequireCollector().on_train_start(type("T", (), {"global_rank": 0})(), None)
    finally:
        gc.enable()
    env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])}
    check = ["+callbacks.gc._target_=fault_injection.RequireCollector"]
    proc = train(
        [*TINY, "strategy=ddp", "trainer.devices=2", "trainer.max_steps=3", *check, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, cold=True
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} trains with the collector on" in proc.stderr


@pytest.mark.parametrize("strategy", ["ddp", "zero"])
def test_every_strategy_shares_out_the_cores_alike(strategy, tmp_path):
    """The ranks parallelkit starts get the node's cores shared out (as Lightning's launchers and torchrun do), whatever
    the strategy: a strategy whose Lightning base starts no launcher (ModelParallelStrategy: zero, tp, pp, ...) once
    ran every rank on every core while DDP's ran on their share, and every zero-vs-ddp timing was skewed by it."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])
    report = ["+callbacks.threads._target_=fault_injection.ReportThreads", "trainer.max_steps=2"]
    share = max(1, (os.cpu_count() or 1) // 2)
    args = [*TINY, f"strategy={strategy}", "trainer.devices=2", *report]
    proc = run_train([*args, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, env, 240, cold=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} trains with {share} threads" in proc.stderr, proc.stderr[-3000:]
    # A user's own OMP_NUM_THREADS wins (negative control: the count above is not a constant of this machine's torch).
    own = 2 if share == 1 else 1  # torch takes at most the machine's cores
    proc = run_train([*args, f"hydra.run.dir={tmp_path / 'run_own'}"], tmp_path, {**env, "OMP_NUM_THREADS": str(own)}, 240, cold=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} trains with {own} threads" in proc.stderr, proc.stderr[-3000:]


def test_ddp_fp16_hook_halves_gradient_traffic(single_reference, tmp_path):
    """strategy=ddp_fp16 (a Hydra partial of parallelkit's fp16 hook) sends half the bytes and still learns the
    same thing: fp16 keeps 11 significant bits of each averaged gradient, so the loss may drift from the fp32
    reference by far less than 1e-3 over 20 steps (measured: a few 1e-6), but it must not be bit-identical."""
    fp16 = run_ok([*TINY, "strategy=ddp_fp16", "trainer.devices=2"], tmp_path / "run")
    grad = fp16["comm"]["by_kind"]["grad_allreduce"]
    assert grad["bytes_per_step"] == fp16["num_params"] * 2 + grad["collectives_per_step"] * 12 * 48  # + gloo's headers
    drift = max_rel_diff(fp16["train_loss"], single_reference["train_loss"])
    assert 0 < drift < 1e-3
