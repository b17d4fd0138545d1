"""Counts the bytes each collective parallelkit issues makes this rank send, as the backend really sends them.

Collectives are counted into a ``CommStats`` at the collective boundary (:mod:`parallelkit.distributed.comm_counting`:
one kernel on torch's ``c10d`` operators, labelled with a *kind* — ``grad_allreduce``, ``metrics``, ... — by the
code that issues them); :meth:`CommStats.record` remains for traffic that is no collective (the parameter
server's RPCs) and for figures worked out by hand. The count is what the algorithm the group's backend runs
writes to the wire from this rank (:func:`wire_bytes`), not an ideal algorithm's:

- **gloo** (CPU; measured here with torch 2.13, and read from gloo's sources): all-reduce is a ring over
  ``max(2n, ⌈S / 1 MiB⌉)`` segments (2(n−1)/n·S); ``reduce_scatter_tensor`` is that same all-reduce of the
  whole input followed by a local slice (2(n−1)/n·S, not (n−1)/n: ProcessGroupGloo has no reduce-scatter);
  all-gather a ring of 2(n−1) half-shards ((n−1)·s); all-to-all n−1 direct sends; broadcast a binomial
  tree (the root sends ⌈log₂ n⌉ copies, inner nodes relay); reduce a ring reduce-scatter of
  ``numSegments − 2`` segments plus a gather of each rank's chunk to the root; send/recv one message; a
  barrier ⌈log₂ n⌉ empty messages each way.
  Every message of gloo's TCP transport carries a 48-byte preamble, and each transfer costs the sender
  two (a send-ready notice and the data's header) and the receiver one (a recv-ready notice): counted too,
  since they dominate small collectives (a 64-byte all-reduce writes 640 bytes from each of 2 ranks).
- **nccl** and anything else: the bandwidth-optimal ring figures the ZeRO and Megatron-LM papers use
  (all-reduce 2(n−1)/n·S, reduce-scatter and all-to-all (n−1)/n·S, all-gather (n−1)·s, broadcast and
  reduce S from every rank of the ring but one); NCCL's own protocol overhead is not modelled.

Traffic is kept per *phase*: training (what ``comm.bytes_sent_per_step`` reports), validation, and
reporting (the end-of-run gathers of ``summary.json``), so a validation pass does not inflate the training
figure. ``tests/distributed/test_comm_stats.py`` checks :func:`wire_bytes` against the bytes each process
hands to the kernel (``/proc/self/io`` ``wchar``), byte for byte.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from functools import lru_cache
from typing import Any, Iterator, Sequence

import torch

TRAIN = "train"
VALIDATION = "validation"
REPORT = "report"
PHASES = (TRAIN, VALIDATION, REPORT)

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce", "gather", "scatter", "send", "recv", "barrier")

#: gloo's TCP transport: every message starts with a 6 × 8-byte preamble (gloo/transport/tcp/pair.cc).
GLOO_PREAMBLE = 48
#: what one transfer costs its sender beyond the payload (NOTIFY_SEND_READY + the data's preamble) ...
GLOO_SEND_OVERHEAD = 2 * GLOO_PREAMBLE
#: ... and its receiver (NOTIFY_RECV_READY).
GLOO_RECV_OVERHEAD = GLOO_PREAMBLE
#: gloo's ring all-reduce and reduce split buffers into segments of at most this many bytes (measured).
GLOO_MAX_SEGMENT = 1 << 20


class CommStats:
    """Per-process counters of collective calls and bytes sent, grouped by phase and kind.

    Example::

        stats = CommStats()
        stats.record("grad_allreduce", bucket_tensor, "all_reduce", group)
        with stats.counting_as(VALIDATION):
            ...                                  # collectives of a validation pass
        stats.totals()   # training only: {"bytes": ..., "collectives": 1, "by_kind": {...}}
    """

    def __init__(self) -> None:
        self._bytes: dict[str, dict[str, int]] = {p: defaultdict(int) for p in PHASES}
        self._calls: dict[str, dict[str, int]] = {p: defaultdict(int) for p in PHASES}
        self.phase = TRAIN

    @contextlib.contextmanager
    def counting_as(self, phase: str) -> Iterator[None]:
        """Count what happens inside the block under ``phase`` (one of :data:`PHASES`)."""
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    def record(self, kind: str, payload: torch.Tensor | int, op: str | None = None, group: Any = None, *,
               root: int | None = None, peer_bytes: Sequence[int] | None = None, element_size: int | None = None) -> int:
        """Count one collective under ``kind`` in the current phase; returns the bytes counted.

        Args:
            payload: the tensor handed to the collective (or its size in bytes): the whole buffer for
                all-reduce, reduce-scatter, all-to-all, broadcast and reduce, this rank's shard for
                all-gather, gather and scatter, the message for send / recv. Without ``op`` it is taken as the bytes sent.
            op: the collective (one of :data:`OPS`).
            group: its process group (``None``: the default group). An ``int`` stands for a group of that
                many ranks of unknown backend, counted at the ring figures (theory, no process group needed).
            root: broadcast / reduce / gather: the root's *global* rank.
            peer_bytes: all-to-all with unequal splits: the bytes of the input going to each group rank.
            element_size: with an ``int`` payload, its element size (segments are whole elements).
        """
        if op is None:
            nbytes = payload if isinstance(payload, int) else _nbytes(payload)
        else:
            nbytes = collective_bytes(payload, op, group, root=root, peer_bytes=peer_bytes, element_size=element_size)
        return self.add(kind, nbytes)

    def add(self, kind: str, nbytes: int) -> int:
        """Count one collective of ``nbytes`` already worked out (the counting kernel's entry) in the current phase."""
        self._bytes[self.phase][kind] += int(nbytes)
        self._calls[self.phase][kind] += 1
        return int(nbytes)

    def reset(self) -> None:
        for phase in PHASES:
            self._bytes[phase].clear()
            self._calls[phase].clear()

    def bytes(self, kind: str | None = None, phase: str = TRAIN) -> int:
        counts = self._bytes[phase]
        return sum(counts.values()) if kind is None else counts.get(kind, 0)

    def calls(self, kind: str | None = None, phase: str = TRAIN) -> int:
        counts = self._calls[phase]
        return sum(counts.values()) if kind is None else counts.get(kind, 0)

    def totals(self, phase: str = TRAIN) -> dict:
        counts, calls = self._bytes[phase], self._calls[phase]
        return {
            "bytes": self.bytes(phase=phase),
            "collectives": self.calls(phase=phase),
            "by_kind": {k: {"bytes": counts[k], "collectives": calls[k]} for k in sorted(counts)},
        }

    def per_step(self, steps: int) -> dict:
        """Mean bytes and collectives per optimizer step of the training phase, overall and by kind."""
        steps = max(int(steps), 1)
        counts, calls = self._bytes[TRAIN], self._calls[TRAIN]
        return {
            "bytes_sent_per_step": self.bytes() / steps,
            "collectives_per_step": self.calls() / steps,
            "by_kind": {
                k: {"bytes_per_step": counts[k] / steps, "collectives_per_step": calls[k] / steps}
                for k in sorted(counts)
            },
        }


def collective_bytes(payload: torch.Tensor | int, op: str, group: Any = None, *, root: int | None = None,
                     peer_bytes: Sequence[int] | None = None, element_size: int | None = None) -> int:
    """Bytes this rank writes for ``op`` on ``group`` (arguments as in :meth:`CommStats.record`), without counting them."""
    if not isinstance(payload, int):
        element_size = payload.element_size()
        payload = _nbytes(payload)
    return wire_bytes(op, payload, *_group_info(group, root), element_size=element_size or 4, peer_bytes=peer_bytes)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _group_info(group: Any, root: int | None) -> tuple[int, int, str, int]:
    """``(size, this rank's group rank, backend, root's group rank)`` of ``group``."""
    if isinstance(group, int):
        return group, 0, "ideal", 0
    import torch.distributed as dist

    if group is None:
        group = dist.group.WORLD
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    backend = str(dist.get_backend(group)) if size > 1 else "ideal"
    group_root = 0 if root is None or size == 1 else dist.get_group_rank(group, root)
    return size, rank, backend, group_root


# ------------------------------------------------------------------------------------------ the algorithms
def wire_bytes(op: str, payload_bytes: int, group_size: int, rank: int = 0, backend: str = "ideal", root: int = 0, *,
               element_size: int = 4, peer_bytes: Sequence[int] | None = None) -> int:
    """Bytes group rank ``rank`` writes for collective ``op`` on ``backend`` (``payload_bytes``: see :meth:`CommStats.record`)."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; expected one of {OPS}")
    n = int(group_size)
    if n <= 1:
        return 0
    if backend == "gloo":
        return _gloo_bytes(op, int(payload_bytes), n, rank, root, int(element_size), tuple(peer_bytes) if peer_bytes is not None else None)
    return round(_ring_bytes(op, payload_bytes, n, rank, root, peer_bytes))


def sent_bytes(op: str, payload_bytes: int, group_size: int) -> float:
    """The bandwidth-optimal (ring) figure of ``op``, as the papers' formulas count it: theory, not the wire."""
    return _ring_bytes(op, payload_bytes, int(group_size), 0, 0, None) if group_size > 1 else 0


def _ring_bytes(op: str, s: float, n: int, rank: int, root: int, peer_bytes: Sequence[int] | None) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n * s
    if op in ("reduce_scatter", "all_to_all"):
        if peer_bytes is not None:
            return sum(b for r, b in enumerate(peer_bytes) if r != rank)
        return (n - 1) / n * s
    if op == "all_gather":
        return (n - 1) * s
    if op == "broadcast":  # a ring/chain from the root: every rank but the last one forwards the buffer
        return 0 if rank == (root - 1) % n else s
    if op in ("reduce", "gather"):  # a ring/chain towards the root: every rank but the root sends
        return 0 if rank == root else s
    if op == "scatter":  # the root sends every other rank its part
        return (n - 1) * s if rank == root else 0
    if op == "send":
        return s
    return 0  # recv, barrier


def _gloo_bytes(op: str, s: int, n: int, rank: int, root: int, esize: int, peer_bytes: tuple[int, ...] | None) -> int:
    if op in ("all_reduce", "reduce_scatter"):  # ProcessGroupGloo's reduce_scatter_tensor: all-reduce + slice
        data, sends, recvs = _gloo_ring_allreduce(s, n, rank, esize)
    elif op == "all_gather":  # gloo/allgather.cc: every shard in two halves, n − 1 ring steps, empty halves too
        data, sends, recvs = (n - 1) * s, 2 * (n - 1), 2 * (n - 1)
    elif op == "all_to_all":  # gloo/alltoallv.cc: one send to and one receive from every other rank
        data = sum(b for r, b in enumerate(peer_bytes) if r != rank) if peer_bytes is not None else s - s // n
        sends = recvs = n - 1
    elif op == "broadcast":
        sends, recvs = _gloo_broadcast_messages(n, (rank - root) % n)
        data = sends * s
    elif op == "reduce":
        data, sends, recvs = _gloo_reduce(s, n, rank, root, esize)
    elif op == "gather":  # gloo/gather.cc: every rank but the root sends its shard
        data, sends, recvs = (0, 0, n - 1) if rank == root else (s, 1, 0)
    elif op == "scatter":  # gloo/scatter.cc: the root sends every other rank its part
        data, sends, recvs = ((n - 1) * s, n - 1, 0) if rank == root else (0, 0, 1)
    elif op == "send":
        data, sends, recvs = s, 1, 0
    elif op == "barrier":  # rounds of empty messages with peers 2^i away
        data, sends, recvs = 0, math.ceil(math.log2(n)), math.ceil(math.log2(n))
    else:  # recv
        data, sends, recvs = 0, 0, 1
    return data + sends * GLOO_SEND_OVERHEAD + recvs * GLOO_RECV_OVERHEAD


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@lru_cache(maxsize=4096)
def _gloo_ring_allreduce(total: int, n: int, rank: int, esize: int) -> tuple[int, int, int]:
    """gloo/allreduce.cc ``ring``: ``(payload bytes sent, sends, receives)`` of group rank ``rank``.

    Segments past the end of the buffer are skipped (no message), so a tiny all-reduce is lopsided.
    """
    if total == 0:
        return 0, 0, 0
    max_segment = esize * max(1, GLOO_MAX_SEGMENT // esize)
    segments = _round_up(max(-(-total // max_segment), 2 * n), n)
    per_rank = segments // n
    segment = _round_up(-(-total // segments), esize)
    span = segments * segment
    data = sends = recvs = 0
    for send_base, recv_base in ((rank + 1, rank + 2), (rank, rank + 1)):  # reduce-scatter, then all-gather
        for i in range(segments - per_rank):
            send_len = min(segment, total - ((send_base * per_rank + i) * segment) % span)
            recv_len = min(segment, total - ((recv_base * per_rank + i) * segment) % span)
            if recv_len > 0:
                recvs += 1
            if send_len > 0:
                sends += 1
                data += send_len
    return data, sends, recvs


@lru_cache(maxsize=4096)
def _gloo_reduce(total: int, n: int, rank: int, root: int, esize: int) -> tuple[int, int, int]:
    """gloo/reduce.cc: a ring reduce-scatter of ``segments − 2`` segments (more than (n−1)/n of the buffer
    once segments hit their size limit), then every rank but the root sends its chunk to the root."""
    if total == 0:
        return 0, 0, 0
    max_segment = esize * max(1, GLOO_MAX_SEGMENT // esize)
    segment = _round_up(min(-(-total // (2 * n)), max_segment), esize)
    segments = _round_up(max(-(-total // segment), 2 * n), n)
    per_rank = segments // n
    span = segments * segment
    data = sends = recvs = 0
    for i in range(segments - 2):
        send_len = min(segment, total - (((rank + 1) * per_rank + i) * segment) % span)
        recv_len = min(segment, total - (((rank + 2) * per_rank + i) * segment) % span)
        if recv_len > 0:
            recvs += 1
        if send_len > 0:
            sends += 1
            data += send_len
    chunk = per_rank * segment
    if rank == root:
        recvs += sum(1 for r in range(n) if r != rank and min(chunk, total - r * chunk) > 0)
    elif min(chunk, total - rank * chunk) > 0:
        sends += 1
        data += min(chunk, total - rank * chunk)
    return data, sends, recvs


def _gloo_broadcast_messages(n: int, vrank: int) -> tuple[int, int]:
    """gloo/broadcast.cc's binomial tree: ``(sends, receives)`` of virtual rank ``vrank`` (the root is 0)."""
    dim = math.ceil(math.log2(n))
    mask = (1 << dim) - 1
    sends = recvs = 0
    for i in range(dim):
        mask ^= 1 << i
        if vrank & mask:
            continue
        peer = vrank ^ (1 << i)
        if peer >= n:
            continue
        if vrank & (1 << i):
            recvs += 1
        else:
            sends += 1
    return sends, recvs
