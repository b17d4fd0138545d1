"""Counts what parallelkit hands to collectives, so ``summary.json`` reports measured traffic.

Numbers are payload bytes handed to a collective by this rank (an all-reduce of N bytes counts N; the
wire traffic of a ring all-reduce is about 2(n-1)/n of that). Every place in parallelkit that issues a
collective records it here under a *kind* (``grad_allreduce``, ``metrics``, ...).
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

    def record(self, kind: str, payload: torch.Tensor | int) -> None:
        """Count one collective of ``payload`` (a tensor, or a byte count) under ``kind``."""
        nbytes = payload if isinstance(payload, int) else payload.numel() * payload.element_size()
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
