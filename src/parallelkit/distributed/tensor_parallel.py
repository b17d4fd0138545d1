"""Tensor (Megatron-style) parallelism on ``torch.distributed.tensor``, with its traffic counted.

A model's plan (``TensorParallelPlan``, written beside the model in its ``parallelize.py``) says which
module is column- or row-parallel, which regions are sequence-parallel, and whether the output layer is
vocabulary-parallel (so the loss must run under ``loss_parallel``). :func:`apply_tp` applies it with
``parallelize_module``, makes every parameter the plan leaves whole a replicated DTensor (optimizers and
gradient clipping refuse a mix of DTensors and plain tensors), and returns a :class:`TensorParallel` handle that

- counts every collective DTensor issues implicitly (forward, loss and backward) into a
  :class:`~parallelkit.distributed.comm_stats.CommStats`: its context claims them at the collective boundary
  (:mod:`~parallelkit.distributed.comm_counting`), so the numbers are what ran, not what the plan promises;
- attributes them to a *scope* (e.g. ``tp_block`` for transformer blocks), in forward and in backward,
  so per-layer traffic can be compared with Megatron-LM's ``8·b·s·h·(t−1)/t`` elements per layer;
- after the last backward of a step, brings gradients to their parameter's layout (:meth:`TensorParallel.sync`):
  replicated parameters used on sequence shards (LayerNorm under sequence parallel) get partial-sum
  gradients, which are all-reduced here in one fused buffer, counted.

Sequence parallel composes with FSDP2 and with a pipeline as follows (tested against one process in
``tests/distributed/test_sequence_parallel_compose.py``). FSDP2 (:func:`~parallelkit.distributed.fsdp.apply_fsdp`
after :func:`apply_tp`) sums the partial gradients over ``tp`` itself: before its reduce-scatter over the sharding
ranks it redistributes each DTensor gradient to its unsharded parameter's placements (``Partial`` → ``Replicate``,
one all-reduce per norm parameter, counted under this handle's kinds as the backward's ``tp.all_reduce``): the
Megatron order, tp before the data-parallel reduction, and ``sync`` finds nothing left. Through a pipeline the
partial sums reach ``sync`` after the schedule's backward. A pipeline stage hands on the sequence shard
(``seq / tp`` positions); where a stage needs the whole sequence's shape, the plan's
:func:`sequence_parallel_blocks` makes the hand-off a DTensor.

Bytes are what each collective writes from this rank at the algorithm the backend runs
(:func:`~parallelkit.distributed.comm_stats.wire_bytes`). On NCCL these are Megatron's figures: an all-reduce
of ``N`` bytes over ``t`` ranks sends ``2N(t−1)/t``, an all-gather or reduce-scatter ``N(t−1)/t``, so
sequence parallel costs what plain tensor parallel costs. On gloo DTensor's reduce-scatter is an
all-reduce plus a slice (``2N(t−1)/t``): sequence parallel sends 1.5× plain tensor parallel's bytes there.
"""

from __future__ import annotations

import contextlib
import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from parallelkit.distributed.comm_counting import counting
from parallelkit.distributed.comm_stats import CommStats

#: kind prefix of collectives issued outside any scope of the plan (embedding, output layer, loss).
TP_KIND = "tp"
#: kind of the fused all-reduce of partial-sum gradients (:meth:`TensorParallel.sync`).
TP_GRAD_KIND = "tp_grad_allreduce"


@dataclass
class TensorParallelPlan:
    """How to split one model: what ``parallelize_module`` needs, plus how to count and run it.

    Args:
        layout: module FQN (``fnmatch`` wildcards allowed, e.g. ``layers.*.attn.q_proj``) → ``ParallelStyle``.
        scopes: module FQN pattern → comm kind for the collectives issued while that module runs, forward
            or backward (e.g. ``{"layers.*": "tp_block"}``). Other collectives count under ``tp``.
        loss_parallel: the output layer leaves logits sharded over the vocabulary; the loss and its
            backward must run under ``torch.distributed.tensor.parallel.loss_parallel``.
    """

    layout: dict[str, Any]
    scopes: dict[str, str] = field(default_factory=dict)
    loss_parallel: bool = False


class _ScopeTracker:
    """Which plan scope runs now, in forward (module hooks) and backward (tensor hooks).

    In backward a module's ops run between the gradient of its outputs and the gradient of its inputs:
    a hook on each output enters the scope, a hook on each input leaves it. Entries are counted, not
    stacked, because one tensor is often the output of one block and the input of the next.
    """

    def __init__(self) -> None:
        self.depth: dict[str, int] = {}
        self.handles: list[Any] = []

    def current(self) -> str | None:
        active = [kind for kind, depth in self.depth.items() if depth > 0]
        return active[0] if active else None

    def reset(self) -> None:
        self.depth = {}

    def _move(self, kind: str, step: int) -> None:
        self.depth[kind] = self.depth.get(kind, 0) + step

    def _on_grad(self, tensors: Any, kind: str, step: int) -> None:
        for tensor in tree_flatten(tensors)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad, kind=kind, step=step: self._move(kind, step))

    def track(self, module: torch.nn.Module, kind: str) -> None:
        def before(mod: Any, args: Any) -> None:
            self._move(kind, 1)
            self._on_grad(args, kind, -1)

        def after(mod: Any, args: Any, output: Any) -> None:
            self._move(kind, -1)
            self._on_grad(output, kind, 1)

        self.handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]


# ------------------------------------------------------------------------------------- the handle
class TensorParallel:
    """What :func:`apply_tp` returns: the context a step runs in, and the end-of-step gradient sync.

    Example::

        tp = apply_tp(model, mesh["tp"], plan, comm_stats=stats)
        with tp.context():
            loss = model.loss(model(x), y)
            loss.backward()
        tp.sync()            # gradients in their parameters' layout, before the optimizer step
    """

    def __init__(self, model: torch.nn.Module, mesh: Any, plan: TensorParallelPlan, comm_stats: CommStats | None) -> None:
        self.model = model
        self.mesh = mesh
        self.plan = plan
        self.comm_stats = comm_stats
        self.scopes = _ScopeTracker()
        self._active = False

    def _kind(self, op: str) -> str:
        return f"{self.scopes.current() or TP_KIND}.{op}"

    @contextlib.contextmanager
    def context(self, count: bool = True) -> Iterator[None]:
        """Run forward, loss, backward or the optimizer step (gradient clipping reduces norms over ``tp``).

        Under ``loss_parallel`` if the plan needs it, and counted if ``count``. Re-entrant: a step's
        forward and backward run inside its optimizer step's context, and are counted once.
        """
        from torch.distributed.tensor.parallel import loss_parallel

        if self._active:
            yield
            return
        self._active = True
        try:
            with contextlib.ExitStack() as stack:
                if self.plan.loss_parallel:
                    stack.enter_context(loss_parallel())
                if count:
                    stack.enter_context(counting(self.comm_stats, self._kind))
                yield
        finally:
            self._active = False

    def begin_step(self) -> None:
        """Forget scope state a failed step may have left (a backward that never ran)."""
        self.scopes.reset()

    @torch.no_grad()
    def sync(self) -> None:
        """Bring every DTensor gradient to its parameter's placements (after the last backward of a step).

        Partial-sum gradients (replicated parameters applied to sequence shards) are summed over the
        tensor-parallel group in one fused, counted all-reduce; other mismatches (a replicated gradient
        of a sharded parameter, e.g. a vocabulary-parallel embedding) are re-laid out locally.
        """
        from torch.distributed.tensor import DTensor, Partial, Replicate

        partial: list[torch.nn.Parameter] = []
        for param in self.model.parameters():
            grad = param.grad
            if not isinstance(grad, DTensor) or tuple(grad.placements) == tuple(param.placements):
                continue
            if all(isinstance(p, Partial) and p.reduce_op == "sum" for p in grad.placements) and all(
                isinstance(p, Replicate) for p in param.placements
            ):
                partial.append(param)
            else:
                with self.context():  # expected to be local; counted should it ever not be
                    param.grad = grad.redistribute(param.device_mesh, param.placements)
        if not partial:
            return
        locals_ = [p.grad.to_local() for p in partial]
        flat = torch.cat([g.reshape(-1) for g in locals_])
        with counting(self.comm_stats, TP_GRAD_KIND):
            dist.all_reduce(flat, group=self.mesh.get_group())
        offset = 0
        for param, local in zip(partial, locals_):
            summed = flat[offset : offset + local.numel()].view_as(local)
            offset += local.numel()
            param.grad = DTensor.from_local(summed, param.device_mesh, param.placements, run_check=False)


def sequence_parallel_blocks(stream: Any = None) -> Any:
    """The plan entry for a model's repeated blocks under sequence parallelism (e.g. ``{"layers.*": ...}``).

    Each block takes this rank's sequence shard as a local tensor and hands it on as a DTensor laid out as
    ``stream`` (default ``Shard(1)``). Inside a block the residual stream must stay local (a row-parallel
    output is local, and a DTensor cannot be added to a plain tensor); between blocks it carries its layout.
    That matters where a block's output leaves the process: a pipeline stage hands it to the next as a DTensor
    (``torch.distributed.pipelining`` sends only the local shard, seq/tp positions, and rebuilds the DTensor
    from its metadata), so the next stage sees the whole sequence's shape, which a stage that builds masks and
    positions from its input needs (Hugging Face decoders: with a plain shard they were built for seq/tp
    positions), and a layout mismatch between stages is an error, not a silent misreading. Both conversions
    only relabel: no communication.

    Args:
        stream: the residual stream's layout between the parallel regions (``Shard(1)``: the sequence dimension).

    Example::

        if sequence_parallel:
            layout["model.layers.*"] = sequence_parallel_blocks()   # in a model's tensor_parallel_plan
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    stream = Shard(1) if stream is None else stream
    return PrepareModuleInputOutput(input_layouts=(stream,), desired_input_layouts=(stream,), use_local_input=True,
                                    output_layouts=(stream,), desired_output_layouts=(stream,), use_local_output=False)


def _replicate_rest(model: torch.nn.Module, mesh: Any) -> None:
    """Make every parameter the plan left whole a replicated DTensor, module by module.

    The optimizer and gradient clipping then see one kind of tensor (DTensor refuses to mix with plain
    tensors), and those modules exchange DTensors with their neighbours only at their own boundary:
    plain inputs are taken as replicated, replicated outputs are handed on as plain tensors.
    """
    from torch.distributed.tensor import (
        DTensor,
        Replicate,
        distribute_module,
        distribute_tensor,
    )

    def replicate_own(target: torch.nn.Module) -> Callable[..., None]:
        def partition(name: str, module: torch.nn.Module, device_mesh: Any) -> None:
            if module is not target:  # distribute_module visits submodules too; they have their own turn
                return
            for pname, param in list(module.named_parameters(recurse=False)):
                if not isinstance(param, DTensor):
                    dparam = torch.nn.Parameter(distribute_tensor(param.data, device_mesh, [Replicate()]), param.requires_grad)
                    module.register_parameter(pname, dparam)

        return partition

    def inputs_replicated(module: Any, inputs: Any, device_mesh: Any) -> Any:
        return tuple(
            DTensor.from_local(t, device_mesh, [Replicate()], run_check=False) if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t
            for t in inputs
        )

    def outputs_local(module: Any, output: Any, device_mesh: Any) -> Any:
        if isinstance(output, DTensor) and all(isinstance(p, Replicate) for p in output.placements):
            return output.to_local()
        return output

    for module in list(model.modules()):
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            distribute_module(module, mesh, replicate_own(module), inputs_replicated, outputs_local)


def _matches(pattern: str, name: str) -> bool:
    """``fnmatch`` per dotted segment: ``layers.*`` is every block, not every module inside one."""
    parts, segments = pattern.split("."), name.split(".")
    return len(parts) == len(segments) and all(fnmatch.fnmatchcase(s, p) for p, s in zip(parts, segments))


def _expand(model: torch.nn.Module, patterns: dict[str, Any]) -> dict[str, Any]:
    """Resolve FQN patterns against the model; a pattern that matches nothing is a broken plan."""
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, Any] = {}
    for pattern, value in patterns.items():
        matches = [name for name in names if _matches(pattern, name)]
        if not matches:
            raise ValueError(f"tensor parallel plan entry {pattern!r} matches no module of {type(model).__name__}")
        for name in matches:
            resolved[name] = value
    return resolved


def apply_tp(
    model: torch.nn.Module,
    tp_mesh: Any,
    plan: TensorParallelPlan,
    *,
    comm_stats: CommStats | None = None,
) -> TensorParallel:
    """Split ``model``'s layers over the 1-D ``tp_mesh`` as ``plan`` says, in place.

    Args:
        model: a single-device module (on the mesh's device type).
        tp_mesh: the tensor-parallel axis of the device mesh (``mesh["tp"]``).
        plan: the model's :class:`TensorParallelPlan`.
        comm_stats: where the collectives of counted steps are recorded.

    Returns:
        The :class:`TensorParallel` handle: run steps inside ``handle.context()``, call ``handle.sync()``
        after the last backward of each optimizer step.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tp needs the 1-D tensor-parallel mesh, got a {tp_mesh.ndim}-D mesh")
    # parallelize_module applies entries in order: a parent's input preparation runs before its children's.
    parallelize_module(model, tp_mesh, _expand(model, plan.layout))
    _replicate_rest(model, tp_mesh)
    handle = TensorParallel(model, tp_mesh, plan, comm_stats)
    modules = dict(model.named_modules())
    for name, kind in _expand(model, plan.scopes).items():
        handle.scopes.track(modules[name], kind)
    return handle
