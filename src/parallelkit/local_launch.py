"""Start the local ranks of a job at once, before anyone imports torch and Lightning.

Lightning's launcher starts ranks 1..N-1 from inside ``trainer.fit``, when rank 0 has already imported
torch and Lightning and built the data and model: the ranks start one after the other and the job pays
the start-up twice (about 3 s on 2 CPU cores). Here rank 0 starts them first thing — before it imports
Hydra when ``trainer.devices=N`` is on the command line (:func:`start_before_hydra`, called by
``train.py``), else right after Hydra composed the config — as ``python -m parallelkit.local_child``:
they import torch and Lightning while rank 0 composes, receive the composed config from rank 0
(:func:`send_config`; they never run Hydra themselves), and build the data, model and trainer in
parallel with it. Each child then waits on its stdin, just before training, until rank 0 has validated
the run (:func:`release_or_wait`): bad input still stops the job before any other rank trains or writes
anything, with one message from rank 0 (a child that fails while building defers to rank 0's verdict
and leaves quietly when rank 0 stops). After the go, the child's stdin stays open: rank 0 writes "stop" and
closes it when it ends the job early, and a bare end of it means rank 0 died; either way the child leaves
at once (:func:`_watch_rank0`) instead of waiting in a collective rank 0 will never join. Lightning sees
``LOCAL_RANK`` in the environment and treats the processes as externally created, as under torchrun.

Used only when the local process count is known from the config alone (``trainer.devices`` an int > 1,
one node, no torchrun/SLURM); otherwise Lightning's launcher starts the ranks as usual.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

EARLY_CHILD_ENV = "PARALLELKIT_EARLY_CHILD"
FORK_ENV = "PARALLELKIT_FORK_LOCAL_RANKS"  # fork the ranks instead of starting them (see _ForkedRank)
_GO = b"go\n"
_STOP = b"stop\n"  # rank 0 ends the job early (abort); a bare end of stdin means rank 0 died
_children: list[subprocess.Popen] = []
_env_before: dict[str, str] | None = None  # the environment before start_local_ranks set the launch variables
_store = None  # the job's TCPStore server, hosted by rank 0 from release() to finish()
_trained = False  # this process has started training once (a sweep's later jobs): never fork it again
_released = False  # an early-started child has had rank 0's go
_going: threading.Event | None = None  # set from release() to finish(): the children are training with rank 0
_PARENT_PID = os.getppid()  # an early-started child's rank 0 (a forked rank resets it)


# Hydra overrides that describe the sweep, not the job: a child must not inherit them.
_SWEEP_ONLY = ("hydra.mode", "hydra.run.dir", "hydra.sweep", "hydra.job.name", "hydra.output_subdir", "hydra/launcher", "hydra/sweeper", "hydra.launcher", "hydra.sweeper")


def hydra_job_command(local_rank: int) -> list[str]:
    """The command that re-creates the current Hydra job (not the whole ``-m`` sweep) as ``local_rank``."""
    import __main__
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    if getattr(__main__, "__spec__", None) is None:  # `python train.py`, or the installed `parallelkit` script:
        command = [sys.executable, os.path.abspath(sys.argv[0])]  # its interpreter runs it, as the shebang would
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


def wants_early_launch(cfg, already: int = 0) -> int:
    """The number of local processes to start now, or 0 to leave it to Lightning.

    ``already``: the processes :func:`start_before_hydra` started (its ``LOCAL_RANK=0`` is then this
    process's own, not a launcher's).
    """
    if not already and any(key in os.environ for key in ("LOCAL_RANK", "RANK", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS")):
        return 0  # a child, or an external launcher already started the processes
    trainer = cfg.get("trainer") or {}
    devices, nodes = trainer.get("devices"), trainer.get("num_nodes", 1)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 2 or nodes != 1:
        return 0
    return devices


# Command-line flags after which Hydra does not run a job (help, config printing, sweeps), or runs many.
_NO_SINGLE_JOB = ("-m", "--multirun", "-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-p", "--package",
                  "--resolve", "-sc", "--shell-completion", "--experimental-rerun")


def devices_on_command_line(argv: list[str]) -> int:
    """``N`` if ``argv`` runs one Hydra job with ``trainer.devices=N`` (N > 1, one node), else 0."""
    if any(key in os.environ for key in ("LOCAL_RANK", "RANK", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS")):
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


def start_before_hydra(argv: list[str] | None = None) -> None:
    """In ``train.py``, before Hydra is imported: start the local ranks if the command line says how many.

    The composed config confirms the count later (:func:`start_local_ranks`); if it does not agree, these
    children are stopped unused.
    """
    count = devices_on_command_line(sys.argv[1:] if argv is None else argv)
    if count:
        start_local_ranks(count)


def start_local_ranks(num_processes: int) -> None:
    """Start ranks 1..N-1 of this job (once); they wait for :func:`send_config`, then for :func:`release`."""
    if _children:
        if len(_children) == num_processes - 1:
            return  # started before Hydra, for the count the composed config confirms
        abort()  # started for a count the config does not confirm (they exit unused)
    global _env_before
    _env_before = dict(os.environ)
    port = os.environ.get("MASTER_PORT") or str(_free_port())
    os.environ.update(
        MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        MASTER_PORT=port,
        NODE_RANK="0",
        WORLD_SIZE=str(num_processes),
        LOCAL_RANK="0",
    )
    fork = os.environ.get(FORK_ENV) == "1" and not _trained  # a process that has trained (threads) is not forked
    for local_rank in range(1, num_processes):
        env = {**os.environ, "LOCAL_RANK": str(local_rank), EARLY_CHILD_ENV: "1"}
        if fork:
            _children.append(_ForkedRank(env))
        else:
            # The job's own command line after "--": ignored by the child, but `ps` shows whose rank it is.
            command = [sys.executable, "-m", "parallelkit.local_child", "--", *sys.argv]
            _children.append(subprocess.Popen(command, env=env, stdin=subprocess.PIPE, cwd=os.getcwd()))


class _ForkedRank:
    """A local rank forked from this process (``PARALLELKIT_FORK_LOCAL_RANKS=1``), with the ``Popen`` calls
    this module uses (``stdin``, ``poll``, ``wait``, ``kill``).

    Only for a launching process that has imported torch and Lightning but run nothing yet (no threads, no
    process group): the test suite's warm launcher, which saves every job's ranks their imports.
    """

    def __init__(self, env: dict[str, str]) -> None:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the rank
            try:
                os.close(write)
                for sibling in _children:  # the write ends of earlier ranks' stdin: they must see EOF from rank 0 only
                    sibling.stdin.close()
                _children.clear()
                os.dup2(read, 0)
                os.close(read)
                os.environ.clear()
                os.environ.update(env)
                from parallelkit import local_child

                local_child.main(forked=True)
            finally:
                os._exit(1)
        os.close(read)
        self.pid, self.stdin, self.returncode = pid, os.fdopen(write, "wb"), None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"local rank (pid {self.pid})", timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def started() -> int:
    """How many processes this job has if its ranks were started early (0: not started)."""
    return len(_children) + 1 if _children else 0


def send_config(cfg) -> None:
    """Hand the composed config to the waiting children (resolved: they have no Hydra context of their own).

    Each also gets its output directory, its own log file (``<job>_rank<k>.log``, the file Hydra would have
    given it), the script's directory (``python train.py`` makes it importable, for ``_target_``\ s there)
    and the working directory (the ``parallelkit`` command and ``python -m parallelkit`` make that importable).
    """
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(cfg, resolve=True)
    logging_cfg, out, job = None, None, "train"
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            hc = HydraConfig.get()
            out, job = hc.runtime.output_dir, hc.job.name
            logging_cfg = OmegaConf.to_container(hc.job_logging, resolve=True)
    except ImportError:
        pass
    out = out or config.get("output_dir") or os.getcwd()
    for local_rank, child in enumerate(_children, start=1):
        if logging_cfg and "file" in logging_cfg.get("handlers", {}):
            logging_cfg["handlers"]["file"]["filename"] = os.path.join(out, f"{job}_rank{local_rank}.log")
        payload = {"config": {**config, "output_dir": out}, "logging": logging_cfg,
                   "script_dir": os.path.dirname(os.path.abspath(sys.argv[0])), "cwd": os.getcwd()}
        _send(child, json.dumps(payload).encode() + b"\n", close=False)


def receive_config() -> dict | None:
    """In an early-started child: the payload of :func:`send_config`, or None if rank 0 stopped first."""
    line = sys.stdin.buffer.readline()
    return json.loads(line) if line.strip() else None


def release() -> None:
    """Rank 0 validated the run: let the waiting ranks go, and watch them from now on."""
    global _going
    if _children:
        _host_store()
    for child in _children:
        _send(child, _GO, close=False)  # stdin stays open: its end tells a child that rank 0 left (_watch_rank0)
    if _children:
        _going = threading.Event()
        _going.set()
        # Ends the whole job if a child fails (like Lightning's own observer), but names the rank first.
        threading.Thread(target=_observe, args=(list(_children), _going), daemon=True, name="parallelkit-rank-observer").start()


def _observe(children: list[subprocess.Popen], going: threading.Event, period_s: float = 0.5, grace_s: float = 5.0) -> None:
    """Rank 0's watch over the ranks it started: if one dies, say which, then stop the others and itself.

    The grace period lets rank 0's own failure path (a collective that failed because the peer is gone)
    report and clean up first; this is the fallback when rank 0 is stuck elsewhere.
    """
    while True:
        time.sleep(period_s)
        if not going.is_set():
            return  # rank 0 is finishing the job itself (finish): what it kills is not a failure to report
        codes = [child.poll() for child in children]
        if all(code == 0 for code in codes):
            return
        failed = [f"rank {rank} exited with code {code}" for rank, code in enumerate(codes, start=1) if code not in (None, 0)]
        if failed:
            time.sleep(grace_s)
            if not going.is_set():
                return
            print(f"parallelkit: error: {'; '.join(failed)}; stopping the other ranks.", file=sys.stderr, flush=True)
            for child in children:
                if child.poll() is None:
                    child.kill()
            os._exit(3)


def _host_store() -> None:
    """Start the rendezvous store's server now, before the other ranks are let go.

    Otherwise rank 0 starts it inside ``init_process_group``, and a rank that gets there first finds no
    server, backs off and retries a second later: every launch lost ~0.8 s of wall time on every rank. The
    server is multi-tenant, so the store ``init_process_group`` creates on rank 0 (same port, also
    multi-tenant) shares it instead of binding the port again. ``wait_for_workers=False``: this handle does
    not count as a worker. If it cannot start (the port was taken meanwhile), ``init_process_group`` will
    say so itself. It listens on ``MASTER_ADDR``'s address only (loopback by default), not on every interface
    as torch's own server would (:mod:`parallelkit.distributed.listeners`).
    """
    global _store
    try:
        from datetime import timedelta

        import torch.distributed as dist

        from parallelkit.distributed.listeners import host_store, listen_address

        addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        address = listen_address(addr, one_machine=True)
        _store = host_store(address, port) if address else dist.TCPStore(
            addr, port, is_master=True, wait_for_workers=False, multi_tenant=True, timeout=timedelta(seconds=60))
    except Exception:  # noqa: BLE001 - an optimisation: the usual rendezvous still works (or explains)
        _store = None


def abort(grace_s: float = 3.0) -> None:
    """Rank 0 failed: close the children's stdin. A child still waiting for the go exits without a word;
    a training child exits at once too (:func:`_watch_rank0`).

    That matters because each collective of a training child needs rank 0, which is leaving, and gloo
    closes rank 0's connections only when its process exits, not when its process group is destroyed (DDP
    still holds it): the child would sit in its collective until the timeout (a SIGTERM to rank 0 took 13 s
    to end the job). A child that has not exited after ``grace_s`` (its stdin also held open by a process
    rank 0 forked, say) is killed.
    """
    for child in _children:
        _send(child, _STOP if _going is not None else b"")
    finish(timeout_s=grace_s if _going is not None else 10.0)


def finish(timeout_s: float = 60.0) -> None:
    """Wait for the children of this job, kill what is left, and forget them (a sweep starts anew, and the
    launch variables this module set are taken back)."""
    global _env_before, _store, _going
    if _going is not None:  # first: the observer must not report the ranks this kills
        _going.clear()
        _going = None
    deadline = time.monotonic() + timeout_s
    for child in _children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        _send(child, b"")
    _children.clear()
    _store = None  # the server stops once the process group's own handle is gone too
    from parallelkit.distributed.listeners import release_stores

    release_stores()
    if _env_before is not None:
        os.environ.clear()
        os.environ.update(_env_before)
        _env_before = None


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


def release_or_wait() -> None:
    """Just before training: rank 0 lets the waiting ranks go; an early-started child waits for that go."""
    global _trained
    _trained = True
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
    threading.Thread(target=_watch_rank0, daemon=True, name="parallelkit-rank0-watch").start()


def _watch_rank0(exit_code: int = 3) -> None:
    """In a released child: rank 0 closes this child's stdin only when it ends the job early (``abort``)
    or dies; the child then leaves at once with the peer-failure code instead of waiting in a collective
    that rank 0 will never join (rank 0 waits for its children before it exits normally)."""
    stopped = sys.stdin.buffer.read().startswith(_STOP)
    why = "ended the job (its error says why)" if stopped else "(the launching process) is gone"
    rank = os.environ.get("LOCAL_RANK", "?")
    try:
        print(f"parallelkit: rank {rank} stops: rank 0 {why}.", file=sys.stderr, flush=True)
        sys.stdout.flush()
    finally:
        os._exit(exit_code)


def _send(child: subprocess.Popen, data: bytes, close: bool = True) -> None:
    try:
        if data:
            child.stdin.write(data)
            child.stdin.flush()
        if close:
            child.stdin.close()
    except (BrokenPipeError, OSError, ValueError):
        pass  # the child is gone already (or its stdin closed); the observer or finish() deals with it


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

