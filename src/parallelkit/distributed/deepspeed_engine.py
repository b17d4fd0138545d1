"""DeepSpeed ZeRO as a parallelkit technique: build the engine, count its traffic, measure what it keeps.

``apply_deepspeed`` hands the model and the torch optimizer to ``deepspeed.initialize`` on the process group
that already exists (gloo on CPU, NCCL on GPU) and returns the engine. Two things DeepSpeed does not report
the way ``summary.json`` needs them are measured here:

- **Traffic.** Every collective DeepSpeed issues goes through ``deepspeed.comm``'s backend object (its ZeRO
  and engine code import ``deepspeed.comm as dist``, never ``torch.distributed``). ``count_deepspeed_comm``
  wraps that object's methods and records each call in a :class:`CommStats` under ``deepspeed_<op>``, at the
  algorithm the group's backend runs (:func:`~parallelkit.distributed.comm_stats.wire_bytes`). On gloo,
  whose reduce-scatter is an all-reduce plus a slice, ZeRO-3's gradient reduce-scatter is routed through
  parallelkit's one-all-to-all reduce-scatter (:func:`~parallelkit.distributed.collectives.reduce_scatter`),
  which sends half the bytes.
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

from parallelkit.distributed.comm_stats import CommStats

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
    if dist.get_backend() == "gloo":
        _ask_device_count_once()
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config, dist_init_required=False)
    if comm_stats is not None:
        count_deepspeed_comm(comm_stats)
    return engine


def _import_deepspeed(backend: str) -> Any:
    if backend == "gloo":
        # Otherwise DeepSpeed probes for accelerators and warns that it fell back to the CPU.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import importlib

    import deepspeed

    # By module name: ``import deepspeed.comm.torch as m`` binds the attribute ``deepspeed.comm.torch``, which is
    # the torch package itself (deepspeed.comm's star import), so a patch through it would miss DeepSpeed's module.
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")

    deepspeed.utils.logger.setLevel(logging.WARNING)  # its INFO lines repeat the config on every rank
    # DeepSpeed's communication backend compiles its shared-memory all-reduce op (deepspeed_shm_comm: gcc, ~50 s
    # on a first run, cached under TORCH_EXTENSIONS_DIR) as it starts, on the CPU accelerator. The op serves
    # inference_all_reduce only (DeepSpeed's inference tensor parallelism), which training never calls and
    # which falls back to torch.distributed.all_reduce without it: start without building it.
    ds_torch_comm.build_shm_op = _no_shm_op
    # DeepSpeed gathers and reduce-scatters through torch's all_gather_into_tensor / reduce_scatter_tensor, which
    # torch 2.13 deprecates (a FutureWarning on every rank): the same collectives under their new names.
    if hasattr(dist, "all_gather_single") and hasattr(dist, "reduce_scatter_single"):
        ds_torch_comm.TorchBackend.get_all_gather_function = classmethod(lambda cls: dist.all_gather_single)
        ds_torch_comm.TorchBackend.get_reduce_scatter_function = classmethod(lambda cls: dist.reduce_scatter_single)
    return deepspeed


def _no_shm_op() -> None:
    """Stands in for ``deepspeed.comm.torch.build_shm_op``: no op, so nothing is compiled (see above)."""
    return None


def _ask_device_count_once() -> None:
    """DeepSpeed 0.19.8's CPU accelerator runs ``numactl --hardware`` in a subprocess at every ``device_count()``,
    which ZeRO-3 calls for every gradient bucket: a fork and exec per bucket per step (found through the bytes
    the failing exec wrote when numactl is missing). The answer does not change during a run: ask once."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if getattr(accelerator, "_parallelkit_device_count", None) is None:
        count = accelerator.device_count()
        accelerator._parallelkit_device_count = count
        accelerator.device_count = lambda: count


# ----------------------------------------------------------------------------------------------- traffic
def _nbytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _flat(stats: CommStats, kind: str, op: str, tensors: Any, arguments: dict[str, Any]) -> None:
    """A coalesced list that gloo flattens into one collective (all-reduce, all-gather)."""
    tensors = list(tensors)
    if tensors:
        stats.record(kind, _nbytes(tensors), op, arguments["group"], element_size=tensors[0].element_size())


# Backend method → (its parameters in order, how to count one call). DeepSpeed passes arguments by position,
# and its decorators hide the signatures, hence the names here (those of deepspeed.comm.torch.TorchBackend).
# Each call is counted at the algorithm the group's backend runs (CommStats.record with the group).
_COUNTERS: dict[str, tuple[tuple[str, ...], Callable[[CommStats, str, dict[str, Any]], Any]]] = {
    "all_reduce": (("tensor", "op", "group"), lambda s, k, a: s.record(k, a["tensor"], "all_reduce", a["group"])),
    "all_reduce_coalesced": (("tensors", "op", "group"), lambda s, k, a: _flat(s, k, "all_reduce", a["tensors"], a)),
    "reduce": (("tensor", "dst", "op", "group"), lambda s, k, a: s.record(k, a["tensor"], "reduce", a["group"], root=a["dst"])),
    "reduce_scatter_tensor": (("output_tensor", "input_tensor", "op", "group"), lambda s, k, a: s.record(k, a["input_tensor"], "reduce_scatter", a["group"])),
    # the list form on NCCL (on gloo it is routed, below)
    "reduce_scatter": (("output", "input_list", "op", "group"), lambda s, k, a: s.record(
        k, _nbytes(a["input_list"]), "reduce_scatter", a["group"], element_size=a["output"].element_size())),
    "all_gather_into_tensor": (("output_tensor", "input_tensor", "group"), lambda s, k, a: s.record(k, a["input_tensor"], "all_gather", a["group"])),
    "all_gather_base": (("output_tensor", "input_tensor", "group"), lambda s, k, a: s.record(k, a["input_tensor"], "all_gather", a["group"])),
    "all_gather": (("tensor_list", "tensor", "group"), lambda s, k, a: s.record(k, a["tensor"], "all_gather", a["group"])),
    # one all-gather per tensor inside a coalescing manager, which hands gloo one flattened all-gather
    "all_gather_coalesced": (("output_tensors", "input_tensors", "group"), lambda s, k, a: _flat(s, k, "all_gather", a["input_tensors"], a)),
    "broadcast": (("tensor", "src", "group"), lambda s, k, a: s.record(k, a["tensor"], "broadcast", a["group"], root=a["src"])),
    "all_to_all_single": (("output", "input", "output_split_sizes", "input_split_sizes", "group"), lambda s, k, a: s.record(
        k, a["input"], "all_to_all", a["group"], peer_bytes=_split_bytes(a["input"], a.get("input_split_sizes")))),
}


def _split_bytes(tensor: torch.Tensor, splits: Any) -> list[int] | None:
    if not splits:
        return None
    row = _nbytes(tensor) // max(tensor.shape[0], 1)
    return [int(n) * row for n in splits]


class _Done:
    """The handle of a collective that already completed (DeepSpeed may ask for one with ``async_op=True``)."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _CommCounter:
    """The wrappers installed on DeepSpeed's backend; ``stats`` can be re-pointed and counting paused."""

    def __init__(self, stats: CommStats) -> None:
        self.stats = stats
        self.paused = 0

    def wrap(self, op: str, method: Callable[..., Any], names: tuple[str, ...], count: Callable[[CommStats, str, dict[str, Any]], Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            arguments = {"group": None, **dict(zip(names, args)), **kwargs}
            if op in ("reduce_scatter_tensor", "reduce_scatter") and _routable(arguments):
                return self._reduce_scatter(arguments)
            if not self.paused:
                count(self.stats, KIND_PREFIX + op, arguments)
            return method(*args, **kwargs)

        counted.__wrapped__ = method
        return counted

    def _reduce_scatter(self, a: dict[str, Any]) -> Any:
        """gloo's reduce-scatter is an all-reduce plus a slice (2(n−1)/n of the input on the wire): DeepSpeed's
        ZeRO-3 gradient reduce-scatter goes through parallelkit's one-all-to-all version instead ((n−1)/n)."""
        from parallelkit.distributed.collectives import reduce_scatter

        group = a["group"]
        if "input_list" in a:  # the list form: this rank's chunk is one of the list's tensors
            output, full = a["output"], torch.cat([t.reshape(-1) for t in a["input_list"]])
        else:
            output, full = a["output_tensor"], a["input_tensor"]
        reduce_scatter(output, full, group, None if self.paused else self.stats, KIND_PREFIX + "reduce_scatter_tensor")
        if _op_name(a) == "AVG":
            output.div_(dist.get_world_size(group))
        return _Done()


def _op_name(arguments: dict[str, Any]) -> str:
    # DeepSpeed hands over its own ReduceOp enum or torch's; both name their members SUM, AVG, ...
    op = arguments.get("op")
    return "SUM" if op is None else getattr(op, "name", str(op).rsplit(".", 1)[-1]).upper()


def _routable(arguments: dict[str, Any]) -> bool:
    if dist.get_backend(arguments["group"]) != "gloo" or _op_name(arguments) not in ("SUM", "AVG"):
        return False
    chunks = arguments.get("input_list")
    return chunks is None or len({t.numel() for t in chunks}) == 1  # one all-to-all needs equal chunks


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
