"""The server side: tables held by this process, and the functions workers call on it over RPC.

A server rank calls :func:`serve`, which blocks until every worker has said it is done (or one failed,
or no request came for ``idle_timeout_s``). The request handlers run on TensorPipe's worker threads;
one lock per server keeps them atomic. A handler that gets a bad request (unknown table, wrong width,
ids that are not a 1-D int64 tensor) raises, which TensorPipe sends back to the caller as an error
reply: the server itself keeps serving.

Sync mode: a push is held until every worker has pushed that step; then the gradients are summed in
worker order (so the float result does not depend on arrival order), divided by the number of workers
(the mean over the global batch, as one process computes it) and applied once; the table's version
becomes ``step + 1``. A pull names the version it needs and waits for it, so no worker reads rows of
a step that is not complete. Async mode applies each push on arrival (scaled by ``1 / workers``) and
never waits. Geo mode adds parameter deltas on arrival.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from parallelkit.process_stats import peak_rss_bytes
from parallelkit.ps.table import TableShard, TableSpec

MODES = ("sync", "async", "geo")
_server: ParameterServer | None = None


def snapshot_file(directory: str | os.PathLike, server: int, step: int) -> str:
    """Server ``server``'s snapshot of the tables after ``step`` optimizer steps, in a checkpoint's ``NAME_ps/``.

    The step is in the name so that a snapshot and the checkpoint of the same step always go together:
    the servers write theirs first, then the checkpoint is written, then older snapshots are dropped; a job
    killed anywhere in between still finds the snapshot of the step its last complete checkpoint holds.
    """
    return f"{os.fspath(directory)}/server{server}-step{step}.pt"


class ParameterServer:
    """The tables (shards) this process holds and the bookkeeping of sync-mode steps.

    Args:
        num_workers: workers that push each sync step.
        mode: ``sync``, ``async`` or ``geo``.
        wait_timeout_s: how long a sync-mode pull waits for a step to complete before it fails.
    """

    def __init__(self, num_workers: int, mode: str, wait_timeout_s: float = 120.0) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}. Got {mode!r}.")
        self.num_workers = num_workers
        self.mode = mode
        self.wait_timeout_s = wait_timeout_s
        self.tables: dict[str, TableShard] = {}
        self.version: dict[str, int] = {}
        self._pending: dict[tuple[str, int], dict[int, tuple[torch.Tensor, torch.Tensor, float]]] = {}
        self._cond = threading.Condition()
        self.done_workers: set[int] = set()
        self.failure: str | None = None
        self.last_request = time.monotonic()

    # ------------------------------------------------------------------ requests
    def create_table(self, spec: dict[str, Any]) -> None:
        with self._cond:
            self._touch()
            new = TableSpec(**spec)
            old = self.tables.get(new.name)
            if old is None:
                self.tables[new.name] = TableShard(new)
                self.version[new.name] = 0
            elif old.spec != new:
                raise ValueError(f"table {new.name!r} exists with {old.spec}, a worker asked for {new}")

    def pull(self, name: str, ids: torch.Tensor, min_version: int | None, create: bool = True) -> torch.Tensor:
        with self._cond:
            self._touch()
            shard = self._table(name)
            _check_ids(ids)
            self._wait_version(name, min_version)
            return shard.pull(ids) if create else shard.peek(ids)

    def _wait_version(self, name: str, min_version: int | None) -> None:
        """With the lock held: wait until table ``name`` has applied ``min_version`` sync steps."""
        if min_version is None:
            return
        deadline = time.monotonic() + self.wait_timeout_s
        while self.version[name] < min_version:
            if self.failure or not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"table {name!r}: step {min_version} did not complete ({self.failure or 'timeout'})")

    def push(self, name: str, step: int, worker: int, ids: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        with self._cond:
            self._touch()
            shard = self._table(name)
            _check_ids(ids)
            _check_rows(shard, ids, grads)
            if self.mode == "async":
                shard.apply(ids, grads / self.num_workers, lr)
                return
            if self.mode != "sync":
                raise ValueError(f"push is for sync/async mode; this server runs mode={self.mode}")
            if step != self.version[name]:
                raise ValueError(f"table {name!r}: worker {worker} pushed step {step}, the table is at step {self.version[name]}")
            pending = self._pending.setdefault((name, step), {})
            pending[worker] = (ids, grads, lr)
            if len(pending) == self.num_workers:
                del self._pending[(name, step)]
                parts = [pending[w] for w in sorted(pending)]  # worker order: the same float sum every run
                all_ids = torch.cat([p[0] for p in parts])
                unique, inverse = torch.unique(all_ids, return_inverse=True)
                total = torch.zeros(len(unique), shard.spec.dim).index_add_(0, inverse, torch.cat([p[1] for p in parts]))
                if len(unique):
                    shard.apply(unique, total / self.num_workers, parts[0][2])
                self.version[name] = step + 1
                self._cond.notify_all()

    def push_delta(self, name: str, ids: torch.Tensor, delta: torch.Tensor) -> None:
        with self._cond:
            self._touch()
            shard = self._table(name)
            _check_ids(ids)
            _check_rows(shard, ids, delta)
            shard.add(ids, delta / self.num_workers)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {name: {**shard.stats(), "version": self.version[name]} for name, shard in self.tables.items()}

    def snapshot(self, path: str, min_version: int | None = None, step: int | None = None) -> None:
        """Write every table (rows, optimizer state, versions) to ``path``, atomically.

        Sync mode: ``min_version`` waits until every table has applied that many steps, so the snapshot
        holds a whole step, as the workers' checkpoint of the same step does. ``step`` (the workers'
        optimizer step) is recorded in the file. The file is written under a temporary name, flushed to
        disk and renamed: a server killed while writing leaves the previous file (or none), never half a one.
        """
        with self._cond:
            for name in self.tables:
                self._wait_version(name, min_version)
            state = {"tables": {n: s.state_dict() for n, s in self.tables.items()}, "version": dict(self.version), "step": step}
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(target)

    def restore(self, path: str, step: int | None = None) -> dict[str, int]:
        """Load a snapshot (all of it, or nothing on error); ``step``: the one the caller expects it to hold."""
        with self._cond:
            state = torch.load(path, weights_only=False)
            if step is not None and state.get("step") not in (None, step):
                raise ValueError(f"snapshot {path} holds step {state['step']}, the checkpoint is of step {step}")
            tables = {n: TableShard.from_state_dict(s) for n, s in state["tables"].items()}
            for name, shard in tables.items():
                if name in self.tables and self.tables[name].spec != shard.spec:
                    raise ValueError(f"snapshot {path}: table {name!r} is {shard.spec}, the workers asked for {self.tables[name].spec}")
            self.tables = tables
            self.version = dict(state["version"])
            self._pending.clear()  # pushes of steps after the snapshot are void
            self._cond.notify_all()
            return dict(self.version)

    def drop_snapshots(self, directory: str, server: int, keep_step: int) -> None:
        """Delete this server's snapshots in ``directory`` other than the one of ``keep_step`` (and stray temp files)."""
        keep = Path(snapshot_file(directory, server, keep_step))
        for old in [*Path(directory).glob(f"server{server}-step*.pt"), *Path(directory).glob(f"server{server}-step*.pt.*.tmp")]:
            if old != keep:
                old.unlink(missing_ok=True)

    def worker_done(self, worker: int, failure: str | None) -> None:
        with self._cond:
            self._touch()
            self.done_workers.add(worker)
            if failure and not self.failure:
                self.failure = f"worker {worker} failed: {failure}"
            self._cond.notify_all()

    # ------------------------------------------------------------------ serving loop
    def wait_until_done(self, idle_timeout_s: float) -> None:
        """Block until all workers are done; raise if one failed or none spoke for ``idle_timeout_s``."""
        with self._cond:
            while len(self.done_workers) < self.num_workers and not self.failure:
                self._cond.wait(timeout=1.0)
                if time.monotonic() - self.last_request > idle_timeout_s:
                    raise TimeoutError(f"no worker request for {idle_timeout_s:.0f} s: the workers are gone")
            if self.failure:
                raise RuntimeError(f"parameter server stops: {self.failure}")

    def _touch(self) -> None:
        self.last_request = time.monotonic()

    def _table(self, name: str) -> TableShard:
        if not isinstance(name, str) or name not in self.tables:
            raise KeyError(f"unknown table {name!r}; this server holds {sorted(self.tables)}")
        return self.tables[name]


def _check_ids(ids: Any) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
        raise ValueError(f"ids must be a 1-D int64 tensor; got {getattr(ids, 'dtype', type(ids))} of shape {tuple(getattr(ids, 'shape', ()))}")


def _check_rows(shard: TableShard, ids: torch.Tensor, rows: Any) -> None:
    if not isinstance(rows, torch.Tensor) or rows.shape != (len(ids), shard.spec.dim) or rows.dtype != torch.float32:
        raise ValueError(
            f"table {shard.spec.name!r} has width {shard.spec.dim}: expected float32 rows of shape ({len(ids)}, {shard.spec.dim}); "
            f"got {getattr(rows, 'dtype', type(rows))} {tuple(getattr(rows, 'shape', ()))}"
        )


# ---------------------------------------------------------------------- RPC entry points
# Module-level functions: RPC pickles them by name and runs them in the server process on its
# ``_server``. Each one is a request a worker may send.
def start_server(num_workers: int, mode: str, wait_timeout_s: float = 120.0) -> ParameterServer:
    """Make this process a server. Call it before the RPC agent starts, so no request finds no server."""
    global _server
    _server = ParameterServer(num_workers, mode, wait_timeout_s)
    return _server


def current() -> ParameterServer:
    if _server is None:
        raise RuntimeError("this process is not a parameter server (start_server was not called)")
    return _server


def rpc_create_table(spec: dict[str, Any]) -> None:
    current().create_table(spec)


def rpc_pull(name: str, ids: torch.Tensor, min_version: int | None, create: bool = True) -> torch.Tensor:
    return current().pull(name, ids, min_version, create)


def rpc_push(name: str, step: int, worker: int, ids: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
    current().push(name, step, worker, ids, grads, lr)


def rpc_push_delta(name: str, ids: torch.Tensor, delta: torch.Tensor) -> None:
    current().push_delta(name, ids, delta)


def rpc_stats() -> dict[str, Any]:
    return current().stats()


def rpc_peak_rss_bytes() -> int:
    """This server process's peak resident set size: what holding the tables really cost."""
    return peak_rss_bytes()


def rpc_snapshot(path: str, min_version: int | None = None, step: int | None = None) -> None:
    current().snapshot(path, min_version, step)


def rpc_restore(path: str, step: int | None = None) -> dict[str, int]:
    return current().restore(path, step)


def rpc_drop_snapshots(directory: str, server: int, keep_step: int) -> None:
    current().drop_snapshots(directory, server, keep_step)


def rpc_worker_done(worker: int, failure: str | None = None) -> None:
    current().worker_done(worker, failure)
