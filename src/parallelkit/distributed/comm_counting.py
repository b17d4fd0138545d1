"""The one place where traffic is counted: a kernel at the collective boundary, labelled by its owners.

Every collective torch issues on a process group, whoever issues it, ends in one of the ``c10d`` operators
(``c10d::allreduce_``, ``c10d::_allgather_base_``, ``c10d::send``, ...): ``torch.distributed``'s functions,
DDP's C++ reducer, FSDP2's all-gathers and reduce-scatters, the functional collectives DTensor lowers to
(their kernels call the process group, which dispatches these operators), ``torch.distributed.pipelining``'s
sends, DeepSpeed's ``deepspeed.comm`` (a thin layer over ``torch.distributed``). :func:`install` registers one
Python kernel per operator on the ``BackendSelect`` dispatch key: the last key before the backend's own
kernel, and one that every call dispatches through whatever its tensors (inference tensors too) and whatever
keys the caller has excluded (DTensor's implicit redistributions run inside its dispatch, where the autograd
and ``ADInplaceOrView`` keys are off). The kernel counts the call, then redispatches to the backend's kernel.
The cost is one Python call per collective, nothing per tensor operation.

*What* a collective is counted as is said by its owner: a strategy, a technique or a callback wraps the code
that issues it in :func:`counting` with its :class:`~parallelkit.distributed.comm_stats.CommStats` and a kind
(``grad_allreduce``, ``metrics``, ``tp_block.{op}``, ...). The innermost context that claims a collective
(optionally only some operations, ``ops``, or one process group, ``group``) counts it; a collective that no
context claims is not counted (model wrapping, checkpoint I/O, a library's own start-up), and
:func:`uncounted` hides a block from the contexts around it. Contexts are process-wide, not thread-local:
PowerSGD issues all-reduces from a future's callback on gloo's thread, CUDA's backward runs in other threads.
The phase (training, validation, reporting) stays the ``CommStats``' own (``counting_as``).

Bytes are those the algorithm of the group's backend writes from this rank
(:func:`~parallelkit.distributed.comm_stats.wire_bytes`), from the operator's own arguments: its tensors,
its process group (size, this rank, backend) and its root (a group rank here).

The parameter server's RPC traffic (:mod:`parallelkit.ps.client`) is no collective: the client records it
itself.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from parallelkit.distributed.comm_stats import CommStats, wire_bytes

#: a kind: a name, a name with ``{op}`` in it (``tp.{op}`` → ``tp.all_reduce``), or ``op -> name``.
Kind = str | Callable[[str], str]


@dataclass(frozen=True, eq=False)
class _Claim:
    stats: CommStats | None  # None: an uncounted block
    kind: Kind
    ops: frozenset[str] | None
    group: Any
    count_if: Callable[[torch.Tensor], bool] | None = None

    def matches(self, op: str, group: Any) -> bool:
        return (self.ops is None or op in self.ops) and (self.group is None or self.group is group)

    def name(self, op: str) -> str:
        kind = self.kind(op) if callable(self.kind) else self.kind
        return kind.format(op=op) if "{" in kind else kind


_BACKEND_SELECT = torch._C.DispatchKeySet(torch._C.DispatchKey.BackendSelect)
_claims: tuple[_Claim, ...] = ()  # innermost last; replaced whole, so the kernel reads a consistent tuple
_lock = threading.Lock()  # claims end in other threads too (a future's callback)
_library: Any = None


@contextlib.contextmanager
def counting(stats: CommStats | None, kind: Kind, *, ops: Sequence[str] | None = None, group: Any = None,
             count_if: Callable[[torch.Tensor], bool] | None = None) -> Iterator[None]:
    """Count the collectives issued while the block runs (in any thread) in ``stats`` under ``kind``.

    Args:
        stats: where to count; ``None`` leaves the block as it is (a component built without a counter).
        kind: the label (see :data:`Kind`).
        ops: claim only these collectives (names of :data:`~parallelkit.distributed.comm_stats.OPS`);
            others go to the contexts around this one (the pipeline's sends inside a tensor-parallel step).
        group: claim only the collectives on this process group.
        count_if: of the collectives claimed, count only those whose (first) tensor passes; the others are
            claimed and not counted (the pipeline's shape inference: byte and integer tensors).

    Example::

        with counting(stats, "grad_allreduce"):
            dist.all_reduce(flat, group=group)        # counted once, at the algorithm gloo runs
    """
    if stats is None:
        yield
        return
    install()
    with _claimed(_Claim(stats, kind, frozenset(ops) if ops is not None else None, group, count_if)):
        yield


def start_counting(stats: CommStats, kind: Kind, *, ops: Sequence[str] | None = None, group: Any = None) -> Any:
    """:func:`counting` without a block, for claims that end in a hook or a future's callback: returns the
    token to hand to :func:`stop_counting` (which may run in another thread)."""
    install()
    claim = _Claim(stats, kind, frozenset(ops) if ops is not None else None, group)
    _push(claim)
    return claim


def stop_counting(token: Any) -> None:
    _pop(token)


def counting_until(start: Callable[[], torch.futures.Future], stats: CommStats | None, kind: Kind, *,
                   group: Any = None) -> torch.futures.Future:
    """Call ``start`` and claim the collectives on ``group`` until the future it returns has completed.

    For code that goes on issuing collectives from a future's callbacks after the call that started it has
    returned (torch's PowerSGD hook). Returns the future to wait on (the claim ends before it completes).
    """
    if stats is None:
        return start()
    token = start_counting(stats, kind, group=group)
    try:
        future = start()
    except BaseException:
        stop_counting(token)
        raise

    def done(fut: torch.futures.Future) -> Any:
        stop_counting(token)
        return fut.value()

    return future.then(done)


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Collectives inside the block are not counted by any context around it (checkpoint saving and loading)."""
    with _claimed(_Claim(None, "", None, None)):
        yield


@contextlib.contextmanager
def _claimed(claim: _Claim) -> Iterator[None]:
    _push(claim)
    try:
        yield
    finally:
        _pop(claim)


def _push(claim: _Claim) -> None:
    global _claims
    with _lock:
        _claims = (*_claims, claim)


def _pop(claim: _Claim) -> None:  # by identity: a claim that ends in another thread leaves the others in place
    global _claims
    with _lock:
        _claims = tuple(c for c in _claims if c is not claim)


def install() -> None:
    """Register the counting kernel on every ``c10d`` collective operator (once per process; idempotent)."""
    global _library
    with _lock:
        if _library is not None:
            return
        import torch.distributed  # defines the c10d operators

        library = torch.library.Library("c10d", "IMPL")
        for name, (group_arg, describe) in _OPERATORS.items():
            library.impl(name, _kernel(getattr(torch.ops.c10d, name).default, group_arg, describe), "BackendSelect", with_keyset=True)
        _library = library


def _kernel(op: Any, group_arg: int, describe: Callable[[tuple], list[tuple]]) -> Callable[..., Any]:
    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        claims = _claims
        if claims:
            _count(claims, args, args[group_arg], describe)
        return op.redispatch(keyset - _BACKEND_SELECT, *args, **kwargs)

    return kernel


def _count(claims: tuple[_Claim, ...], args: tuple, boxed_group: Any, describe: Callable[[tuple], list[tuple]]) -> None:
    from torch._C._distributed_c10d import ProcessGroup

    group = ProcessGroup.unbox(boxed_group)
    parts = describe(args)
    claim = next((c for c in reversed(claims) if c.matches(parts[0][0], group)), None)
    if claim is None or claim.stats is None:
        return
    if claim.count_if is not None and not claim.count_if(_first_tensor(args)):
        return
    size, rank = group.size(), group.rank()
    backend = _backend(group) if size > 1 else "ideal"
    for op, payload, element_size, root, peer_bytes in parts:
        nbytes = wire_bytes(op, payload, size, rank, backend, root, element_size=element_size, peer_bytes=peer_bytes)
        claim.stats.add(claim.name(op), nbytes)


def _backend(group: Any) -> str:
    import torch.distributed as dist

    try:
        return str(dist.get_backend(group))
    except (ValueError, RuntimeError):  # a group torch.distributed does not know by this object
        return group.name()


# ------------------------------------------------------------------- what each operator hands over
def _bytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_bytes(t) for t in tensors)


def _esize(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.element_size()
    return _esize(tensors[0]) if len(tensors) else 4


def _first_tensor(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _one(op: str, tensors: Any, root: int = 0, peer_bytes: list[int] | None = None) -> list[tuple]:
    """One collective over ``tensors`` (a list is flattened into one buffer, as gloo does)."""
    return [(op, _bytes(tensors), _esize(tensors), root, peer_bytes)]


def _alltoall_base(args: tuple) -> list[tuple]:
    _, inp, _, _, in_splits = args[:5]
    peer_bytes = None
    if in_splits:
        row = _bytes(inp) // max(inp.shape[0], 1)
        peer_bytes = [int(n) * row for n in in_splits]
    return _one("all_to_all", inp, peer_bytes=peer_bytes)


# c10d operator → (index of its process group argument, its collective(s) as (op, payload, element size,
# root group rank, bytes per peer)). Payloads as CommStats.record takes them: the whole buffer for
# all-reduce, reduce-scatter, all-to-all, broadcast and reduce, this rank's part for all-gather, gather and
# scatter. gloo reduce-scatters a coalesced list tensor by tensor, and all-reduces / all-gathers it flattened.
_OPERATORS: dict[str, tuple[int, Callable[[tuple], list[tuple]]]] = {
    "allreduce_": (1, lambda a: _one("all_reduce", a[0])),
    "allreduce_coalesced_": (1, lambda a: _one("all_reduce", a[0])),
    "allgather_": (2, lambda a: _one("all_gather", a[1])),
    "_allgather_base_": (2, lambda a: _one("all_gather", a[1])),
    "allgather_coalesced_": (2, lambda a: _one("all_gather", a[1])),
    "allgather_into_tensor_coalesced_": (2, lambda a: _one("all_gather", a[1])),
    "_reduce_scatter_base_": (2, lambda a: _one("reduce_scatter", a[1])),
    "reduce_scatter_": (2, lambda a: _one("reduce_scatter", a[1])),
    "reduce_scatter_tensor_coalesced_": (2, lambda a: [p for t in a[1] for p in _one("reduce_scatter", t)]),
    "alltoall_base_": (2, _alltoall_base),
    "alltoall_": (2, lambda a: _one("all_to_all", a[1], peer_bytes=[_bytes(t) for t in a[1]])),
    "broadcast_": (1, lambda a: _one("broadcast", a[0], root=a[2])),
    "reduce_": (1, lambda a: _one("reduce", a[0], root=a[3])),
    "gather_": (2, lambda a: _one("gather", a[1], root=a[3])),
    "scatter_": (2, lambda a: _one("scatter", a[0], root=a[3])),
    "send": (1, lambda a: _one("send", a[0])),
    "recv_": (1, lambda a: _one("recv", a[0])),
    "recv_any_source_": (1, lambda a: _one("recv", a[0])),
    "barrier": (1, lambda a: [("barrier", 0, 4, 0, None)]),
}
