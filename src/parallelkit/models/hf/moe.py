"""Mixture-of-Experts blocks of ``transformers`` (Mixtral style) as parallelkit's grouped experts.

``transformers`` 5 keeps a block's experts as two fused 3-D parameters (``gate_up_proj`` of shape
``[experts, 2·intermediate, hidden]`` and ``down_proj``) that its experts' ``forward`` indexes by routing. One
name for all experts cannot be spread over ranks (a rank would hold a slice of a tensor whose name says "all of
it"), so :func:`group_experts` rebuilds every such block, once, when the model is built — for every strategy, so
that all of them save the same names:

- the experts become a ``ModuleDict`` of per-expert modules keyed by global expert id (``experts.experts.3``),
  each holding its own slices of the fused weights, the layout parallelkit's expert parallelism shards
  (:func:`~parallelkit.distributed.expert_parallel.apply_ep`: a rank keeps its experts, tokens travel by
  all-to-all around the experts module);
- the block's forward routes as ``transformers`` does (the model's own router, top-k, weights), sorts the
  token-expert assignments by expert, runs the grouped experts on them, and adds each expert's weighted output
  back to its token — the same arithmetic as the fused forward.

``python -m parallelkit.export`` fuses the experts back into ``transformers``' layout (:func:`fuse_experts`).
Routing is dropless and per token (no capacity), so every strategy computes what one process computes.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FUSED = ("gate_up_proj", "down_proj")


def _local(tensor: Any) -> Any:
    """A replicated DTensor's value on this rank (tensor parallel replicates the router); a tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class Expert(nn.Module):
    """One expert: its slices of the fused ``gate_up_proj`` and ``down_proj``."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act: Any) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up.detach().clone())
        self.down_proj = nn.Parameter(down.detach().clone())
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.down_proj)


class GroupedExperts(nn.Module):
    """Experts keyed by global id; ``forward(tokens sorted by expert, rows per held expert)``."""

    def __init__(self, fused: nn.Module) -> None:
        super().__init__()
        act = fused.act_fn
        self.experts = nn.ModuleDict({str(e): Expert(fused.gate_up_proj[e], fused.down_proj[e], act) for e in range(fused.gate_up_proj.shape[0])})

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        chunks = tokens.split(counts.tolist())
        outputs = [expert(chunk) for expert, chunk in zip(self.experts.values(), chunks)]
        return torch.cat(outputs) if outputs else tokens


def grouped_moe_forward(block: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The block's forward with grouped experts: route, sort by expert, run, weight, add back per token."""
    batch, seq, hidden = hidden_states.shape
    if block.training and getattr(block, "jitter_noise", 0) > 0:
        hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - block.jitter_noise, 1.0 + block.jitter_noise)
    flat = hidden_states.reshape(-1, hidden)
    _, weights, index = (_local(t) for t in block.gate(flat))
    assignment = index.reshape(-1)  # token t's j-th expert at t·top_k + j
    order = torch.argsort(assignment, stable=True)  # token-major within an expert, as the fused loop visits them
    token = order // index.shape[1]
    # per global expert (under expert parallelism the dispatch around block.experts sends each its rows)
    counts = torch.bincount(assignment, minlength=block.num_experts_total)
    out = block.experts(flat[token], counts) * weights.reshape(-1)[order, None].to(flat.dtype)
    return torch.zeros_like(flat).index_add_(0, token, out).reshape(batch, seq, hidden)


def is_fused_moe(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    return experts is not None and all(isinstance(getattr(experts, n, None), torch.Tensor) and getattr(experts, n).ndim == 3 for n in FUSED) \
        and hasattr(module, "gate")


def group_experts(model: nn.Module) -> list[str]:
    """Rebuild every fused MoE block of ``model`` in place (see the module docstring); returns their names."""
    names = []
    for name, module in list(model.named_modules()):
        if is_fused_moe(module):
            module.num_experts_total = module.experts.gate_up_proj.shape[0]
            module.experts = GroupedExperts(module.experts)
            module.forward = types.MethodType(grouped_moe_forward, module)
            names.append(name)
    return names


def moe_blocks(model: nn.Module) -> dict[str, nn.Module]:
    """The rebuilt MoE blocks, by name."""
    return {name: m for name, m in model.named_modules() if isinstance(getattr(m, "experts", None), GroupedExperts)}


def fuse_experts(weights: dict[str, torch.Tensor], blocks: list[str], num_experts: int) -> dict[str, torch.Tensor]:
    """The inverse for export: ``<block>.experts.experts.<e>.<w>`` stacked back into ``<block>.experts.<w>``."""
    weights = dict(weights)
    for block in blocks:
        for w in FUSED:
            weights[f"{block}.experts.{w}"] = torch.stack([weights.pop(f"{block}.experts.experts.{e}.{w}") for e in range(num_experts)])
    return weights
