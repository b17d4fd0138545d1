"""DDP communication hooks that count what they send, and work on every backend (gloo included).

A hook receives a gradient bucket and returns a future with the reduced bucket. parallelkit's own hooks
label the collective they issue (:func:`~parallelkit.distributed.comm_counting.counting`), so the byte count is
what really went to the process group (half of the bucket for the fp16 hook). torch's PowerSGD hook, run by
:func:`compression_hook`, is counted the same way while its futures run. Any other hook is wrapped by
:func:`counting_hook`, which records the bucket it was handed under ``grad_hook_input`` (an estimate: a
third-party hook's own collectives are not claimed by anyone).
"""


from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist

# No `from __future__ import annotations` here: DDP checks the hooks' annotations at run time.

from parallelkit.distributed.comm_counting import counting, counting_until
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
    with counting(state.stats, GRAD_ALLREDUCE):
        work = dist.all_reduce(tensor, group=state.process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def fp16_compress_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in fp16 (half the bytes), then write it back in the bucket's dtype.

    torch ships ``bf16_compress_hook`` too, but gloo cannot all-reduce bf16; fp16 works on every backend.
    """
    buffer = bucket.buffer()
    compressed = buffer.to(torch.float16).div_(dist.get_world_size(state.process_group))
    with counting(state.stats, GRAD_ALLREDUCE):
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


def counts_own_traffic(hook: Callable) -> Callable:
    """Mark a hook that records every collective it issues in its own state's counter.

    :func:`~parallelkit.distributed.data_parallel.apply_ddp` registers such a hook with the state it is
    given, unwrapped (wrapping it in :func:`counting_hook` would count the bucket a second time).
    """
    hook._parallelkit_counts_traffic = True
    return hook


def is_self_counting_hook(hook: Callable) -> bool:
    return bool(getattr(getattr(hook, "func", hook), "_parallelkit_counts_traffic", False))


def is_parallelkit_hook(hook: Callable) -> bool:
    """True for hooks of this module, which take a :class:`HookState` and count exactly."""
    base = getattr(hook, "func", hook)  # functools.partial from Hydra's _partial_
    return base in (allreduce_hook, fp16_compress_hook)


# ---------------------------------------------------------------------------------------------------------
# Gradient compression with torch's hooks (fp16 / PowerSGD), counted exactly.

POWERSGD_ALLREDUCE = "powersgd_allreduce"
COMPRESSION_METHODS = ("fp16", "bf16", "powersgd")


@dataclass
class CompressionState:
    """A compressing hook (``inner``, with ``inner_state``) and what its traffic would have been uncompressed."""

    method: str
    inner: Callable
    inner_state: Any
    process_group: Any
    stats: Optional[CommStats] = None
    dense_bytes: float = 0.0  # what a plain all-reduce of the same buckets would have sent (same backend)
    buckets: int = 0
    layout: Any = None  # powersgd: a PowerSGDLayout, which keeps its per-bucket state in step with DDP's buckets


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Run the compressing hook; remember the uncompressed cost for the compression ratio."""
    from parallelkit.distributed.comm_stats import collective_bytes

    state.dense_bytes += collective_bytes(bucket.buffer(), "all_reduce", state.process_group)
    state.buckets += 1
    if state.method != "powersgd":
        return state.inner(state.inner_state, bucket)
    if state.layout is not None:
        state.layout.before_hook(state.inner_state, bucket)
    # PowerSGD issues its later all-reduces from the future's callbacks, after this call returned.
    return counting_until(lambda: state.inner(state.inner_state, bucket), state.stats, POWERSGD_ALLREDUCE,
                          group=state.process_group)


compression_hook._parallelkit_counts_traffic = True


def build_compression_hook(method: str, process_group: Any, stats: Optional[CommStats] = None, **powersgd: Any) -> Tuple[Callable, CompressionState]:
    """``(hook, state)`` for ``method`` = ``fp16`` (parallelkit's counting fp16 hook), ``bf16`` (torch's,
    NCCL only) or ``powersgd`` (torch's PowerSGD with ``powersgd`` = PowerSGDState arguments)."""
    if method == "fp16":
        inner, inner_state = fp16_compress_hook, HookState(process_group, stats)
    elif method == "bf16":
        backend = dist.get_backend(process_group)
        if backend == "gloo":
            raise ValueError("bf16 gradient compression (torch's bf16_compress_hook) cannot run on gloo, which has no "
                             "bfloat16 all-reduce; use method=fp16 (works on every backend), or a GPU run (nccl)")
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
            bf16_compress_hook,
        )

        inner, inner_state = counting_hook(bf16_compress_hook, stats) if stats is not None else bf16_compress_hook, process_group
    elif method == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
            PowerSGDState,
            powerSGD_hook,
        )

        from parallelkit.distributed.powersgd_state import PowerSGDLayout

        inner, inner_state = powerSGD_hook, PowerSGDState(process_group=process_group, **powersgd)
        return compression_hook, CompressionState(method, inner, inner_state, process_group, stats, layout=PowerSGDLayout())
    else:
        raise ValueError(f"unknown compression method {method!r}; expected one of {COMPRESSION_METHODS}")
    return compression_hook, CompressionState(method, inner, inner_state, process_group, stats)
