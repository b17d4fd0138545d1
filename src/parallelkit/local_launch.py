"""Start the local ranks of a job at once, before anyone imports torch and Lightning.

Lightning's launcher starts ranks 1..N-1 from inside ``trainer.fit``, when rank 0 has already imported
torch and Lightning and built the data and model: the ranks start one after the other and the job pays
the start-up twice (about 3 s on 2 CPU cores). Here rank 0 starts them right after Hydra composed the
config, so all ranks import in parallel. The children then wait on their stdin until rank 0 has
validated the run (``release``): bad input still stops the job before any other rank does any work, with
one message, and nothing is written. Lightning sees ``LOCAL_RANK`` in the environment and treats the
processes as externally created, as under torchrun.

Used only when the local process count is known from the config alone (``trainer.devices`` an int > 1,
one node, no torchrun/SLURM); otherwise Lightning's launcher starts the ranks as usual.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
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
        from lightning.fabric.strategies.launchers.subprocess_script import _launch_process_observer

        # Kills the whole job if a child fails, like Lightning's own launcher does.
        _launch_process_observer(list(_children))


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


def wait_for_release() -> None:
    """In an early-started child: block until rank 0 says go; exit quietly if it does not."""
    if os.environ.get(EARLY_CHILD_ENV) != "1":
        return
    if sys.stdin.buffer.readline() != _GO:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


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

