"""A local job listens on the address its ranks use (loopback), not on every interface: the rendezvous store,
gloo's process groups, and (strategy=ps) the RPC agents. Read from the kernel's socket tables while the job runs."""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path

import pytest

from test_train import TINY, train

HERE = Path(__file__).resolve().parent


def listeners_of_a_run(tmp_path: Path, overrides: list[str], env: dict | None = None) -> dict[int, list[str]]:
    """Each rank's listening sockets at step 3 of a 2-rank ddp run (``fault_injection.RecordListeners``)."""
    record = ["+callbacks.rec._target_=fault_injection.RecordListeners", "+callbacks.rec.at_step=3", f"+callbacks.rec.out_dir={tmp_path}"]
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    proc = train([*TINY, "trainer.max_steps=5", *overrides, *record, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = {int(p.stem.removeprefix("listeners_rank")): json.loads(p.read_text())["listening"] for p in tmp_path.glob("listeners_rank*.json")}
    assert sorted(found) == [0, 1], found
    return found


def not_loopback(listening: list[str]) -> list[str]:
    return [s for s in listening if not ipaddress.ip_address(s.rsplit(":", 1)[0].strip("[]")).is_loopback]


# trainer.devices=2 on the command line: parallelkit starts the ranks and hosts the store early; unset (the
# default command's case, ddp's default of 2 processes): Lightning's launcher starts them.
@pytest.mark.parametrize("devices", [["trainer.devices=2"], []], ids=["early-launch", "lightning-launcher"])
def test_a_local_job_listens_on_loopback_only(devices, tmp_path):
    found = listeners_of_a_run(tmp_path, ["strategy=ddp", *devices])
    assert found[0] and found[1], found  # the store on rank 0, gloo's listeners on both: the check has something to see
    assert not not_loopback(found[0] + found[1]), found


def test_negative_control_a_wildcard_master_addr_is_seen(tmp_path):
    """MASTER_ADDR=0.0.0.0 asks for every interface: the same check must find the store's wildcard listener."""
    found = listeners_of_a_run(tmp_path, ["strategy=ddp", "trainer.devices=2"], env={"MASTER_ADDR": "0.0.0.0"})
    assert not_loopback(found[0]), found


def _listeners_of_a_bench_loop(script: str, tmp_path: Path, env: dict | None = None) -> list[str]:
    """Every socket the ranks of ``bench/<script>`` listen on, sampled from the kernel while it runs (3 steps, tiny)."""
    import subprocess
    import sys
    import time

    from parallelkit.distributed.listeners import listening_sockets

    bench = HERE.parents[1] / "bench"
    command = [sys.executable, str(bench / script), "--out", str(tmp_path), "--steps", "3", "--n-layer", "1", "--n-embd", "32",
               "--global-batch-size", "4", "--warmup-steps", "1"]
    proc = subprocess.Popen(command, cwd=tmp_path, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen: set[str] = set()
    while proc.poll() is None:
        pids = [str(proc.pid)]
        try:
            pids += Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            for pid in pids:
                seen.update(listening_sockets(pid))
        except OSError:  # a rank ended between two reads
            pass
        time.sleep(0.05)
    assert proc.returncode == 0, proc.stdout.read()[-3000:]
    return sorted(seen)


@pytest.mark.parametrize("script", ["ddp_loop.py", "fsdp2_loop.py"])
def test_the_hand_written_bench_loops_listen_on_loopback_only(script, tmp_path):
    seen = _listeners_of_a_bench_loop(script, tmp_path)
    assert seen and not not_loopback(seen), seen


def test_negative_control_a_bench_loop_with_a_wildcard_master_addr_is_seen(tmp_path):
    assert not_loopback(_listeners_of_a_bench_loop("ddp_loop.py", tmp_path, env={"MASTER_ADDR": "0.0.0.0"}))
