"""DeepSpeed ZeRO as a parallelkit technique: build the engine, count its traffic, measure what it keeps.

``apply_deepspeed`` hands the model and the torch optimizer to ``deepspeed.initialize`` on the process group
that already exists (gloo on CPU, NCCL on GPU) and returns the engine. Two things DeepSpeed does not report
the way ``summary.json`` needs them are measured here:

- **Traffic.** Every collective DeepSpeed issues goes through ``deepspeed.comm`` into ``torch.distributed``,
  where the counting layer sees it (:mod:`parallelkit.distributed.comm_counting`); the strategy runs the
  engine's forward, backward and step inside :func:`counting_deepspeed`, so they count as
  ``deepspeed_<collective>`` at the algorithm the group's backend runs. On gloo, whose reduce-scatter is an
  all-reduce plus a slice, ZeRO's gradient reduce-scatter is routed through parallelkit's one-all-to-all
  reduce-scatter (:func:`route_reduce_scatter`), which sends half the bytes.
- **Memory.** ``deepspeed_state_bytes`` walks the ZeRO optimizer object graph (flat parameter buffers, fp32
  master partitions, gradient partitions, reduce buckets, the torch optimizer's state) and sums distinct
  storages once each, so a view into a flat buffer is not counted twice and a buffer nobody names in
  DeepSpeed's docs is still found.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from parallelkit.distributed.comm_counting import counting
from parallelkit.distributed.comm_stats import CommStats

KIND_PREFIX = "deepspeed_"
_MAX_DEPTH = 8
# The fp32 master partitions the ZeRO optimizers step (stages 1-2, stage 3).
_MASTER_COPIES = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")


def apply_deepspeed(module: torch.nn.Module, optimizer: torch.optim.Optimizer, config: dict[str, Any]) -> Any:
    """Wrap ``module`` and ``optimizer`` in a DeepSpeed engine configured by ``config``; return the engine.

    The default process group must exist. Count what the engine sends by running it inside
    :func:`counting_deepspeed`.

    Example::

        engine = apply_deepspeed(model, torch.optim.AdamW(model.parameters()), build_deepspeed_config(2))
        with counting_deepspeed(stats):
            loss = model.loss(engine(x), y); engine.backward(loss); engine.step()
    """
    if not dist.is_initialized():
        raise RuntimeError("apply_deepspeed needs an initialised default process group (torch.distributed).")
    deepspeed = _import_deepspeed(dist.get_backend())
    if dist.get_backend() == "gloo":
        _ask_device_count_once()
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config, dist_init_required=False)
    route_reduce_scatter()
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
#: the kind of every collective DeepSpeed issues inside :func:`counting_deepspeed` (``deepspeed_all_reduce``, ...)
KIND = KIND_PREFIX + "{op}"


def counting_deepspeed(stats: CommStats | None) -> Any:
    """Count what DeepSpeed issues inside the block (forward, backward, step) as ``deepspeed_<collective>``.

    DeepSpeed's ``deepspeed.comm`` calls ``torch.distributed``, so its collectives reach the counting layer
    at the collective boundary like everyone's (:mod:`parallelkit.distributed.comm_counting`).
    """
    return counting(stats, KIND)


class _Done:
    """The handle of a collective that already completed (DeepSpeed may ask for one with ``async_op=True``)."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


# DeepSpeed passes arguments by position, and its decorators hide the signatures, hence the names here
# (those of deepspeed.comm.torch.TorchBackend).
_REDUCE_SCATTERS = {
    "reduce_scatter_tensor": ("output_tensor", "input_tensor", "op", "group"),
    "reduce_scatter": ("output", "input_list", "op", "group"),
}


def _routed(method: Callable[..., Any], names: tuple[str, ...]) -> Callable[..., Any]:
    def reduce_scatter_(*args: Any, **kwargs: Any) -> Any:
        arguments = {"group": None, **dict(zip(names, args)), **kwargs}
        if not _routable(arguments):
            return method(*args, **kwargs)
        from parallelkit.distributed.collectives import reduce_scatter

        group = arguments["group"]
        if "input_list" in arguments:  # the list form: this rank's chunk is one of the list's tensors
            output, full = arguments["output"], torch.cat([t.reshape(-1) for t in arguments["input_list"]])
        else:
            output, full = arguments["output_tensor"], arguments["input_tensor"]
        reduce_scatter(output, full, group)  # counted at the boundary, as the all-to-all it is
        if _op_name(arguments) == "AVG":
            output.div_(dist.get_world_size(group))
        return _Done()

    reduce_scatter_.__wrapped__ = method
    return reduce_scatter_


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


def route_reduce_scatter() -> None:
    """On gloo, send DeepSpeed's reduce-scatters through parallelkit's one-all-to-all version (idempotent).

    gloo's reduce-scatter is an all-reduce plus a slice (2(n−1)/n of the input on the wire); ZeRO's gradient
    reduce-scatter then sends the ZeRO paper's (n−1)/n instead. This changes what runs, not what is
    counted: it replaces the two reduce-scatter methods of DeepSpeed's backend object, nothing else.
    """
    backend = _backend()
    if getattr(backend, "_parallelkit_routed", False):
        return
    for op, names in _REDUCE_SCATTERS.items():
        method = getattr(backend, op, None)
        if method is not None:
            setattr(backend, op, _routed(method, names))
    backend._parallelkit_routed = True


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
