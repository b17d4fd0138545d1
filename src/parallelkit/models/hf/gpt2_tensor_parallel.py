"""Tensor parallelism for GPT-2's ``Conv1D`` layers, whose attention fuses q, k and v into one matrix.

``transformers``' GPT-2 computes q, k and v with one ``Conv1D`` (``c_attn``: ``y = x @ W + b``, ``W`` of shape
``[hidden, 3·hidden]``, columns ``[q | k | v]``, each ``hidden`` wide and ordered by head) and carries no
``base_model_tp_plan``. torch's ``ColwiseParallel``/``RowwiseParallel`` take ``nn.Linear`` only. The styles here
are Megatron-LM's layout for those layers:

- :class:`Conv1DColwise` (``c_attn``, ``mlp.c_fc``): the output columns split over the tp ranks, no communication
  in forward; the input's gradient is a partial sum, all-reduced in backward (DTensor's ``Replicate`` input).
  For the fused ``c_attn`` (``fused=3``) each rank must get *its heads'* q, k and v columns, which are not one
  contiguous block of ``[q | k | v]``. The weight is therefore held in Megatron's head-grouped order
  (``[q_h0 k_h0 v_h0 | q_h1 k_h1 v_h1 | ...]``: a fixed permutation of the columns, the same for every tp), in
  which a plain ``Shard(1)`` gives each rank whole heads; the forward rearranges its local output back to
  ``[q | k | v]`` of its heads, which is what ``GPT2Attention`` splits (its ``split_size`` set to
  ``hidden / tp`` by :class:`GPT2LocalHeads`).
- :class:`Conv1DRowwise` (``attn.c_proj``, ``mlp.c_proj``): the input rows split, the partial products summed by
  one all-reduce in forward, the bias added once, after the sum.

Checkpoints hold ``transformers``' order: ``c_attn``'s ``state_dict`` gives the weight and bias in the
``[q | k | v]`` order (one all-gather of the layer when a checkpoint is written), and ``load_state_dict`` takes
that order back (from a sharded checkpoint or a whole tensor), so a checkpoint of a tp run loads in one
process, in other strategies, and exports to ``transformers``. The optimizer's state of ``c_attn`` (Adam's
moments) is saved as the optimizer holds it, in the head-grouped order: the same at every tp degree, so a tp run
resumes at another tp; resuming it without tensor parallelism would read those moments in the wrong order.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


def head_grouped_order(width: int, fused: int, heads: int) -> torch.Tensor:
    """Column indices: ``new[:, j] = old[:, order[j]]`` takes ``[q | k | v]`` (``fused`` blocks of ``heads`` heads)
    to Megatron's head-grouped ``[q_h0 k_h0 v_h0 | q_h1 ...]``."""
    return torch.arange(width).view(fused, heads, width // (fused * heads)).transpose(0, 1).reshape(-1)


def _replicated(tensor: torch.Tensor, mesh: Any, placement: Any) -> DTensor:
    """A whole tensor (the same on every rank) as a DTensor of ``placement``: local slicing, no communication."""
    return DTensor.from_local(tensor, mesh, [Replicate()], run_check=False).redistribute(mesh, [placement])


def _as_replicated_input(x: torch.Tensor, mesh: Any, layout: Any) -> torch.Tensor:
    """The whole input on every rank, as a local tensor whose gradient is this rank's partial sum: summed over the
    tp ranks in backward (Megatron's *f*), as torch's ``ColwiseParallel`` does through a ``Replicate`` input."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [layout], run_check=False)
    if tuple(x.placements) != (Replicate(),):
        x = x.redistribute(mesh, [Replicate()])
    return x.to_local(grad_placements=[Partial()])


class Conv1DColwise(ParallelStyle):
    """Column parallel of a ``transformers`` ``Conv1D`` (weight ``[in, out]``): each rank computes ``out / tp`` columns.

    Args:
        fused: the output is ``fused`` equal blocks (3 for GPT-2's ``c_attn``: q, k, v), each split by heads.
        heads: attention heads per block (with ``fused > 1``).
        input_layouts: the input's layout (``Replicate()``; ``Shard(1)`` under sequence parallel).

    The output is a local tensor: this rank's columns (for ``fused > 1``: ``[q | k | v]`` of this rank's heads).
    """

    def __init__(self, *, fused: int = 1, heads: int = 1, input_layouts: Any = None) -> None:
        super().__init__()
        self.fused, self.heads = fused, heads
        self.input_layout = input_layouts or Replicate()

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        fused, heads, tp = self.fused, self.heads, device_mesh.size()
        width = module.weight.shape[1]
        order = head_grouped_order(width, fused, heads) if fused > 1 else None
        if width % (fused * tp) or (fused > 1 and heads % tp):
            raise ValueError(f"{type(module).__name__} of {width} columns ({fused} blocks of {heads} heads) cannot split over {tp} ranks")
        with torch.no_grad():
            for name, dim in (("weight", 1), ("bias", 0)):
                param = getattr(module, name)
                value = param.index_select(dim, order) if order is not None else param
                module.register_parameter(name, nn.Parameter(distribute_tensor(value.detach(), device_mesh, [Shard(dim)]),
                                                             requires_grad=param.requires_grad))
        layout = self.input_layout

        def forward(self_: nn.Module, x: torch.Tensor) -> torch.Tensor:
            x_local = _as_replicated_input(x, device_mesh, layout)
            weight, bias = self_.weight.to_local(), self_.bias.to_local()
            y = torch.addmm(bias, x_local.reshape(-1, x_local.shape[-1]), weight).view(*x_local.shape[:-1], -1)
            if fused > 1:  # [q_h k_h v_h] per local head → [q | k | v] of the local heads
                y = y.view(*y.shape[:-1], heads // tp, fused, -1).transpose(-3, -2).reshape(*y.shape[:-1], -1)
            return y

        module.forward = types.MethodType(forward, module)
        if order is not None:
            _keep_checkpoints_in_original_order(module, order)
        return module


class Conv1DRowwise(ParallelStyle):
    """Row parallel of a ``transformers`` ``Conv1D``: each rank holds ``in / tp`` input rows and gets a local input of
    that width (a column-parallel layer's output); the partial products are summed (all-reduce, or reduce-scatter to
    ``output_layouts=Shard(1)``), then the bias is added once. Returns a local tensor."""

    def __init__(self, *, output_layouts: Any = None) -> None:
        super().__init__()
        self.output_layout = output_layouts or Replicate()

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        with torch.no_grad():
            for name, placement in (("weight", Shard(0)), ("bias", Replicate())):
                param = getattr(module, name)
                module.register_parameter(name, nn.Parameter(distribute_tensor(param.detach(), device_mesh, [placement]),
                                                             requires_grad=param.requires_grad))
        layout = self.output_layout

        def forward(self_: nn.Module, x: torch.Tensor) -> torch.Tensor:
            if isinstance(x, DTensor):
                x = x.to_local()
            partial = (x.reshape(-1, x.shape[-1]) @ self_.weight.to_local()).view(*x.shape[:-1], -1)
            out = DTensor.from_local(partial, device_mesh, [Partial()], run_check=False).redistribute(device_mesh, [layout])
            return (out + self_.bias).to_local()

        module.forward = types.MethodType(forward, module)
        return module


class GPT2LocalHeads(ParallelStyle):
    """``GPT2Attention`` splits ``c_attn``'s output into q, k, v of ``split_size`` columns each: under tensor
    parallelism that is ``hidden / tp`` (its heads count itself from the width, ``view(..., -1, head_dim)``)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        module.split_size = module.embed_dim // device_mesh.size()
        return module


def _keep_checkpoints_in_original_order(module: nn.Module, order: torch.Tensor) -> None:
    """``state_dict`` gives the weight and bias in ``transformers``' column order, ``load_state_dict`` takes them so."""
    inverse = torch.argsort(order)
    dims = {"weight": 1, "bias": 0}

    def to_original(mod: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for name, dim in dims.items():
            key = prefix + name
            if key in state and isinstance(state[key], DTensor):
                value = state[key]
                whole = value.full_tensor().index_select(dim, inverse)  # one all-gather of the layer, at checkpoint time
                state[key] = _replicated(whole, value.device_mesh, Shard(dim))

    def from_original(mod: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        for name, dim in dims.items():
            key = prefix + name
            if key in state:
                value = state[key]
                whole = value.full_tensor() if isinstance(value, DTensor) else value
                param = getattr(mod, name)
                state[key] = _replicated(whole.to(param.dtype).index_select(dim, order.to(whole.device)), param.device_mesh, Shard(dim))

    module.register_state_dict_post_hook(to_original)
    module.register_load_state_dict_pre_hook(from_original)
