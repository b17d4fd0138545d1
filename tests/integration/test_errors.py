"""Bad input gets one clear paragraph and a non-zero exit code, before any process starts and without
writing a summary; a rank that dies takes the job down quickly, with no process left behind."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from test_train import TINY, train

from parallelkit.run_dir import checkpoint_step

HERE = Path(__file__).resolve().parent

BAD_INPUT = [
    # (overrides, exit code, words the message must contain)
    # Hydra's own composition errors (its message, exit 2 like every other bad input)
    (["strategy=nope"], 2, ["strategy", "Available options", "ddp", "single"]),
    (["model=nope"], 2, ["model", "gpt", "mlp"]),
    (["data=nope"], 2, ["data", "chars", "synthetic"]),
    (["trainer.max_stepz=3"], 2, ["trainer.max_stepz", "not in struct"]),
    # optimizer and schedule arguments, checked before launch
    (["optim.optimizer.lr=-1e-3"], 2, ["optim=adamw", "optim.optimizer.lr=-0.001", "Invalid learning rate"]),
    (["optim.optimizer.lr=abc"], 2, ["optim.optimizer.lr='abc' should be a number"]),
    (["optim.optimizer.betas=[1.5,0.9]"], 2, ["optim.optimizer.betas=[1.5, 0.9]", "Invalid beta parameter"]),
    (["+optim.optimizer.lrr=1"], 2, ["+optim.optimizer.lrr=1 sets optim.optimizer.lrr, which no code reads", "optim.optimizer.lr=1"]),
    (["optim=sgd", "optim.optimizer.momentum=-1"], 2, ["optim=sgd", "optim.optimizer.momentum=-1"]),
    (["+optim.schedule.warmup=5"], 2, ["optim.schedule has no key warmup", "warmup_steps, decay_steps, min_lr_ratio"]),
    (["optim.schedule.warmup_steps=-1"], 2, ["optim.schedule.warmup_steps", "Got -1"]),
    (["optim.schedule.min_lr_ratio=2"], 2, ["optim.schedule.min_lr_ratio", "[0, 1]"]),
    (["NO_TINY", "strategy=single", "model=ctr", "data=ctr", "data.rows_per_field=1000", "model.sparse=true"], 2,
     ["model.sparse=true", "optim=adamw cannot take", "optim=adagrad"]),
    (["strategy=single", "trainer.devices=2"], 2, ["strategy=single", "trainer.devices", "strategy=ddp"]),
    (["strategy=ddp", "trainer.devices=2", "data.global_batch_size=9"], 2, ["data.global_batch_size=9", "2 data-parallel ranks", "multiple of 2"]),
    (["strategy=ddp", "trainer.devices=2", "strategy.dp=3"], 2, ["dp(3)", "sharding(1)", "tp(1)", "pp(1)", "2 processes"]),
    (["data.source=files", "data.files=[/nonexistent/corpus.txt]"], 2, ["/nonexistent/corpus.txt", "does not exist"]),
    (["data.source=files", "data.files=[EMPTY]"], 2, ["empty or too short"]),
    (["data.global_batch_size=8", "data.per_device_batch_size=4"], 2, ["exactly one of data.global_batch_size"]),
    (["NO_TINY", "model=gpt", "data=synthetic"], 2, ["model=gpt does not fit data=synthetic"]),
    (["trainer.devices=0"], 2, ["trainer.devices", "greater than 0"]),
    (["strategy.timeout_s=0"], 2, ["strategy.timeout_s"]),
    (["strategy=zero", "strategy.stage=5"], 2, ["strategy.stage must be 0, 1, 2 or 3", "Got 5"]),
    (["strategy=zero", "trainer.devices=4", "strategy.sharding_group=3"], 2, ["sharding_group=3", "world size 4", "[1, 2, 4]"]),
    (["strategy=zero", "strategy.stage=1", "strategy.offload=params"], 2, ["offload=params needs strategy.stage=3", "stage 1"]),
    (["strategy=zero", "strategy.stage=3", "strategy.offload=optimizer"], 2, ["offload=optimizer needs strategy.stage=1 or 2"]),
    (["strategy=zero", "strategy.offload=disk"], 2, ["strategy.offload must be one of none, optimizer, params", "'disk'"]),
    # ZeRO knobs that the chosen stage ignores
    (["strategy=zero", "strategy.stage=0", "strategy.sharding_group=2"], 2, ["strategy.sharding_group=2 cannot take effect with strategy.stage=0"]),
    (["strategy=zero", "strategy.stage=2", "strategy.per_block=false"], 2, ["strategy.per_block=false cannot take effect with strategy.stage=2"]),
    (["strategy=zero", "strategy.stage=1", "strategy.reshard_after_forward=false"], 2, ["strategy.reshard_after_forward=false", "strategy.stage=1"]),
    (["strategy=zero", "strategy.stage=2", "strategy.prefetch=false"], 2, ["strategy.prefetch=false cannot take effect with strategy.stage=2"]),
    (["strategy=zero", "strategy.prefetch=sometimes"], 2, ["strategy.prefetch should be true or false", "'sometimes'"]),
    (["strategy=zero", "strategy.stage=3", "strategy.bucket_cap_mb=5"], 2, ["strategy.bucket_cap_mb=5 cannot take effect with strategy.stage=3"]),
    (["strategy=zero", "strategy.stage=1", "strategy.shard_min_params=1000"], 2, ["strategy.shard_min_params", "strategy.stage=1"]),
    (["callbacks=[amp]", "callbacks.amp.dtype=fp8"], 2, ["callbacks.amp.dtype must be one of", "'fp8'"]),
    (["callbacks=[amp]", "callbacks.amp.incr_ratio=4.0"], 2, ["callbacks.amp.incr_ratio only applies to dtype=fp16"]),
    (["recompute=most"], 2, ["recompute must be one of none, full, selective", "'most'"]),
    (["strategy=deepspeed", "trainer.devices=2", "callbacks=[amp]"], 2, ["callbacks=[amp]", "does not work with strategy=deepspeed", "mixed_precision"]),
    (["ckpt_path=/nonexistent/last.ckpt"], 2, ["ckpt_path=/nonexistent/last.ckpt does not exist"]),
    (["ckpt_path=CORRUPT"], 2, ["is corrupt or truncated"]),
    (["ckpt_path=INCOMPLETE"], 2, ["incomplete sharded checkpoint", "meta.pt"]),
    (["optim.optimizer.lr=1e6", "optim.schedule.warmup_steps=0"], 4, ["training loss is nan", "diverged", "optim.optimizer.lr"]),
]


@pytest.mark.parametrize("overrides,code,words", BAD_INPUT, ids=[" ".join(c[0]) for c in BAD_INPUT])
def test_bad_input_is_one_clear_error(overrides, code, words, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    corrupt = tmp_path / "corrupt.ckpt"
    corrupt.write_bytes(b"PK\x03\x04 not a whole checkpoint")
    incomplete = tmp_path / "incomplete.ckpt"
    incomplete.mkdir()
    (incomplete / "__0_0.distcp").write_bytes(b"half a shard")
    base = [] if "NO_TINY" in overrides else TINY  # TINY sets chars-only keys (data.seq_len)
    overrides = [o.replace("EMPTY", str(empty)).replace("CORRUPT", str(corrupt)).replace("INCOMPLETE", str(incomplete)) for o in overrides if o != "NO_TINY"]
    run_dir = tmp_path / "run"
    proc = train([*base, *overrides, f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=120)
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    for word in words:
        assert word in proc.stderr, f"{word!r} missing from:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (run_dir / "summary.json").exists()
    assert not (run_dir / "checkpoints").exists()


@pytest.mark.parametrize("dead_rank", [1, 0], ids=["worker-dies", "rank0-dies"])
def test_dead_rank_stops_the_job_fast(dead_rank, tmp_path):
    """A rank that dies mid-training (no cleanup) makes the job exit non-zero well within the timeout."""
    kill = [
        "+callbacks.kill._target_=fault_injection.KillRank",
        f"+callbacks.kill.rank={dead_rank}",
        "+callbacks.kill.at_step=5",
    ]
    timeout_s = 60
    run_dir = tmp_path / "run"
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    proc = train(
        [*TINY, "strategy=ddp", "trainer.devices=2", f"strategy.timeout_s={timeout_s}", *kill, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        timeout=2 * timeout_s + 60,
        env=env,
        cold=True,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert f"killing rank {dead_rank}" in proc.stderr + proc.stdout
    # The surviving rank's message names the one that died.
    named = "rank 1 exited with code 13" if dead_rank == 1 else "rank 0 (the launching process) is gone"
    assert named in proc.stderr, proc.stderr[-3000:]
    assert elapsed < timeout_s + 30, f"the job took {elapsed:.0f} s to stop"
    assert not (run_dir / "summary.json").exists()
    time.sleep(1)
    leftovers = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    assert not leftovers, f"processes left behind: {leftovers}"


@pytest.mark.parametrize("rank,on_signal", [(0, True), (1, True), (0, False), (1, False)],
                         ids=["rank0", "rank1", "rank0-no-checkpoint", "rank1-no-checkpoint"])
def test_sigterm_stops_every_rank_with_a_failure_code(rank, on_signal, tmp_path):
    """A SIGTERM (a cluster's preemption) to one rank ends the job on all ranks, quickly, and never as a success:
    by default after a checkpoint at a step boundary the ranks agree on; with checkpoint.on_signal=false at once."""
    term = ["+callbacks.term._target_=fault_injection.SigtermRank", f"+callbacks.term.rank={rank}", "+callbacks.term.at_step=3"]
    timeout_s = 60
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    run_dir = tmp_path / "run"
    start = time.monotonic()
    proc = train([*TINY, "strategy=ddp", "trainer.devices=2", "trainer.max_steps=400", f"strategy.timeout_s={timeout_s}", f"checkpoint.on_signal={on_signal}",
                  "checkpoint.agree_every_s=0.2",  # the default 2 s can be more than these 400 tiny steps
                  *term, f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=2 * timeout_s + 60, env=env, cold=True)
    assert f"SIGTERM to rank {rank}" in proc.stderr
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert time.monotonic() - start < timeout_s, "the job waited for the collective timeout instead of stopping"
    assert not (run_dir / "summary.json").exists()
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    if on_signal:  # every rank took part in the checkpoint, then all left with SIGTERM's code
        assert proc.returncode == 143, proc.stderr[-3000:]
        step = int(re.search(r"stopped on SIGTERM after step (\d+)", proc.stderr).group(1))
        assert 3 <= step < 400
        assert checkpoint_step(run_dir / "checkpoints" / "last.ckpt") == step
    elif rank == 0:  # rank 1 sits in a collective rank 0 never joins: rank 0 tells it to go (not the timeout, not a kill)
        assert "rank 1 stops: rank 0 ended the job" in proc.stderr, proc.stderr[-3000:]
        assert not (run_dir / "checkpoints").exists()


def test_stuck_rank_is_named_within_the_timeout(tmp_path):
    """A rank that stops responding (alive, but never reaches the next collective): the others fail once
    strategy.timeout_s has passed, saying which rank never arrived, and no process is left behind."""
    timeout_s = 10
    stall = ["+callbacks.stall._target_=fault_injection.StallRank", "+callbacks.stall.rank=1", "+callbacks.stall.at_step=5"]
    run_dir = tmp_path / "run"
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    start = time.monotonic()
    proc = train(
        [*TINY, "strategy=ddp", "trainer.devices=2", f"strategy.timeout_s={timeout_s}", *stall, f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        timeout=180,
        env=env,
        cold=True,
    )
    elapsed = time.monotonic() - start
    assert "stalling rank 1" in proc.stderr
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "rank 1 never reached the collective" in proc.stderr, proc.stderr[-3000:]
    assert "rank 0 never reached" not in proc.stderr  # only the stuck one is named
    assert "rank 1 stops: rank 0 ended the job" in proc.stderr  # the stuck rank is told to go, not waited for
    assert elapsed < 90, f"the job took {elapsed:.0f} s to stop"
    assert not (run_dir / "summary.json").exists()
    time.sleep(1)
    leftovers = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    assert not leftovers, f"processes left behind: {leftovers}"
