"""Start the local ranks of a job at once, before anyone imports torch and Lightning.

Lightning's launcher starts ranks 1..N-1 from inside ``trainer.fit``, when rank 0 has already imported
torch and Lightning and built the data and model: the ranks start one after the other and the job pays
the start-up twice (about 3 s on 2 CPU cores). Here rank 0 starts them right after Hydra composed the
config, so all ranks import torch and Lightning and build the data, model and trainer in parallel. Each child
then waits on its stdin, just before training, until rank 0 has validated the run (``release_or_wait``):
bad input still stops the job before any other rank trains or writes anything, with one message from rank 0
(a child that fails while building defers to rank 0's verdict and leaves quietly when rank 0 stops).
Lightning sees ``LOCAL_RANK`` in the environment and treats the processes as externally created, as under
torchrun.

Used only when the local process count is known from the config alone (``trainer.devices`` an int > 1,
one node, no torchrun/SLURM); otherwise Lightning's launcher starts the ranks as usual.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

EARLY_CHILD_ENV = "PARALLELKIT_EARLY_CHILD"
_GO = b"go\n"
_children: list[subprocess.Popen] = []


# Hydra overrides that describe the sweep, not the job: a child must not inherit them.
_SWEEP_ONLY = ("hydra.mode", "hydra.run.dir", "hydra.sweep", "hydra.job.name", "hydra.output_subdir", "hydra/launcher", "hydra/sweeper", "hydra.launcher", "hydra.sweeper")


def hydra_job_command(local_rank: int) -> list[str]:
    """The command that re-creates the current Hydra job (not the whole ``-m`` sweep) as ``local_rank``."""
    import __main__
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    if getattr(__main__, "__spec__", None) is None:
        command = [sys.executable, os.path.abspath(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    command += [f"--config-name={hc.job.config_name}"]
    command += [o for o in hc.overrides.hydra if not o.startswith(_SWEEP_ONLY)]
    command += list(hc.overrides.task)
    command += [
        f'hydra.run.dir="{hc.runtime.output_dir}"',
        "hydra.output_subdir=null",  # only rank 0 writes .hydra/
        f"hydra.job.name={hc.job.name}_rank{local_rank}",
    ]
    return command


def wants_early_launch(cfg) -> int:
    """The number of local processes to start now, or 0 to leave it to Lightning."""
    if any(key in os.environ for key in ("LOCAL_RANK", "RANK", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS")):
        return 0  # a child, or an external launcher already started the processes
    trainer = cfg.get("trainer") or {}
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes", 1)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 2 or nodes != 1:
        return 0
    return devices


def start_local_ranks(num_processes: int) -> None:
    """Start ranks 1..N-1 of this Hydra job; they block until :func:`release` or :func:`abort`."""
    port = os.environ.get("MASTER_PORT") or str(_free_port())
    os.environ.update(
        MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        MASTER_PORT=port,
        NODE_RANK="0",
        WORLD_SIZE=str(num_processes),
        LOCAL_RANK="0",
    )
    for local_rank in range(1, num_processes):
        env = {**os.environ, "LOCAL_RANK": str(local_rank), EARLY_CHILD_ENV: "1"}
        _children.append(subprocess.Popen(hydra_job_command(local_rank), env=env, stdin=subprocess.PIPE, cwd=os.getcwd()))


def release() -> None:
    """Rank 0 validated the run: let the waiting ranks go, and watch them from now on."""
    for child in _children:
        _send(child, _GO)
    if _children:
        # Ends the whole job if a child fails (like Lightning's own observer), but names the rank first.
        threading.Thread(target=_observe, args=(list(_children),), daemon=True, name="parallelkit-rank-observer").start()


def _observe(children: list[subprocess.Popen], period_s: float = 0.5, grace_s: float = 5.0) -> None:
    """Rank 0's watch over the ranks it started: if one dies, say which, then stop the others and itself.

    The grace period lets rank 0's own failure path (a collective that failed because the peer is gone)
    report and clean up first; this is the fallback when rank 0 is stuck elsewhere.
    """
    while True:
        time.sleep(period_s)
        codes = [child.poll() for child in children]
        if all(code == 0 for code in codes):
            return
        failed = [f"rank {rank} exited with code {code}" for rank, code in enumerate(codes, start=1) if code not in (None, 0)]
        if failed:
            time.sleep(grace_s)
            print(f"parallelkit: error: {'; '.join(failed)}; stopping the other ranks.", file=sys.stderr, flush=True)
            for child in children:
                if child.poll() is None:
                    child.kill()
            os._exit(3)


def abort() -> None:
    """Rank 0 failed: the waiting ranks exit without a word (their stdin closes)."""
    for child in _children:
        _send(child, b"")
    finish(timeout_s=10.0)


def finish(timeout_s: float = 60.0) -> None:
    """Wait for the children of this job, kill what is left, and forget them (a sweep starts anew)."""
    deadline = time.monotonic() + timeout_s
    for child in _children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    _children.clear()


def failed_peers(grace_s: float = 2.0) -> list[str]:
    """Which local ranks are known to have died, for the error message of a failed collective.

    On rank 0 of an early launch: the children that exited non-zero (waiting up to ``grace_s`` for a
    dying one to be reaped). In an early-started child: rank 0, if the launching process is gone.
    """
    deadline = time.monotonic() + grace_s
    if os.environ.get(EARLY_CHILD_ENV) == "1":
        while os.getppid() == _PARENT_PID and time.monotonic() < deadline:
            time.sleep(0.1)  # a dying parent may take a moment to be gone
        return ["rank 0 (the launching process) is gone"] if os.getppid() != _PARENT_PID else []
    while True:
        dead = [(rank, child.poll()) for rank, child in enumerate(_children, start=1)]
        failed = [f"rank {rank} exited with code {code}" for rank, code in dead if code not in (None, 0)]
        if failed or time.monotonic() > deadline or not _children:
            return failed
        time.sleep(0.1)


_PARENT_PID = os.getppid()


_released = False


def release_or_wait() -> None:
    """Just before training: rank 0 lets the waiting ranks go; an early-started child waits for that go."""
    if os.environ.get(EARLY_CHILD_ENV) == "1":
        wait_for_release()
    else:
        release()


def wait_for_release() -> None:
    """In an early-started child: block until rank 0 says go; exit quietly if it does not.

    Also called when a child fails before the go: rank 0 builds the same run and reports bad input itself,
    so the child's own error only matters if rank 0 goes on.
    """
    global _released
    if os.environ.get(EARLY_CHILD_ENV) != "1" or _released:
        return
    if sys.stdin.buffer.readline() != _GO:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    _released = True


def _send(child: subprocess.Popen, data: bytes) -> None:
    try:
        if data:
            child.stdin.write(data)
        child.stdin.close()
    except (BrokenPipeError, OSError):
        pass  # the child is gone already; the observer or finish() deals with it


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

