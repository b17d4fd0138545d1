"""Tied input and output embeddings (``lm_head.weight is tok_emb.weight``) under tensor and pipeline parallelism.

A tied language model uses one ``vocab × hidden`` matrix twice: to look token ids up at the bottom of the model,
and to turn the last hidden states into logits at the top. The total gradient of that matrix is the sum of
the gradients of both uses. Megatron-LM keeps it so under both of its model-parallel splits; so does this module.

**Tensor parallel.** The vocabulary-parallel embedding (``RowwiseParallel`` of an ``nn.Embedding``) and the
vocabulary-parallel output layer (``ColwiseParallel`` of an ``nn.Linear``) both shard the matrix by rows of
the vocabulary (``Shard(0)``): the same layout. ``parallelize_module`` would still give each module its own
new DTensor parameter, cutting the tie. :func:`tie_parallel_styles` wraps the two modules' styles so that
whichever is applied second adopts the first's parameter: one DTensor ``Parameter`` registered under both
modules, sharded once, whose ``.grad`` accumulates both uses (autograd adds them, on each rank's shard).
Nothing to run per step.

**Pipeline parallel.** The embedding lives on the first stage and the output layer on the last, usually on
different ranks: each holds a copy of the same initial matrix (the model is built whole on every rank, from
one seed, before it is cut). :func:`apply_tied_embedding_sync` returns a handle whose :meth:`~TiedEmbeddingSync.sync`,
called after the pipeline's backward and before the optimizer step, replaces each copy's gradient by the sum
of both: one all-reduce over the *embedding group*, the two ranks of a pipeline that hold stage 0 and stage
``S-1`` (the same data-parallel, sharding and tensor-parallel coordinates), as Megatron-LM's embedding group.
Both copies then take the same optimizer step and stay equal. When one rank holds both stages (the V-shaped
``zbv`` schedule) the two copies are summed locally and nothing is sent. At :func:`apply_tied_embedding_sync`
the last stage's copy is set to the first's (one broadcast, not counted: set-up, not training traffic).

Which parameters are tied is said by the stage modules (the model's ``pipeline_stages`` plan): a stage that
holds one use of a tied weight names it in an attribute ``tied_weights``: ``{key: parameter name in the
stage}``, e.g. ``{"embedding": "tok_emb.weight"}`` on the first stage and ``{"embedding": "lm_head.weight"}``
on the last. Only the first and the last stage may hold tied weights, with the same keys.

Checkpoints keep both names (``tok_emb.weight`` from the first stage's rank, ``lm_head.weight`` from the
last's; a whole tied model's state dict has both too), so every layout reads the name it holds; they are equal
values. ``python -m parallelkit.export`` writes the tied weight once.

The handle counts its bytes under ``tied_embedding_allreduce`` (:func:`~parallelkit.distributed.comm_counting.counting`).
It runs after the gradients are in their parameters' layout (after
:meth:`~parallelkit.distributed.tensor_parallel.TensorParallel.sync`); before or after data-parallel averaging
gives the same result (both are linear, on the same local shards).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from parallelkit.distributed.comm_counting import counting
from parallelkit.distributed.comm_stats import CommStats
from parallelkit.distributed.grad_sync import local_tensor

TIED_EMBEDDING_ALLREDUCE = "tied_embedding_allreduce"
#: the attribute of a pipeline stage module naming its uses of tied weights: ``{key: parameter name}``.
TIED_WEIGHTS_ATTR = "tied_weights"


# ==================================================================================== tensor parallel
class _TiedStyle(ParallelStyle):
    """A ``ParallelStyle`` that applies ``style``, then makes the module's ``param_name`` the group's one parameter."""

    def __init__(self, style: Any, group: "_TieGroup", param_name: str) -> None:
        self.style, self.group, self.param_name = style, group, param_name

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        original = getattr(module, self.param_name)
        module = self.style._apply(module, device_mesh)
        self.group.adopt(module, self.param_name, original)
        return module

    def __repr__(self) -> str:
        return f"Tied({self.style!r})"


class _TieGroup:
    """The modules' shared parameter: the first module parallelized keeps its new parameter, the others adopt it.

    Keyed by the parameter the modules shared before parallelization (a weak reference), so one plan applied
    to two models ties each model's modules to their own parameter.
    """

    def __init__(self) -> None:
        self._done: list[tuple[weakref.ref, nn.Parameter]] = []

    def adopt(self, module: nn.Module, name: str, original: torch.Tensor) -> None:
        self._done = [(ref, p) for ref, p in self._done if ref() is not None]
        new = getattr(module, name)
        for ref, param in self._done:
            if ref() is original:
                _check_same_layout(param, new, name, module)
                module.register_parameter(name, param)
                return
        self._done.append((weakref.ref(original), new))


def _check_same_layout(kept: torch.Tensor, new: torch.Tensor, name: str, module: nn.Module) -> None:
    def layout(t: torch.Tensor) -> tuple:
        return (tuple(t.shape), getattr(t, "device_mesh", None), tuple(getattr(t, "placements", ())))

    if layout(kept) != layout(new):
        raise ValueError(
            f"tied parameter {name!r} of {type(module).__name__}: its styles lay it out differently ({layout(kept)} vs "
            f"{layout(new)}); modules that share a weight must shard it the same way (e.g. both over the vocabulary, Shard(0))."
        )


def tie_parallel_styles(*styles: Any, param_name: str = "weight") -> list[Any]:
    """Wrap the ``ParallelStyle`` of each module that shares one ``param_name`` parameter (a tied embedding and output
    layer), so that after ``parallelize_module`` they still share one: the DTensor made by whichever is applied first.

    The styles must lay the parameter out the same way (``RowwiseParallel()`` of an ``nn.Embedding`` and
    ``ColwiseParallel()`` of an ``nn.Linear`` both shard the ``vocab × hidden`` matrix by vocabulary rows).

    Example::

        layout["tok_emb"], layout["lm_head"] = tie_parallel_styles(layout["tok_emb"], layout["lm_head"])
    """
    group = _TieGroup()
    return [_TiedStyle(style, group, param_name) for style in styles]


# ==================================================================================== pipeline parallel
@dataclass
class TiedEmbeddingSync:
    """Sum the gradients of the first and last stage's copies of tied weights (see the module docstring).

    ``pairs``: ``(first stage's copy, last stage's copy)`` when this rank holds both stages (summed locally);
    ``params``: this rank's copies when it holds one of the two stages, all-reduced over ``group``.
    ``duplicates``: the last stage's copies on this rank: a gradient norm over all stages counts each tied
    weight once by leaving these out (their gradient equals the first stage's after :meth:`sync`).

    Example::

        tied = apply_tied_embedding_sync(stage_modules, stage_ids, num_stages, mesh.get_group("pp"), comm_stats=stats)
        pipe.train_step(x, y)
        tied.sync()        # before optimizer.step()
    """

    params: list[nn.Parameter] = field(default_factory=list)
    group: Any = None
    pairs: list[tuple[nn.Parameter, nn.Parameter]] = field(default_factory=list)
    duplicates: list[nn.Parameter] = field(default_factory=list)
    comm_stats: CommStats | None = None
    kind: str = TIED_EMBEDDING_ALLREDUCE

    @torch.no_grad()
    def sync(self) -> None:
        for first, last in self.pairs:
            g_first, g_last = _grad(first), _grad(last)
            g_first.add_(g_last)
            g_last.copy_(g_first)
        if not self.params or self.group is None:
            return
        grads = [_grad(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1).clone()
        with counting(self.comm_stats, self.kind):
            dist.all_reduce(flat, group=self.group)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def _grad(param: nn.Parameter) -> torch.Tensor:
    """The local storage of ``param``'s gradient (zeros if this step did not reach it), in the parameter's layout."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    grad = param.grad
    if hasattr(grad, "placements") and tuple(grad.placements) != tuple(param.placements):
        raise RuntimeError(
            f"tied weight gradient laid out as {tuple(grad.placements)}, its parameter as {tuple(param.placements)}: run "
            "the tied-embedding sync after TensorParallel.sync(), which brings gradients to their parameters' layout."
        )
    return local_tensor(grad)


def _tied_params(stage_modules: Iterable[nn.Module], stage_ids: list[int], num_stages: int) -> dict[str, dict[str, nn.Parameter]]:
    """``{"first"|"last": {key: parameter}}`` of this rank's stages."""
    found: dict[str, dict[str, nn.Parameter]] = {"first": {}, "last": {}}
    for module, stage in zip(stage_modules, stage_ids):
        names = getattr(module, TIED_WEIGHTS_ATTR, None) or {}
        if not names:
            continue
        if stage not in (0, num_stages - 1):
            raise ValueError(f"stage {stage} of {num_stages} names tied weights {names}: only the first and the last stage may hold them")
        role = "first" if stage == 0 else "last"
        for key, name in names.items():
            param = module.get_parameter(name)
            if param.requires_grad:  # a frozen weight stays as it is on both ends
                found[role][key] = param
    return found


def apply_tied_embedding_sync(
    stage_modules: list[nn.Module],
    stage_ids: list[int],
    num_stages: int,
    group: Any,
    *,
    comm_stats: CommStats | None = None,
    kind: str = TIED_EMBEDDING_ALLREDUCE,
) -> TiedEmbeddingSync:
    """Prepare the gradient sum of weights tied between the first and the last pipeline stage; call ``.sync()`` after
    the pipeline's backward (after ``TensorParallel.sync()`` if there is one), before the optimizer step.

    Every rank of the pipeline group calls it (it exchanges which rank holds which stage, and the embedding
    groups' members create their group).

    Args:
        stage_modules: this rank's stage modules, after every technique that replaces parameters (TP, FSDP2):
            the same list :func:`~parallelkit.distributed.pipeline_parallel.apply_pp` gets.
        stage_ids: their global stage indices.
        num_stages: stages in the whole pipeline.
        group: the pipeline process group (the ``pp`` mesh axis).
        comm_stats: where the all-reduce's bytes are counted, under ``kind``.
    """
    if num_stages == 1:  # no pipeline: the model is whole, its tied weight one parameter
        return TiedEmbeddingSync(comm_stats=comm_stats, kind=kind)
    found = _tied_params(stage_modules, stage_ids, num_stages)
    me = {"first": 0 in stage_ids, "last": num_stages - 1 in stage_ids,
          "keys": {role: {k: (tuple(p.shape), str(p.dtype)) for k, p in params.items()} for role, params in found.items()}}
    pp = dist.get_world_size(group) if group is not None else 1
    if pp == 1:
        everyone = [me]
    else:
        everyone = [None] * pp
        dist.all_gather_object(everyone, me, group=group)  # set-up: not counted
    owner = {role: next(i for i, info in enumerate(everyone) if info[role]) for role in ("first", "last")}
    first_keys, last_keys = everyone[owner["first"]]["keys"]["first"], everyone[owner["last"]]["keys"]["last"]
    if first_keys != last_keys:
        raise ValueError(f"the first stage's tied weights {first_keys} do not match the last stage's {last_keys}: "
                         "both must name the same keys, with the same shapes")
    handle = TiedEmbeddingSync(comm_stats=comm_stats, kind=kind)
    if not first_keys:
        return handle
    keys = sorted(first_keys)
    if owner["first"] == owner["last"]:  # one rank holds both stages: a local sum
        if me["first"]:
            handle.pairs = [(found["first"][k], found["last"][k]) for k in keys]
            for k, (first, last) in zip(keys, handle.pairs):
                if first is last:
                    raise ValueError(
                        f"tied weight {k!r}: one Parameter object in two stages of this rank. The schedule divides each stage's "
                        "gradients by the micro-batch count, so it would be divided twice: the pipeline plan must give the last "
                        "stage its own copy (see models/gpt/parallelize.py pipeline_stages)."
                    )
                with torch.no_grad():
                    local_tensor(last).copy_(local_tensor(first))
            handle.duplicates = [last for _, last in handle.pairs]
        return handle
    if not (me["first"] or me["last"]):
        return handle
    ranks = dist.get_process_group_ranks(group)
    members = sorted({ranks[owner["first"]], ranks[owner["last"]]})
    role = "first" if me["first"] else "last"
    handle.params = [found[role][k] for k in keys]
    handle.group = group if sorted(ranks) == members else _embedding_group(members)
    with torch.no_grad():  # both copies start equal: the first stage's
        for param in handle.params:
            dist.broadcast(local_tensor(param), group_src=members.index(ranks[owner["first"]]), group=handle.group)
    if role == "last":
        handle.duplicates = list(handle.params)
    return handle


_groups: dict[tuple[int, ...], Any] = {}


def _embedding_group(members: list[int]) -> Any:
    """The process group of the two ranks: created by those two only (its name is a hash of the ranks, so the other
    ranks' later groups keep their numbering), once per process."""
    key = tuple(members)
    if key not in _groups:
        _groups[key] = dist.new_group(members, use_local_synchronization=True)
    return _groups[key]
