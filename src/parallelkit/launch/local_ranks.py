"""Start the local ranks of a job as ordinary ``train.py`` processes, as torchrun would, and watch them.

A job with ``trainer.devices=N`` (N > 1) and no external launcher has its ranks 1..N-1 started by its local
rank 0, each with the same command line and ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``LOCAL_WORLD_SIZE``/
``MASTER_ADDR``/``MASTER_PORT`` set: every rank composes its own config with Hydra (the composition is
deterministic: the run directory comes from the overrides), validates it and builds its run, and Lightning
treats the processes as externally launched. There is one path, started at one of two moments:

- **before Hydra** (:func:`prepare_process`, first thing in ``train.py`` and the ``parallelkit`` command)
  when the command line says ``trainer.devices=N`` and the strategy's degrees, composed with Hydra's compose
  API, fit N processes (bad degrees start no process): the ranks import torch and Lightning while rank 0 does
  (on 2 cores the first step comes 2.6 s after launch instead of 5.7 s with Lightning's own launcher);
- **once the job's devices and degrees are validated** (:func:`ensure_started`, handed to
  :func:`parallelkit.run.assemble` as a hook) otherwise: a sweep's jobs (each gets its exact overrides and output directory, no ``-m``), devices set by a config
  file, or a strategy's default count.

Bad input stops the job with one message: every rank finds the same error, and a rank other than 0 stays
quiet — its stderr is held back until its config composed, and an error while it builds defers to rank 0's
(:func:`defer_to_rank0`). Rank 0 joins the process group only once its run is valid, so the other ranks
wait in the rendezvous until then and never train on a run rank 0 refuses.

Each started rank watches a pipe from rank 0 (:func:`_watch_rank0`): a ``stop`` byte (rank 0 ends the job
early: :func:`abort`) or its end (rank 0 died) makes it leave at once instead of waiting in a collective rank
0 will never join — silently if its process group never formed (rank 0 refused the run). Rank 0 watches
the ranks it started (:func:`_observe`) and ends the job, naming the rank, when one dies.

The environment a job changes is snapshot and restored in one place (:func:`job_environment`). How a rank is
created is :data:`spawn` (``subprocess.Popen``); the test suite's warm launcher substitutes a fork.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

RANK0_FD_ENV = "PARALLELKIT_RANK0_FD"  # in a started rank: the read end of rank 0's pipe (see _watch_rank0)
_STOP = b"s"  # rank 0 ends the job early (abort); the pipe's bare end means rank 0 died
_EXTERNAL = ("LOCAL_RANK", "RANK", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS")  # someone else started the processes
DEFER_S = 30.0  # how long a rank whose run failed waits for rank 0's verdict before it reports the error itself

@dataclass
class _Job:
    """Rank 0's side: the ranks it started for the current job."""

    children: list[Any] = field(default_factory=list)  # Popen-like: pid, poll, wait, kill
    pipes: list[int] = field(default_factory=list)  # the write end of each one's pipe (plain fds: nothing to finalize)
    before_hydra: bool = False  # started from the command line, before Hydra composed
    observing: threading.Event | None = None  # set while rank 0 watches them (_observe)
    store: Any = None  # the rendezvous store's server, hosted before the ranks reach it
    threads_before: int | None = None  # rank 0's torch threads before the job shared out the cores


@dataclass
class _Rank0Watch:
    """A started rank's side: its rank 0, and what it holds back until rank 0's verdict."""

    parent_pid: int = field(default_factory=os.getppid)
    held_stderr: tuple[int, Any] | None = None  # (the real stderr fd, the file holding this rank's output)
    deferred: bool = False  # has waited for rank 0's verdict once already


_job = _Job()
_watch = _Rank0Watch()


def spawn(command: list[str], env: dict[str, str], keep_fd: int) -> Any:
    """Create one local rank: ``command`` with ``env``, keeping ``keep_fd`` open (the test harness forks instead)."""
    return subprocess.Popen(command, env=env, pass_fds=(keep_fd,), cwd=os.getcwd())


def is_started_rank() -> bool:
    return RANK0_FD_ENV in os.environ


# ----------------------------------------------------------------------------------------------- rank 0
# Command-line flags after which Hydra does not run a job (help, config printing, sweeps), or runs many.
_NO_SINGLE_JOB = ("-m", "--multirun", "-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-p", "--package",
                  "--resolve", "-sc", "--shell-completion", "--experimental-rerun", "--version", "examples")


def devices_on_command_line(argv: list[str]) -> int:
    """``N`` if ``argv`` runs one Hydra job with ``trainer.devices=N`` (N > 1, one node), else 0."""
    if any(key in os.environ for key in _EXTERNAL):
        return 0
    devices = 0
    for arg in argv:
        if arg.split("=", 1)[0] in _NO_SINGLE_JOB:
            return 0
        key, _, value = arg.lstrip("+").partition("=")
        if key == "trainer.num_nodes" and value != "1":
            return 0
        if key == "trainer.devices":
            devices = int(value) if value.isdigit() else 0
    return devices if devices > 1 else 0


def prepare_process(argv: list[str] | None = None, config_path: str | None = None) -> None:
    """First thing in an entry point, before torch is imported.

    In a rank this module started: watch rank 0 and hold stderr back until the config composed. In a
    launching process whose command line says ``trainer.devices=N``: start ranks 1..N-1 now, if the strategy's
    degrees (composed from ``config_path``) fit N processes; otherwise the job starts them once it has
    validated its degrees (:func:`ensure_started`), so that bad degrees start no process at all.
    """
    if is_started_rank():
        global _job, _watch
        # What a rank forked from its rank 0 (the test harness) inherited describes rank 0's job, not its own.
        _job, _watch = _Job(), _Rank0Watch()
        threading.Thread(target=_watch_rank0, daemon=True, name="parallelkit-rank0-watch").start()
        _hold_stderr()
        return
    args = sys.argv[1:] if argv is None else argv
    count = devices_on_command_line(args)
    if count and config_path is not None:
        from parallelkit.launch.command_line import config_groups, degrees_allow_early_start, replace_groups_by_target

        count = count if degrees_allow_early_start(config_path, replace_groups_by_target(args, list(config_groups(config_path))), count) else 0
    if count:
        _start(count, _script_command())
        _job.before_hydra = True


def ensure_started(devices: int, num_nodes: int = 1) -> None:
    """Once a job knows its local process count: start its other ranks if nobody has (a sweep's job, devices
    from a config file or the strategy's default), or replace ranks started for another count."""
    if is_started_rank() or devices < 2:
        return
    if _job.children:
        if len(_job.children) == devices - 1:
            _host_store()
            return
        abort()  # started from the command line for a count the composed config does not confirm
    elif any(key in os.environ for key in _EXTERNAL):
        return  # torchrun, SLURM, or a user's own launcher started them
    _start(devices, _job_command(), num_nodes)
    _host_store()


def started() -> int:
    """How many local processes this job has if rank 0 started them (0: it did not)."""
    return len(_job.children) + 1 if _job.children else 0


def started_before_hydra() -> bool:
    return bool(_job.children) and _job.before_hydra


def _start(count: int, command: list[str], num_nodes: int = 1) -> None:
    """Start local ranks 1..count-1 of this node. Several nodes without torchrun/SLURM are started as with
    Lightning: the same command on each node with ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set by the user."""
    node_rank = int(os.environ.get("NODE_RANK", "0")) if num_nodes > 1 else 0
    port = os.environ.get("MASTER_PORT") or str(_free_port())
    launch = {"MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"), "MASTER_PORT": port, "NODE_RANK": str(node_rank),
              "WORLD_SIZE": str(count * num_nodes), "LOCAL_WORLD_SIZE": str(count)}
    for local_rank in range(1, count):
        read, write = os.pipe()
        rank = node_rank * count + local_rank
        env = {**os.environ, **launch, "RANK": str(rank), "LOCAL_RANK": str(local_rank), RANK0_FD_ENV: str(read)}
        try:
            _job.children.append(spawn(command, env, read))
        finally:
            os.close(read)
        os.set_inheritable(write, False)
        _job.pipes.append(write)
    os.environ.update(launch, RANK=str(node_rank * count), LOCAL_RANK="0")

    _job.observing = threading.Event()
    _job.observing.set()
    # Ends the whole job if a rank dies (like Lightning's own observer), naming the rank first.
    threading.Thread(target=_observe, args=(list(_job.children), _job.observing), daemon=True, name="parallelkit-rank-observer").start()


def share_cores() -> None:
    """Just before training, in every rank of a job whose ranks this module started: the node's cores shared out
    among its ranks, unless ``OMP_NUM_THREADS`` says otherwise — what Lightning's launchers do at the same point
    (``_set_num_threads_if_needed``), for every strategy alike (Lightning's ``ModelParallelStrategy``, the base of
    zero/tp/pp, starts no launcher when the processes exist already; each rank's torch would use every core).
    Not earlier: imports and the build run with every core, as a single process's would."""
    if "OMP_NUM_THREADS" in os.environ or not (is_started_rank() or _job.children):
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if not is_started_rank() and _job.threads_before is None:
        _job.threads_before = torch.get_num_threads()  # given back by finish(): a sweep's next job may run alone
    torch.set_num_threads(max(1, cores // int(os.environ["LOCAL_WORLD_SIZE"])))


def _entry_command() -> list[str]:
    """How this process was started, without its arguments: ``python train.py``, the ``parallelkit`` script, ``python -m``."""
    import __main__

    if getattr(__main__, "__spec__", None) is None:  # a script (train.py, the installed `parallelkit`): run by this interpreter
        return [sys.executable, os.path.abspath(sys.argv[0])]
    return [sys.executable, "-m", __main__.__spec__.name]


def _script_command() -> list[str]:
    """This process's own command line."""
    return [*_entry_command(), *sys.argv[1:]]


# Hydra overrides that describe the sweep, not the job: a rank of one job must not inherit them.
_SWEEP_ONLY = ("hydra.mode", "hydra.run.dir", "hydra.sweep", "hydra.job.name", "hydra.output_subdir", "hydra/launcher", "hydra/sweeper",
               "hydra.launcher", "hydra.sweeper")


def _job_command() -> list[str]:
    """The command that composes the current Hydra job (not the whole ``-m`` sweep) in its output directory."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():  # run() called from a user's own script: the script again, as Lightning would
        return [sys.executable, *sys.argv]
    hc = HydraConfig.get()
    command = [*_entry_command(), f"--config-name={hc.job.config_name}"]
    command += [o for o in hc.overrides.hydra if not o.startswith(_SWEEP_ONLY)]
    command += list(hc.overrides.task)
    command += [f'hydra.run.dir="{hc.runtime.output_dir}"', "hydra.mode=RUN"]
    return command


def _observe(children: list[Any], observing: threading.Event, period_s: float = 0.5, grace_s: float = 5.0) -> None:
    """Rank 0's watch over the ranks it started: if one dies, say which, then stop the others and itself.

    The grace period lets rank 0's own failure path (a collective that failed because the peer is gone, the
    same bad input) report and clean up first; this is the fallback when rank 0 is stuck elsewhere.
    """
    while True:
        time.sleep(period_s)
        if not observing.is_set():
            return  # rank 0 is ending the job itself: what it stops is not a failure to report
        codes = [child.poll() for child in children]
        if all(code == 0 for code in codes):
            return
        failed = [f"rank {rank} exited with code {code}" for rank, code in enumerate(codes, start=1) if code not in (None, 0)]
        if failed:
            time.sleep(grace_s)
            if not observing.is_set():
                return
            print(f"parallelkit: error: {'; '.join(failed)}; stopping the other ranks.", file=sys.stderr, flush=True)
            for child in children:
                if child.poll() is None:
                    child.kill()
            os._exit(3)


def _host_store() -> None:
    """Start the rendezvous store's server before the other ranks reach it.

    Otherwise rank 0 starts it inside ``init_process_group``, and a rank that gets there first finds no
    server, backs off and retries a second later (~0.8 s lost on every launch). The server is multi-tenant,
    so the store ``init_process_group`` creates on rank 0 shares it; ``wait_for_workers=False``: this handle
    is not a worker. It listens on ``MASTER_ADDR``'s address only (:mod:`parallelkit.distributed.listeners`).
    If it cannot start, ``init_process_group`` will say why itself.
    """
    if _job.store is not None or os.environ.get("NODE_RANK", "0") != "0":
        return
    try:
        from datetime import timedelta

        import torch.distributed as dist

        from parallelkit.distributed.listeners import host_store, listen_address

        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        address = listen_address(addr, one_machine=os.environ["WORLD_SIZE"] == os.environ["LOCAL_WORLD_SIZE"])
        _job.store = host_store(address, port) if address else dist.TCPStore(
            addr, port, is_master=True, wait_for_workers=False, multi_tenant=True, timeout=timedelta(seconds=60))
    except Exception:  # noqa: BLE001 - an optimisation: the usual rendezvous still works (or explains)
        _job.store = None


def abort(grace_s: float = 3.0) -> None:
    """Rank 0 ends the job early: every started rank leaves at once (:func:`_watch_rank0`), then is reaped.

    gloo closes rank 0's connections only when its process exits, not when its process group is destroyed,
    so a rank in a collective would otherwise wait for the timeout. One still running after ``grace_s`` is killed.
    """
    for fd in _job.pipes:
        with contextlib.suppress(OSError):
            os.write(fd, _STOP)
    finish(timeout_s=grace_s)


def finish(timeout_s: float = 60.0) -> None:
    """Wait for the ranks this job started, kill what is left, and forget them (a sweep's next job starts anew)."""
    global _job
    job, _job = _job, _Job()  # a sweep's next job starts anew; the store's server stops once the group's handle is gone too
    if job.observing is not None:  # first: the observer must not report the ranks this stops
        job.observing.clear()
    deadline = time.monotonic() + timeout_s
    for child in job.children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    for fd in job.pipes:
        with contextlib.suppress(OSError):
            os.close(fd)
    if job.threads_before is not None:
        sys.modules["torch"].set_num_threads(job.threads_before)
    if "torch" in sys.modules:
        from parallelkit.distributed.listeners import release_stores

        release_stores()


def failed_peers(grace_s: float = 2.0) -> list[str]:
    """Which local ranks are known to have died, for the error message of a failed collective: on rank 0
    the started ranks that exited non-zero; in a started rank, rank 0 if it is gone."""
    deadline = time.monotonic() + grace_s
    if is_started_rank():
        while not _rank0_gone() and time.monotonic() < deadline:
            time.sleep(0.1)  # a dying rank 0 may take a moment to be gone
        return ["rank 0 (the launching process) is gone"] if _rank0_gone() else []
    while True:
        failed = [f"rank {rank} exited with code {code}" for rank, code in ((r, c.poll()) for r, c in enumerate(_job.children, start=1))
                  if code not in (None, 0)]
        if failed or time.monotonic() > deadline or not _job.children:
            return failed
        time.sleep(0.1)


@contextlib.contextmanager
def job_environment() -> Iterator[None]:
    """One job's changes to ``os.environ`` (launch variables, Lightning's seed, the socket interface) are undone
    when it ends: a sweep's next job starts with the environment this one found."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


# ---------------------------------------------------------------------------------------- a started rank
def _rank0_gone() -> bool:
    return os.getppid() != _watch.parent_pid


def _hold_stderr() -> None:
    """Keep this rank's stderr in a file until :func:`composed`: a command line that does not compose is
    reported by rank 0, once, not by every rank."""
    held = tempfile.TemporaryFile()
    real = os.dup(2)
    sys.stderr.flush()
    os.dup2(held.fileno(), 2)
    _watch.held_stderr = (real, held)


def composed() -> None:
    """The config composed: this rank's stderr is the real one again, with what it held."""
    if _watch.held_stderr is None:
        return
    real, held = _watch.held_stderr
    _watch.held_stderr = None
    sys.stderr.flush()
    os.dup2(real, 2)
    os.close(real)
    held.seek(0)
    text = held.read()
    held.close()
    if text:
        os.write(2, text)


def defer_to_rank0(timeout_s: float = DEFER_S) -> None:
    """A started rank's run failed before training: rank 0 builds the same run and reports bad input itself,
    then ends the job (this rank leaves silently, :func:`_watch_rank0`). Return only if rank 0 goes on."""
    if _watch.deferred:
        return
    _watch.deferred = True
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not _rank0_gone():
        time.sleep(0.1)


def joined() -> bool:
    """Whether this rank's process group formed: rank 0 joins it only once its run is valid."""
    torch_dist = sys.modules.get("torch.distributed")
    return bool(torch_dist and torch_dist.is_available() and torch_dist.is_initialized())


def _watch_rank0(exit_code: int = 3) -> None:
    """Block on rank 0's pipe: a stop byte or its end means rank 0 ended the job or died. Leave at once — quietly
    if the process group never formed (rank 0 refused the run and said why), else saying why."""
    fd = int(os.environ[RANK0_FD_ENV])
    try:
        stopped = os.read(fd, 1) == _STOP
    except OSError:
        stopped = False
    if joined():
        why = "ended the job (its error says why)" if stopped else "(the launching process) is gone"
        with contextlib.suppress(Exception):
            print(f"parallelkit: rank {os.environ.get('RANK', '?')} stops: rank 0 {why}.", file=sys.stderr, flush=True)
    else:
        exit_code = 0
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os._exit(exit_code)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def install_spawn(fn: Callable[[list[str], dict[str, str], int], Any]) -> None:
    """Replace how a rank is created (the test harness's fork); ``fn`` takes what :func:`spawn` takes."""
    global spawn
    spawn = fn


