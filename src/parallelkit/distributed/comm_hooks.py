"""DDP communication hooks that count what they send, and work on every backend (gloo included).

A hook receives a gradient bucket and returns a future with the reduced bucket. parallelkit's own hooks
issue the collective themselves, so the byte count is what really went to the process group (half of the
bucket for the fp16 hook). Any other hook (e.g. torch's PowerSGD) is wrapped by :func:`counting_hook`,
which can only see the bucket it was handed, and records it under ``grad_hook_input``.
"""


from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

# No `from __future__ import annotations` here: DDP checks the hooks' annotations at run time.

from parallelkit.distributed.comm_stats import CommStats

GRAD_ALLREDUCE = "grad_allreduce"
GRAD_HOOK_INPUT = "grad_hook_input"


@dataclass
class HookState:
    """What parallelkit's hooks need: the group to average over and where to count."""

    process_group: Any
    stats: Optional[CommStats] = None


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over ``state.process_group`` in the gradient's own dtype."""
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size(state.process_group))
    if state.stats is not None:
        state.stats.record(GRAD_ALLREDUCE, tensor)
    work = dist.all_reduce(tensor, group=state.process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def fp16_compress_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in fp16 (half the bytes), then write it back in the bucket's dtype.

    torch ships ``bf16_compress_hook`` too, but gloo cannot all-reduce bf16; fp16 works on every backend.
    """
    buffer = bucket.buffer()
    compressed = buffer.to(torch.float16).div_(dist.get_world_size(state.process_group))
    if state.stats is not None:
        state.stats.record(GRAD_ALLREDUCE, compressed)
    work = dist.all_reduce(compressed, group=state.process_group, async_op=True)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return work.get_future().then(decompress)


def counting_hook(hook: Callable, stats: CommStats) -> Callable:
    """Wrap a third-party hook so the buckets it is handed are counted (see module docstring)."""

    def wrapped(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        stats.record(GRAD_HOOK_INPUT, bucket.buffer())
        return hook(state, bucket)

    wrapped.__name__ = f"counting_{getattr(hook, '__name__', 'hook')}"
    return wrapped


def is_parallelkit_hook(hook: Callable) -> bool:
    """True for hooks of this module, which take a :class:`HookState` and count exactly."""
    base = getattr(hook, "func", hook)  # functools.partial from Hydra's _partial_
    return base in (allreduce_hook, fp16_compress_hook)
