"""Data parallelism: replicate the module over a process group and average gradients in buckets."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from parallelkit.distributed.comm_hooks import HookState, allreduce_hook, counting_hook, is_parallelkit_hook, is_self_counting_hook
from parallelkit.distributed.comm_stats import CommStats
from parallelkit.errors import ConfigError


def apply_ddp(
    module: torch.nn.Module,
    *,
    process_group: Any,
    device_ids: list[int] | None = None,
    bucket_cap_mb: float = 25.0,
    gradient_as_bucket_view: bool = False,
    static_graph: bool = False,
    find_unused_parameters: bool = False,
    comm_hook: Callable | None = None,
    comm_state: Any = None,
    comm_stats: CommStats | None = None,
) -> DistributedDataParallel:
    """Wrap ``module`` in DDP over ``process_group`` and register a communication hook on any device type.

    Parameters are broadcast from the group's first rank at construction, so every replica starts
    identical even if they were initialised differently.

    Args:
        module: the single-device module.
        process_group: the data-parallel group (``mesh["dp"]`` in a multi-dimensional run).
        device_ids: ``[index]`` on CUDA, ``None`` on CPU.
        bucket_cap_mb: gradient bucket size: communication fusion granularity.
        gradient_as_bucket_view: let ``.grad`` alias the bucket (saves one copy of the gradients).
        static_graph: promise the autograd graph is the same every step (enables more overlap).
        find_unused_parameters: tolerate parameters that get no gradient in some steps.
        comm_hook: a DDP comm hook; ``None`` means :func:`allreduce_hook` (an averaging all-reduce).
        comm_state: state for a third-party ``comm_hook``, or for a hook marked with
            :func:`~parallelkit.distributed.comm_hooks.counts_own_traffic` (DGC, Local SGD, hierarchical
            all-reduce), whose state holds its own group and counter; parallelkit's plain hooks build their own.
        comm_stats: where the hook counts what it sends.

    Example::

        ddp_model = apply_ddp(model, process_group=mesh.get_group("dp"), comm_stats=stats)
    """
    ddp = DistributedDataParallel(
        module,
        device_ids=device_ids,
        process_group=process_group,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=gradient_as_bucket_view,
        static_graph=static_graph,
        find_unused_parameters=find_unused_parameters,
    )
    hook = comm_hook if comm_hook is not None else allreduce_hook
    if is_parallelkit_hook(hook):
        if comm_state is not None:
            raise ConfigError(
                f"ddp_comm_state={comm_state!r} has no effect with parallelkit's {getattr(hook, 'func', hook).__name__}, "
                "which builds its own state (the data-parallel group and the traffic counter). Leave it null."
            )
        # Hydra's `_partial_: true` hands over a functools.partial, which DDP rejects (it reads __name__).
        hook = getattr(hook, "func", hook)
        ddp.register_comm_hook(HookState(process_group=process_group, stats=comm_stats), hook)
    elif is_self_counting_hook(hook):
        if comm_state is None:
            raise ConfigError(f"The comm hook {_named(hook).__name__} needs its state (comm_state); got None.")
        ddp.register_comm_hook(comm_state, _named(hook))
    else:
        state = comm_state if comm_state is not None else process_group
        ddp.register_comm_hook(state, counting_hook(hook, comm_stats) if comm_stats is not None else _named(hook))
    return ddp


def _named(hook: Callable) -> Callable:
    """DDP reads ``hook.__name__``; a functools.partial has none."""
    if not hasattr(hook, "__name__"):
        hook.__name__ = getattr(getattr(hook, "func", None), "__name__", "comm_hook")
    return hook
