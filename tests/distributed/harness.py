"""Run a function on N real gloo ranks and bring its results back to the test.

Every distributed test goes through :func:`run_ranks`::

    def _train(rank: int, world_size: int, steps: int) -> dict:   # module level: it is pickled by name
        ...                                                         # the default group is initialised
        return {"loss": losses, "weight": model.weight.detach()}

    def test_something(tmp_path):
        results = run_ranks(_train, 2, tmp_path, 5)                # results[r] is what rank r returned
        torch.testing.assert_close(results[0]["weight"], results[1]["weight"])

Why it is built this way:

- ``forkserver`` with torch preloaded: a rank is forked from a server that imported torch once, so a rank
  starts in well under a second instead of paying the torch import again (spawn), and without inheriting
  pytest's threads and state (fork).
- Results travel as bytes (``torch.save``), one message per rank over its own pipe. Tensors pickled through
  ``multiprocessing`` are shared-memory handles that dangle once the child exits.
- gloo sometimes aborts at interpreter shutdown *after* the work is done. A rank that delivered its result
  therefore does ``barrier`` → ``destroy_process_group`` → flush → ``os._exit(0)``, never a normal
  interpreter exit; the parent counts a rank as successful only if it delivered a result *and* exited 0.
- A hard deadline kills hung ranks; an exception in a rank comes back with its rank and traceback, and the
  other ranks (likely blocked in a collective waiting for it) are killed shortly after.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_PG_TIMEOUT_S = 60.0
# After one rank fails, how long the others get to report their own error before they are killed.
ERROR_GRACE_S = 3.0

_OK, _ERROR, _TEARDOWN = "ok", "error", "teardown"


class RankFailure(AssertionError):
    """One or more ranks raised, hung, crashed, or exited non-zero. The message says which and why."""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    tmp_path: str | os.PathLike,
    *args: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes and return their results by rank.

    Each rank initialises the default process group (``backend``, a ``file://`` rendezvous in a fresh
    directory under ``tmp_path``, collectives timing out after ``pg_timeout_s``), sets
    ``torch.set_num_threads(1)``, and calls ``fn``. The harness tears the process group down. A rank's
    stdout/stderr are not reliably attached to the test that started it (ranks are forked from a server
    started by the first test): whatever a test needs goes through the return value or an exception.

    Args:
        fn: a module-level function (it is pickled by reference). Its return value must be
            ``torch.save``-able: python containers, numbers, strings and CPU tensors (gradients are
            detached for you). Return plain tensors, not DTensors (call ``full_tensor()`` first).
        world_size: number of ranks.
        tmp_path: a directory for the rendezvous file (pytest's ``tmp_path``); calling ``run_ranks`` several
            times with the same directory is fine.
        *args: passed to ``fn`` after ``rank, world_size``; pickled, so keep them small and picklable
            (seeds and sizes, not big tensors: build the data inside ``fn`` from a seed).
        timeout_s: hard deadline for the whole run (start, work, teardown). Hung ranks are killed.
        pg_timeout_s: timeout of each collective and of the rendezvous.
        backend: process group backend.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        RankFailure: a rank raised (its traceback is in the message), did not finish before the deadline,
            or exited with a non-zero code / a signal even after delivering its result.
    """
    if world_size < 1:
        raise ValueError(f"world_size should be an int greater than 0. Got {world_size!r}.")
    ctx = multiprocessing.get_context("forkserver")
    # Only takes effect when the server starts (the first call). Lightning too: ranks that run a Trainer then
    # start in a fraction of a second instead of importing it (~2 s each on 2 cores).
    ctx.set_forkserver_preload(["torch", "lightning.pytorch"])
    rdzv_dir = Path(tempfile.mkdtemp(prefix="rdzv_", dir=tmp_path))  # a fresh store file per run
    init_method = f"file://{rdzv_dir / 'store'}"

    procs: list[Any] = []
    conns: dict[int, Any] = {}
    with _importable_in_children(fn):
        for rank in range(world_size):
            receiver, sender = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                args=(sender, fn, rank, world_size, args, init_method, backend, pg_timeout_s),
                name=f"rank{rank}",
            )
            proc.start()
            sender.close()  # the child holds its own copy; closing ours lets us see EOF if it dies
            procs.append(proc)
            conns[rank] = receiver
    try:
        messages, error_order, stopped = _collect(procs, conns, timeout_s)
    finally:
        _kill(procs)
        for conn in conns.values():
            conn.close()
    return _results_or_raise(fn, procs, messages, error_order, stopped, timeout_s)


# ------------------------------------------------------------------------------------------------ child
def _rank_main(conn, fn, rank, world_size, args, init_method, backend, pg_timeout_s) -> None:
    """Body of one rank. Never returns: ends in ``os._exit`` (see module docstring)."""
    code = 1
    try:
        torch.set_num_threads(1)
        if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo"):
            # All ranks are on this host: loopback always works, whatever the hostname resolves to.
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        try:
            dist.init_process_group(
                backend,
                init_method=init_method,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=pg_timeout_s),
            )
            payload = _to_bytes(fn(rank, world_size, *args))
        except BaseException:  # noqa: BLE001 - everything goes back to the parent, with the rank
            conn.send((_ERROR, traceback.format_exc()))
        else:
            conn.send((_OK, payload))
            # Only after a success: after an error the peers may never reach the barrier.
            try:
                if dist.is_initialized():  # tolerate an fn that tore the group down itself
                    dist.barrier()
                    dist.destroy_process_group()
            except BaseException:  # noqa: BLE001
                conn.send((_TEARDOWN, traceback.format_exc()))
            else:
                code = 0
    except BaseException:  # noqa: BLE001 - the pipe itself failed: stderr is all that is left
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _to_bytes(result: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(_detach(result), buffer)
    return buffer.getvalue()


def _detach(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _detach(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_detach(v) for v in obj)
    return obj


# ----------------------------------------------------------------------------------------------- parent
def _collect(procs: list, conns: dict, timeout_s: float) -> tuple[dict[int, list], list[int], str | None]:
    """Read every rank's messages until its pipe closes, and wait for every rank to exit, until the deadline.

    Pipes are drained while waiting: a rank blocks in ``send`` until its result is read, so joining first
    would deadlock on results bigger than the pipe buffer.

    Returns the messages by rank, the ranks in the order they failed (raised or exited non-zero: the
    first is most likely the cause, the others its echo), and why waiting stopped early: ``None``,
    ``"deadline"`` or ``"error"``.
    """
    deadline = time.monotonic() + timeout_s
    messages: dict[int, list] = {rank: [] for rank in conns}
    error_order: list[int] = []
    open_conns = dict(conns)
    sentinels = {proc.sentinel: proc for proc in procs}
    while open_conns or sentinels:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return messages, error_order, "error" if error_order else "deadline"
        by_conn = {conn: rank for rank, conn in open_conns.items()}
        for ready in wait([*by_conn, *sentinels], timeout=remaining):
            if ready in sentinels:
                proc = sentinels.pop(ready)
                proc.join()
                rank = procs.index(proc)
                if proc.exitcode != 0 and rank not in error_order:
                    error_order.append(rank)
                continue
            rank = by_conn[ready]
            try:
                messages[rank].append(ready.recv())
            except (EOFError, OSError):
                del open_conns[rank]  # the rank exited (or died): nothing more will come
                continue
            if messages[rank][-1][0] != _OK and rank not in error_order:
                error_order.append(rank)
                # The other ranks are probably stuck in a collective with this one: give them a moment
                # to report their own errors, then stop waiting.
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
    return messages, error_order, None


def _kill(procs: list) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=10)


def _results_or_raise(fn, procs, messages, error_order, stopped, timeout_s) -> list[Any]:
    problems = {}
    causes = set()  # failures in the rank's own work, as opposed to echoes in the final barrier
    for rank, proc in enumerate(procs):
        kinds = dict(messages[rank])  # at most one of each kind
        killed_by_us = stopped is not None and proc.exitcode == -9
        if _ERROR in kinds:
            problems[rank] = f"rank {rank} raised:\n{kinds[_ERROR]}"
            causes.add(rank)
        elif _OK not in kinds and killed_by_us:
            why = f"did not finish within {timeout_s:.0f} s" if stopped == "deadline" else "was still running"
            problems[rank] = f"rank {rank} {why} and was killed"
        elif _OK not in kinds:
            problems[rank] = f"rank {rank} died without delivering a result ({_describe_exit(proc.exitcode)})"
            causes.add(rank)
        elif proc.exitcode != 0:
            # Delivered, then failed in barrier/teardown: still a failure, exit codes are read by users.
            how = "was killed while waiting in the final barrier" if killed_by_us else _describe_exit(proc.exitcode)
            detail = f":\n{kinds[_TEARDOWN]}" if _TEARDOWN in kinds else ""
            if _TEARDOWN not in kinds and not killed_by_us:
                causes.add(rank)  # e.g. gloo's abort at exit
            problems[rank] = f"rank {rank} delivered its result but then {how}{detail}"
    if problems:
        name = getattr(fn, "__qualname__", repr(fn))
        failed = [r for r in error_order if r in problems]
        first = ([r for r in failed if r in causes] + failed)[:1] if len(problems) > 1 else []
        ordered = first + [r for r in sorted(problems) if r not in first]
        header = f"{name} on {len(procs)} ranks failed" + (f" (rank {first[0]} failed first)" if first else "")
        raise RankFailure(header + ":\n" + "\n".join(problems[r] for r in ordered))
    return [torch.load(io.BytesIO(dict(messages[rank])[_OK]), weights_only=False) for rank in range(len(procs))]


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "was still running"
    if exitcode < 0:
        return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class _importable_in_children:
    """Make sure the children can import the modules of ``fn`` and of this harness by name.

    A child receives the parent's ``sys.path`` and imports pickled functions by module name. pytest's
    default import mode puts the test's root on ``sys.path``, but ``--import-mode=importlib`` does not;
    then add, while the ranks start, the directory that makes each module's dotted name resolve to its file.
    """

    def __init__(self, fn: Callable) -> None:
        modules = {sys.modules.get(getattr(fn, "__module__", "") or ""), sys.modules[__name__]}
        roots = {root for root in map(_import_root, modules) if root}
        self.roots = sorted(root for root in roots if root not in sys.path)

    def __enter__(self) -> None:
        sys.path.extend(self.roots)

    def __exit__(self, *exc: Any) -> None:
        for root in self.roots:
            sys.path.remove(root)


def _import_root(module: Any) -> str | None:
    """The directory from which ``module.__name__`` imports as ``module.__file__``, if there is one."""
    path = getattr(module, "__file__", None)
    if module is None or path is None or module.__name__ == "__main__":
        return None
    parts = Path(path).resolve().with_suffix("").parts
    names = module.__name__.split(".")
    if Path(path).stem == "__init__":
        names.append("__init__")
    if list(parts[-len(names):]) != names:
        return None
    return str(Path(*parts[: -len(names)]))
