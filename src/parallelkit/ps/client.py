"""The worker side: pull rows, push gradients (or geo deltas), one request per server, all in flight at once.

Rows are hash-partitioned: id ``i`` lives on server ``i mod S`` (ids are hashed feature values already,
so the modulus spreads them evenly). A batch's ids are deduplicated before anything is sent, so a step
moves ``U`` ids and rows (``U`` = unique ids in the batch), whatever the table size:

    pull: U ids (int64) out, U rows (fp32) back;  push: U ids + U gradient rows out
    → U · (8 + 4·D) · 2 bytes per step per worker, both directions.

What the worker *sends* (ids out, ids and gradient rows out: U · (16 + 4·D)) is counted under the kind ``ps``
in :class:`~parallelkit.distributed.comm_stats.CommStats`; the rows it receives are the servers' sends, kept
apart in ``bytes_received``. Tensor payloads only: TensorPipe's framing (the pickled call and its descriptor,
about 0.5 KiB per request, measured over TCP) is not counted. Pulls outside training (validation) count as
``ps_eval``. RPC traffic is no ``c10d`` collective, so the counting layer at the collective boundary
(:mod:`parallelkit.distributed.comm_counting`) does not see it: the client records it itself
(:meth:`CommStats.record`), the one place in parallelkit that does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.rpc as rpc

from parallelkit.distributed.comm_stats import CommStats
from parallelkit.ps import server as srv
from parallelkit.ps.table import TableShard, TableSpec

PS = "ps"
PS_EVAL = "ps_eval"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class PSClient:
    """A worker's connection to the parameter servers.

    Args:
        servers: RPC names of the server ranks (server ``k`` owns ids with ``id % len(servers) == k``).
        worker: this worker's index (``0 .. num_workers - 1``).
        num_workers: workers in the job.
        mode: ``sync`` (every step waits for all workers), ``async`` or ``geo``.
        geo_k_steps: geo mode: push parameter deltas every this many steps.
        comm_stats: where the bytes are counted.
        round_barrier: geo mode: waits until every worker has pushed its deltas of this sync round (the
            strategy's barrier over the workers' group), so each re-pull sees all of them, whatever the
            scheduling. Without it a worker that re-pulls before another pushed keeps that worker's change
            out of its copy for another round, and the outcome depends on which process the OS ran first
            (measured end to end: validation AUC 0.27–1.11 % behind sync from run to run under load; with it,
            0.49 % every time).

    Example::

        client = PSClient(["rank2"], worker=0, num_workers=2, mode="sync")
        client.create_table(TableSpec("emb", dim=16))
        rows = client.lookup("emb", torch.tensor([3, 7]))
        client.step({"emb": (torch.tensor([3, 7]), grads)}, lr=0.1)
    """

    def __init__(
        self,
        servers: list[str],
        worker: int,
        num_workers: int,
        mode: str,
        geo_k_steps: int = 1,
        comm_stats: CommStats | None = None,
        round_barrier: Callable[[], None] | None = None,
    ) -> None:
        if mode not in srv.MODES:
            raise ValueError(f"mode must be one of {srv.MODES}. Got {mode!r}.")
        self.servers = list(servers)
        self.worker = worker
        self.num_workers = num_workers
        self.mode = mode
        self.geo_k_steps = geo_k_steps
        self.round_barrier = round_barrier
        self.comm_stats = comm_stats if comm_stats is not None else CommStats()
        self.specs: dict[str, TableSpec] = {}
        self.steps_done = 0  # optimizer steps of the tables so far (sync mode: the version a pull needs)
        self.first_step = 0  # steps_done when this process started (a resumed run starts at the checkpoint's step)
        self.touched: dict[str, set[int]] = {}  # every id this worker used in training (memory accounting)
        self.unique_ids_pulled = 0  # Σ over training forwards of U (the bytes formula)
        self.bytes_received = 0  # rows the servers sent back to this worker's training pulls
        # Rows moved by training pulls / pushes and the wall time the worker spent in them (the requests to all
        # servers in flight at once, so this is the latency of the slowest; a sync pull also waits there until
        # the other workers' pushes completed the step).
        self.rows_pulled = self.rows_pushed = 0
        self.pull_s = self.push_s = 0.0
        self._geo: dict[str, tuple[TableShard, TableShard]] = {}  # geo mode: (local rows, rows at last sync)
        self._dirty: dict[str, set[int]] = {}  # geo mode: rows trained locally since the last sync

    # ------------------------------------------------------------------ tables
    def create_table(self, spec: TableSpec) -> None:
        futures = [rpc.rpc_async(s, srv.rpc_create_table, args=(spec.as_dict(),)) for s in self.servers]
        torch.futures.wait_all(futures)
        self.specs[spec.name] = spec
        self.touched.setdefault(spec.name, set())
        if self.mode == "geo":
            self._geo[spec.name] = (TableShard(spec), TableShard(TableSpec(spec.name, spec.dim, "sgd")))

    def _partition(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Positions (into ``ids``) of the ids each server owns."""
        owner = torch.remainder(ids, len(self.servers))
        return [torch.nonzero(owner == k).flatten() for k in range(len(self.servers))]

    # ------------------------------------------------------------------ pull / push
    def pull(self, name: str, ids: torch.Tensor, min_version: int | None = None, kind: str = PS) -> torch.Tensor:
        """Rows of ``ids`` (unique, int64) from their servers, all requests in flight at once."""
        start = time.perf_counter()
        out = torch.empty(len(ids), self.specs[name].dim)
        requests = []
        for k, pos in enumerate(self._partition(ids)):
            if len(pos):
                part = ids[pos]
                # Reads outside training do not create rows: the table holds only rows that training touched.
                create = kind == PS
                requests.append((pos, rpc.rpc_async(self.servers[k], srv.rpc_pull, args=(name, part, min_version, create))))
        for pos, future in requests:
            rows = future.wait()
            out[pos] = rows
            self.comm_stats.record(kind, _nbytes(ids[pos]))  # ids out (the rows back are the server's sends)
            if kind == PS:
                self.bytes_received += _nbytes(rows)
        if kind == PS:
            self.rows_pulled += len(ids)
            self.pull_s += time.perf_counter() - start
        return out

    def push(self, name: str, ids: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        """One request per server (all in flight at once); each is applied whole or not at all (see server.py)."""
        start = time.perf_counter()
        futures = []
        for k, pos in enumerate(self._partition(ids)):
            # Sync mode: every server hears from every worker each step, even with no rows, to complete it.
            if len(pos) or self.mode == "sync":
                part_ids, part_grads = ids[pos], grads[pos].contiguous()
                futures.append(rpc.rpc_async(self.servers[k], srv.rpc_push, args=(name, self.steps_done, self.worker, part_ids, part_grads, lr)))
                self.comm_stats.record(PS, _nbytes(part_ids) + _nbytes(part_grads))
        torch.futures.wait_all(futures)
        self.rows_pushed += len(ids)
        self.push_s += time.perf_counter() - start

    def push_delta(self, name: str, ids: torch.Tensor, delta: torch.Tensor) -> None:
        start = time.perf_counter()
        futures = []
        for k, pos in enumerate(self._partition(ids)):
            if len(pos):
                futures.append(rpc.rpc_async(self.servers[k], srv.rpc_push_delta, args=(name, ids[pos], delta[pos].contiguous())))
                self.comm_stats.record(PS, _nbytes(ids[pos]) + _nbytes(delta[pos]))
        torch.futures.wait_all(futures)
        self.rows_pushed += len(ids)
        self.push_s += time.perf_counter() - start

    # ------------------------------------------------------------------ what the model and the strategy call
    def lookup(self, name: str, ids: torch.Tensor, training: bool = True) -> torch.Tensor:
        """Current rows for ``ids`` (unique): from the servers, or geo mode's local copy."""
        kind = PS if training else PS_EVAL
        if training:
            self.touched[name].update(ids.tolist())
            self.unique_ids_pulled += len(ids)
        if self.mode == "geo":
            local, base = self._geo[name]
            cached = torch.tensor([i in local.slot_of for i in ids.tolist()], dtype=torch.bool)
            out = torch.empty(len(ids), self.specs[name].dim)
            if not bool(cached.all()):
                missing = ids[~cached]
                out[~cached] = rows = self.pull(name, missing, kind=kind)
                if training:  # only training rows join the local copy (and are synced later)
                    local.overwrite(missing, rows)
                    base.overwrite(missing, rows)
            if bool(cached.any()):
                out[cached] = local.pull(ids[cached])
            return out
        # Sync: rows as of all steps this worker has pushed, i.e. after the same updates a single process made.
        return self.pull(name, ids, self.steps_done if self.mode == "sync" else None, kind=kind)

    def step(self, grads: dict[str, tuple[torch.Tensor, torch.Tensor]], lr: float) -> None:
        """One optimizer step of the tables: ``grads[name] = (unique ids, summed gradient rows)``."""
        for name in self.specs:
            ids, grad = grads.get(name, (torch.empty(0, dtype=torch.int64), torch.empty(0, self.specs[name].dim)))
            if self.mode == "geo":
                if len(ids):
                    self._geo[name][0].apply(ids, grad, lr)  # train the local copy
                    self._dirty.setdefault(name, set()).update(ids.tolist())
            else:
                self.push(name, ids, grad, lr)
        self.steps_done += 1
        if self.mode == "geo" and self.steps_done % self.geo_k_steps == 0:
            self.geo_sync()

    def geo_sync(self) -> None:
        """Send what the local copies changed since the last sync, then refresh those rows from the servers.

        Only rows trained since the last sync travel (as in Fleet's GeoCommunicator); a cached row this
        worker did not train keeps its older value until it trains it again. Every worker pushes, then (with
        ``round_barrier``) waits for the others before re-pulling: the workers already meet at every step's
        dense all-reduce, so this costs one small collective every ``geo_k_steps`` and makes the round's
        outcome independent of scheduling.
        """
        pushed = []
        for name, (local, base) in self._geo.items():
            dirty = self._dirty.pop(name, set())
            if dirty:
                ids = torch.tensor(sorted(dirty), dtype=torch.int64)
                self.push_delta(name, ids, local.pull(ids) - base.pull(ids))
                pushed.append((name, ids))
        if self.round_barrier is not None:
            self.round_barrier()  # called by every worker every round, pushed rows or not
        for name, ids in pushed:
            local, base = self._geo[name]
            fresh = self.pull(name, ids)
            local.overwrite(ids, fresh)  # optimizer state (e.g. Adagrad's accumulator) stays local
            base.overwrite(ids, fresh)

    # ------------------------------------------------------------------ service
    def server_stats(self) -> list[dict[str, Any]]:
        return [rpc.rpc_sync(s, srv.rpc_stats) for s in self.servers]

    def server_peak_rss_bytes(self) -> list[int]:
        return [rpc.rpc_sync(s, srv.rpc_peak_rss_bytes) for s in self.servers]

    def snapshot(self, directory: str, step: int | None = None) -> list[str]:
        """Every server writes its tables to ``directory/server{k}-step{step}.pt`` (:func:`~parallelkit.ps.server.snapshot_file`;
        ``step`` defaults to this worker's steps; sync mode: after that step is complete on every server)."""
        step = self.steps_done if step is None else step
        paths = [srv.snapshot_file(directory, k, step) for k in range(len(self.servers))]
        version = step if self.mode == "sync" else None
        torch.futures.wait_all([rpc.rpc_async(s, srv.rpc_snapshot, args=(p, version, step)) for s, p in zip(self.servers, paths)])
        return paths

    def drop_snapshots(self, directory: str, keep_step: int) -> None:
        """Every server deletes its snapshots in ``directory`` but the one of ``keep_step``."""
        torch.futures.wait_all([rpc.rpc_async(s, srv.rpc_drop_snapshots, args=(directory, k, keep_step)) for k, s in enumerate(self.servers)])

    def restore(self, directory: str, step: int | None = None) -> list[dict[str, int]]:
        """Every server loads its snapshot of ``step`` (default: this worker's steps) from ``directory``; returns their table versions."""
        step = self.steps_done if step is None else step
        paths = [srv.snapshot_file(directory, k, step) for k in range(len(self.servers))]
        futures = [rpc.rpc_async(s, srv.rpc_restore, args=(p, step)) for s, p in zip(self.servers, paths)]
        return [f.wait() for f in futures]

    def start_at(self, step: int) -> None:
        """A resumed run: the tables are at optimizer step ``step`` (sync pulls ask for that version on)."""
        self.steps_done = self.first_step = step

    def done(self, failure: str | None = None) -> None:
        """Tell every server this worker has finished (or failed); servers stop once all workers are done."""
        futures = [rpc.rpc_async(s, srv.rpc_worker_done, args=(self.worker, failure), timeout=10) for s in self.servers]
        for future in futures:
            try:
                future.wait()
            except Exception:  # noqa: BLE001 - a server already gone cannot be told; nothing else to do
                if failure is None:
                    raise
