"""What the overlap tests trace: fixed-duration compute, and when each collective was issued and completed.

:func:`burn` computes real matrix products on the calling thread (not a sleep, which would leave the core to
gloo's thread), so a collective that completes meanwhile ran beside compute. :func:`traced` wraps a collective
function so that every call appends ``{"issued", "done", ...}`` to a list: ``done`` from gloo's work future
(set on gloo's thread when the collective completed), or on return for a synchronous call.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch


def burn(seconds: float) -> None:
    """Multiply matrices on this thread until ``seconds`` have passed."""
    scratch = torch.randn(192, 192)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        scratch = torch.tanh(scratch @ scratch)


def traced(collective: Callable[..., Any], calls: list[dict], **labels: Any) -> Callable[..., Any]:
    """``collective`` that records each call in ``calls`` (with ``labels`` and the element count of its input)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        entry = {**labels, "numel": args[1].numel(), "issued": time.perf_counter()}
        work = collective(*args, **kwargs)
        if work is None:
            entry["done"] = time.perf_counter()
        else:
            work.get_future().then(lambda _: entry.__setitem__("done", time.perf_counter()))
        calls.append(entry)
        return work

    return run
