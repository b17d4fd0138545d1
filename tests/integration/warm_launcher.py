"""Run ``python train.py ...`` jobs from a warm process: the integration tests' launcher.

Most of a tiny test job's time is its processes importing torch and Lightning (about 3.5 s of CPU per rank
on the development machine, against under a second of training). A *zygote* process imports them once;
each job is forked from it and runs ``train.py`` as ``__main__`` with the test's arguments, working
directory, environment and redirected output. The ranks a job starts (``parallelkit.launch.local_ranks``)
are forked from the job too, while it is still single-threaded and has not composed a config (before
Hydra: ``trainer.devices=N`` on the command line); each runs ``train.py`` as ``__main__`` again, with the
environment and the one open pipe a started rank gets. Later ranks (a sweep's jobs) start as real processes.

What a job does is unchanged — the same ``train.py``, Hydra composition on every rank, process groups,
exit codes and files; only ``exec`` is skipped. Tests about processes themselves (what is left behind,
how ranks are started) pass ``cold=True`` to :func:`run_train` and get a real ``subprocess`` run.

The zygote is a child of the test process, started on first use; it forks one job at a time and reports
each job's pid, then its exit status. A job runs in its own session, so a timeout kills it and its ranks.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRELOAD = ("torch", "lightning.pytorch", "hydra", "omegaconf", "parallelkit.run", "parallelkit.launch.cli",
           "parallelkit.launch.local_ranks")

_zygote: subprocess.Popen | None = None


def run_train(args: list[str], cwd: Path, env: dict[str, str], timeout: float, cold: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run([python, train.py, *args], ...)``, from the zygote unless ``cold``; same result type."""
    command = [sys.executable, str(REPO / "train.py"), *args]
    if cold or os.environ.get("PARALLELKIT_TESTS_COLD") == "1":
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    zygote = _start_zygote()
    with tempfile.TemporaryDirectory(prefix="pk_job_") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        request = {"argv": [str(REPO / "train.py"), *args], "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
        zygote.stdin.write(json.dumps(request) + "\n")
        zygote.stdin.flush()
        pid = json.loads(_read_line(zygote, 60))["pid"]
        try:
            code = json.loads(_read_line(zygote, timeout))["returncode"]
        except TimeoutError:
            os.killpg(pid, signal.SIGKILL)  # the job and its ranks
            _read_line(zygote, 60)
            raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text()) from None
        return subprocess.CompletedProcess(command, code, out.read_text(errors="replace"), err.read_text(errors="replace"))


def _read_line(zygote: subprocess.Popen, timeout: float) -> str:
    ready, _, _ = select.select([zygote.stdout], [], [], timeout)
    if not ready:
        raise TimeoutError
    line = zygote.stdout.readline()
    if not line:
        raise RuntimeError(f"the warm launcher died (exit code {zygote.poll()})")
    return line


def _start_zygote() -> subprocess.Popen:
    global _zygote
    if _zygote is None or _zygote.poll() is not None:
        _zygote = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])},
        )
        atexit.register(_zygote.kill)
    return _zygote


# ------------------------------------------------------------------------------------------- the zygote
def _serve() -> None:
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    replies = sys.stdout
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _job(request)  # never returns
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


def _job(request: dict) -> None:
    import runpy

    try:
        os.setsid()  # its own process group: a timeout kills the job and its ranks
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.close(stdin)
        # What `python train.py` would have on sys.path: the script's directory and PYTHONPATH.
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:0] = [str(Path(request["argv"][0]).parent), *extra]
        sys.argv = list(request["argv"])
        from parallelkit.launch import local_ranks

        local_ranks.install_spawn(_fork_rank)
        runpy.run_path(request["argv"][0], run_name="__main__")  # train.py ends in os._exit
        os._exit(0)
    except SystemExit as stop:
        os._exit(stop.code if isinstance(stop.code, int) else 1)
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        os._exit(1)


def _fork_rank(command: list[str], env: dict[str, str], keep_fd: int):
    """``local_ranks.spawn`` for a job forked from the zygote: fork the rank while that is safe, else start it."""
    from hydra.core.global_hydra import GlobalHydra

    from parallelkit.launch import local_ranks

    single_threaded = len(os.listdir("/proc/self/task")) == 1
    if not single_threaded or GlobalHydra.instance().is_initialized() or command[1:2] == ["-m"]:
        return subprocess.Popen(command, env=env, pass_fds=(keep_fd,), cwd=os.getcwd())
    return _ForkedRank(command, env, keep_fd, local_ranks)


class _ForkedRank:
    """A local rank forked from its job, with the ``Popen`` calls ``local_ranks`` makes (``poll``, ``wait``, ``kill``)."""

    def __init__(self, command: list[str], env: dict[str, str], keep_fd: int, local_ranks) -> None:
        self.pid = os.fork()
        self.returncode = None
        if self.pid:
            return
        try:  # the rank: what a fresh `python train.py ...` with this environment and this one pipe would have
            os.closerange(3, keep_fd)
            os.closerange(keep_fd + 1, 1 << 16)
            os.environ.clear()
            os.environ.update(env)
            from lightning.fabric.utilities.rank_zero import rank_zero_only
            from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

            rank_zero_only.rank = utils_rank_zero_only.rank = int(env["RANK"])  # read from the environment at import
            if env.get("OMP_NUM_THREADS"):  # a fresh process's torch reads it at import; this one imported torch before
                import torch

                torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
            sys.argv = list(command[1:])
            import runpy

            runpy.run_path(command[1], run_name="__main__")  # train.py ends in os._exit
        except SystemExit as stop:
            os._exit(stop.code if isinstance(stop.code, int) else 1)
        finally:
            os._exit(1)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"local rank (pid {self.pid})", timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


if __name__ == "__main__":
    _serve()
