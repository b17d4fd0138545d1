"""What this process has used so far, as the OS counts it (peak resident memory, bytes handed to ``write``), and
the bytes of model state it holds (parameters, gradients, optimizer state: a DTensor counts its local shard).

Neutral ground: the run summary (``callbacks/run_summary.py``), the strategies' per-rank traffic and the
parameter-server processes all report these, and none should import another layer's module to do it.
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def os_bytes_written() -> int:
    """Bytes this process handed to the kernel's write calls (Linux ``/proc/self/io`` ``wchar``; 0 elsewhere).

    gloo's TCP transport sends with ``writev``, so this counts the collective traffic that really leaves the
    process (plus its file writes) — per process, unlike the loopback interface's counter, which other jobs
    on the machine also move. ``bench/memory.py`` takes the difference of a long and a short run.
    """
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _local_bytes(tensor: Any) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # DTensor: this rank's shard
    return local.numel() * local.element_size()


def model_state_bytes(module: Any, optimizers: list[Any]) -> dict[str, int]:
    """Bytes of the parameters, gradients and optimizer state this rank holds now (torch is not imported here)."""
    params = list(module.parameters()) if module is not None else []
    state = 0
    for optimizer in optimizers:
        for per_param in optimizer.state.values():
            state += sum(_local_bytes(v) for v in per_param.values() if hasattr(v, "element_size"))
    return {
        "params": sum(_local_bytes(p) for p in params),
        "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": state,
    }

