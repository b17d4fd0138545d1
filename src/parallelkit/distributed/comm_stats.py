"""Counts the bytes each collective parallelkit issues makes this rank send, so ``summary.json`` reports traffic.

Every place in parallelkit that issues a collective records it here under a *kind* (``grad_allreduce``,
``metrics``, ...), with the collective's name and group size, and the count is what the algorithm sends
from this rank over the wire (:func:`sent_bytes`): a ring all-reduce of S bytes over n ranks sends
2(n−1)/n·S, an all-gather of a shard s sends (n−1)·s, a reduce-scatter or all-to-all of S sends (n−1)/n·S.
These are the figures the papers' formulas use (ZeRO, Megatron-LM); ``bench/`` checks them against the
loopback interface's byte counters.
"""

from __future__ import annotations

from collections import defaultdict

import torch


class CommStats:
    """Per-process counters of collective calls and payload bytes, grouped by kind.

    Example::

        stats = CommStats()
        stats.record("grad_allreduce", bucket_tensor)
        stats.totals()   # {"bytes": ..., "collectives": 1, "by_kind": {...}}
    """

    def __init__(self) -> None:
        self._bytes: dict[str, int] = defaultdict(int)
        self._calls: dict[str, int] = defaultdict(int)

    def record(self, kind: str, payload: torch.Tensor | int, op: str | None = None, group_size: int = 2) -> None:
        """Count one collective under ``kind``.

        ``payload`` is the tensor handed to the collective (or its size in bytes): the whole buffer for
        all-reduce, reduce-scatter and all-to-all, this rank's shard for all-gather, the message for a
        send. With ``op`` the count is what that collective sends from this rank (:func:`sent_bytes`);
        without it, ``payload`` is taken as the bytes sent.
        """
        nbytes = payload if isinstance(payload, int) else payload.numel() * payload.element_size()
        if op is not None:
            nbytes = sent_bytes(op, nbytes, group_size)
        self._bytes[kind] += int(nbytes)
        self._calls[kind] += 1

    def reset(self) -> None:
        self._bytes.clear()
        self._calls.clear()

    def bytes(self, kind: str | None = None) -> int:
        return sum(self._bytes.values()) if kind is None else self._bytes.get(kind, 0)

    def calls(self, kind: str | None = None) -> int:
        return sum(self._calls.values()) if kind is None else self._calls.get(kind, 0)

    def totals(self) -> dict:
        return {
            "bytes": self.bytes(),
            "collectives": self.calls(),
            "by_kind": {k: {"bytes": self._bytes[k], "collectives": self._calls[k]} for k in sorted(self._bytes)},
        }

    def per_step(self, steps: int) -> dict:
        """Mean bytes and collectives per optimizer step, overall and by kind."""
        steps = max(int(steps), 1)
        return {
            "bytes_sent_per_step": self.bytes() / steps,
            "collectives_per_step": self.calls() / steps,
            "by_kind": {
                k: {"bytes_per_step": self._bytes[k] / steps, "collectives_per_step": self._calls[k] / steps}
                for k in sorted(self._bytes)
            },
        }


def sent_bytes(op: str, payload_bytes: int, group_size: int) -> float:
    """Bytes one rank sends for collective ``op`` (bandwidth-optimal algorithms: ring / pairwise)."""
    n = int(group_size)
    if n <= 1:
        return 0
    factors = {
        "all_reduce": 2 * (n - 1) / n,  # ring: reduce-scatter then all-gather
        "reduce_scatter": (n - 1) / n,  # payload = the full input
        "all_to_all": (n - 1) / n,  # payload = the full input; one chunk stays home
        "all_gather": n - 1,  # payload = this rank's shard
        "broadcast": 1,  # payload sent once by the source (a tree/ring relays it)
        "send": 1,
    }
    if op not in factors:
        raise ValueError(f"unknown collective {op!r}; expected one of {sorted(factors)}")
    return payload_bytes * factors[op]
