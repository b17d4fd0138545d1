"""Name the rank that a collective timed out waiting for.

gloo's and NCCL's timeout errors do not say which peer never arrived. When a collective times out, each
rank that was waiting posts ``parallelkit/timed_out/RANK`` to the job's rendezvous store (a separate TCP
connection, still up), waits a short grace period for the others to post theirs, and names the ranks that
did not: they never reached the collective — stuck (a hang, a deadlock, a stalled file system) or far slower
than the rest. A rank that *exited* is named by the launcher instead (:mod:`parallelkit.launch.local_ranks`).
"""

from __future__ import annotations

import time

KEY = "parallelkit/timed_out/{rank}"


def is_timeout(err: BaseException) -> bool:
    text = str(err)
    return "Timed out" in text or "timed out" in text or "Socket Timeout" in text


def stuck_ranks(grace_s: float = 3.0) -> list[int]:
    """Post this rank's timeout and return the ranks that did not post theirs within ``grace_s`` (never raises)."""
    try:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        if not (dist.is_available() and dist.is_initialized()):
            return []
        store, me, world = _get_default_store(), dist.get_rank(), dist.get_world_size()
        store.set(KEY.format(rank=me), "1")
        others = [r for r in range(world) if r != me]
        deadline = time.monotonic() + grace_s
        while True:
            missing = [r for r in others if not store.check([KEY.format(rank=r)])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.1)
    except Exception:  # noqa: BLE001 - naming the culprit is a courtesy; the timeout is reported anyway
        return []


def describe(ranks: list[int]) -> str:
    if not ranks:
        return ""
    names = ", ".join(f"rank {r}" for r in ranks)
    verb = "was" if len(ranks) == 1 else "were"
    return f"{names} never reached the collective ({verb} stuck or far slower than the others)"
