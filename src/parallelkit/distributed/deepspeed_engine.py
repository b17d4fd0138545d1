"""DeepSpeed ZeRO as a parallelkit technique: build the engine, count its traffic, measure what it keeps.

``apply_deepspeed`` hands the model and the torch optimizer to ``deepspeed.initialize`` on the process group
that already exists (gloo on CPU, NCCL on GPU) and returns the engine. Two things DeepSpeed does not report
the way ``summary.json`` needs them are measured here:

- **Traffic.** Every collective DeepSpeed issues goes through ``deepspeed.comm``'s backend object (its ZeRO
  and engine code import ``deepspeed.comm as dist``, never ``torch.distributed``). ``count_deepspeed_comm``
  wraps that object's methods and records each call in a :class:`CommStats` under ``deepspeed_<op>``, as
  the bytes the collective's bandwidth-optimal algorithm sends from this rank (:func:`sent_bytes`). What is
  counted is exact (the tensors handed over); how gloo moves them on the wire is the algorithm's figure.
- **Memory.** ``deepspeed_state_bytes`` walks the ZeRO optimizer object graph (flat parameter buffers, fp32
  master partitions, gradient partitions, reduce buckets, the torch optimizer's state) and sums distinct
  storages once each, so a view into a flat buffer is not counted twice and a buffer nobody names in
  DeepSpeed's docs is still found.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import defaultdict
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from parallelkit.distributed.comm_stats import CommStats, sent_bytes

KIND_PREFIX = "deepspeed_"
_MAX_DEPTH = 8
# The fp32 master partitions the ZeRO optimizers step (stages 1-2, stage 3).
_MASTER_COPIES = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")


def apply_deepspeed(module: torch.nn.Module, optimizer: torch.optim.Optimizer, config: dict[str, Any], *, comm_stats: CommStats | None = None) -> Any:
    """Wrap ``module`` and ``optimizer`` in a DeepSpeed engine configured by ``config``; return the engine.

    The default process group must exist. With ``comm_stats`` every collective DeepSpeed issues from now
    on (not the parameter broadcast of its own start-up) is counted there.

    Example::

        engine = apply_deepspeed(model, torch.optim.AdamW(model.parameters()), build_deepspeed_config(2))
        loss = model.loss(engine(x), y); engine.backward(loss); engine.step()
    """
    if not dist.is_initialized():
        raise RuntimeError("apply_deepspeed needs an initialised default process group (torch.distributed).")
    deepspeed = _import_deepspeed(dist.get_backend())
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config, dist_init_required=False)
    if comm_stats is not None:
        count_deepspeed_comm(comm_stats)
    return engine


def _import_deepspeed(backend: str) -> Any:
    if backend == "gloo":
        # Otherwise DeepSpeed probes for accelerators and warns that it fell back to the CPU.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)  # its INFO lines repeat the config on every rank
    return deepspeed


# ----------------------------------------------------------------------------------------------- traffic
def _group_size(arguments: dict[str, Any]) -> int:
    return dist.get_world_size(arguments.get("group"))


def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _reduce_bytes(payload: int, n: int, root: int) -> float:
    # Bandwidth-optimal reduce: a reduce-scatter, then every rank but the root sends its slice to the root.
    return sent_bytes("reduce_scatter", payload, n) + (0 if dist.get_rank() == root else payload / n)


# Backend method → (its parameters in order, bytes this rank sends). DeepSpeed passes arguments by position,
# and its decorators hide the signatures, hence the names here (those of deepspeed.comm.torch.TorchBackend).
_COUNTERS: dict[str, tuple[tuple[str, ...], Callable[[dict[str, Any]], float]]] = {
    "all_reduce": (("tensor", "op", "group"), lambda a: sent_bytes("all_reduce", _nbytes(a["tensor"]), _group_size(a))),
    "all_reduce_coalesced": (("tensors", "op", "group"), lambda a: sent_bytes("all_reduce", _nbytes(a["tensors"]), _group_size(a))),
    "reduce": (("tensor", "dst", "op", "group"), lambda a: _reduce_bytes(_nbytes(a["tensor"]), _group_size(a), a["dst"])),
    "reduce_scatter_tensor": (("output_tensor", "input_tensor", "op", "group"), lambda a: sent_bytes("reduce_scatter", _nbytes(a["input_tensor"]), _group_size(a))),
    "reduce_scatter": (("output", "input_list", "op", "group"), lambda a: sent_bytes("reduce_scatter", _nbytes(a["input_list"]), _group_size(a))),
    "all_gather_into_tensor": (("output_tensor", "input_tensor", "group"), lambda a: sent_bytes("all_gather", _nbytes(a["input_tensor"]), _group_size(a))),
    "all_gather_base": (("output_tensor", "input_tensor", "group"), lambda a: sent_bytes("all_gather", _nbytes(a["input_tensor"]), _group_size(a))),
    "all_gather": (("tensor_list", "tensor", "group"), lambda a: sent_bytes("all_gather", _nbytes(a["tensor"]), _group_size(a))),
    "all_gather_coalesced": (("output_tensors", "input_tensors", "group"), lambda a: sent_bytes("all_gather", _nbytes(a["input_tensors"]), _group_size(a))),
    # Only the source sends (a relaying tree or ring spreads the same bytes over the others).
    "broadcast": (("tensor", "src", "group"), lambda a: _nbytes(a["tensor"]) if dist.get_rank() == a["src"] and _group_size(a) > 1 else 0),
    "all_to_all_single": (("output", "input", "output_split_sizes", "input_split_sizes", "group"), lambda a: sent_bytes("all_to_all", _nbytes(a["input"]), _group_size(a))),
}


class _CommCounter:
    """The wrappers installed on DeepSpeed's backend; ``stats`` can be re-pointed and counting paused."""

    def __init__(self, stats: CommStats) -> None:
        self.stats = stats
        self.paused = 0

    def wrap(self, op: str, method: Callable[..., Any], names: tuple[str, ...], count: Callable[[dict[str, Any]], float]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not self.paused:
                arguments = {"group": None, **dict(zip(names, args)), **kwargs}
                self.stats.record(KIND_PREFIX + op, int(count(arguments)))
            return method(*args, **kwargs)

        counted.__wrapped__ = method
        return counted


def _backend() -> Any:
    from deepspeed.comm import comm as ds_comm

    if ds_comm.cdb is None:
        raise RuntimeError("DeepSpeed's communication backend is not initialised (call deepspeed.initialize first).")
    return ds_comm.cdb


def count_deepspeed_comm(stats: CommStats) -> None:
    """Count every collective DeepSpeed issues from now on in ``stats`` (idempotent: re-points the counter)."""
    backend = _backend()
    counter = getattr(backend, "_parallelkit_counter", None)
    if counter is not None:
        counter.stats = stats
        return
    counter = _CommCounter(stats)
    for op, (names, count) in _COUNTERS.items():
        method = getattr(backend, op, None)
        if method is not None:
            setattr(backend, op, counter.wrap(op, method, names, count))
    backend._parallelkit_counter = counter


@contextlib.contextmanager
def deepspeed_comm_paused() -> Iterator[None]:
    """Collectives inside this block are not counted (checkpoint saving and loading: not training traffic)."""
    counter = getattr(_backend(), "_parallelkit_counter", None)
    if counter is None:
        yield
        return
    counter.paused += 1
    try:
        yield
    finally:
        counter.paused -= 1


# ------------------------------------------------------------------------------------------------ memory
def deepspeed_state_bytes(engine: Any) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes of model state this rank holds under ``engine`` right now, and where they are.

    Returns ``({"params", "grads", "optimizer"}, {buffer name: bytes})``. Each distinct storage is
    counted once, in the first category that claims it:

    1. params — storages behind the module's parameters (stage 3: their partitions ``ds_tensor``),
       including the flat buffers those parameters are views of;
    2. optimizer — the torch optimizer's state (Adam moments) and the tensors it steps (in ZeRO: the
       fp32 master partitions, a copy DeepSpeed keeps even when training in fp32);
    3. grads — gradients, wherever they live, and every other buffer of the ZeRO optimizer (gradient
       partitions, reduce buckets and other communication buffers), named in the breakdown.
    """
    seen: set[int] = set()
    totals = {"params": 0, "grads": 0, "optimizer": 0}
    where: dict[str, int] = defaultdict(int)

    def claim(category: str, name: str, tensor: torch.Tensor | None) -> None:
        if tensor is None or not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return  # meta tensors (DeepSpeed keeps shapes that way) hold no memory
        storage = tensor.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or key in seen:
            return
        seen.add(key)
        totals[category] += size
        where[f"{category}:{name}"] += size

    params = list(engine.module.parameters())
    for p in params:
        claim("params", "module.parameters", getattr(p, "ds_tensor", None))
        claim("params", "module.parameters", p.data)
    ds_optimizer = engine.optimizer
    base = getattr(ds_optimizer, "optimizer", ds_optimizer)  # ZeRO wraps the torch optimizer
    for group in base.param_groups:
        for p in group["params"]:
            claim("optimizer", "master_params" if base is not ds_optimizer else "optimizer.params", p)
    for attr in _MASTER_COPIES:  # stage 3 hands them to the torch optimizer only while it steps
        for tensor in _flat(getattr(ds_optimizer, attr, None)):
            claim("optimizer", "master_params", tensor)
            claim("grads", "master_params.grad", tensor.grad)
    for per_param in base.state.values():
        for name, value in per_param.items():
            claim("optimizer", f"optimizer.state.{name}", value)
    for p in params:
        claim("grads", "module.parameters.grad", p.grad)
    for group in base.param_groups:
        for p in group["params"]:
            claim("grads", "master_params.grad", p.grad)
    if ds_optimizer is not base:
        for name, tensor in _tensors_in(ds_optimizer):
            claim("grads", name, tensor)
    return totals, dict(where)


def _flat(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat(v)]
    return []


def _tensors_in(root: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor reachable from ``root`` through DeepSpeed objects, lists and dicts (not nn.Modules)."""
    visited: set[int] = set()
    stack: list[tuple[str, Any, int]] = [(name, value, 1) for name, value in vars(root).items()]
    visited.add(id(root))
    while stack:
        name, obj, depth = stack.pop()
        if isinstance(obj, torch.Tensor):
            yield name, obj
            if obj.is_leaf and obj.grad is not None:
                yield name, obj.grad
            if getattr(obj, "ds_tensor", None) is not None:
                yield name, obj.ds_tensor
            continue
        if depth > _MAX_DEPTH or id(obj) in visited or isinstance(obj, torch.nn.Module):
            continue
        visited.add(id(obj))
        if isinstance(obj, dict):
            stack.extend((name, v, depth + 1) for v in obj.values())
            stack.extend((name, k, depth + 1) for k in obj if isinstance(k, torch.Tensor))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend((name, v, depth + 1) for v in obj)
        elif type(obj).__module__.startswith("deepspeed") and hasattr(obj, "__dict__"):
            stack.extend((name, v, depth + 1) for v in vars(obj).values())
