"""Parallel plans for :mod:`parallelkit.models.moe_gpt`: where the experts go under expert parallelism.

``model.py`` stays single-device code; :func:`expert_parallel_plan` tells
:func:`parallelkit.distributed.expert_parallel.apply_ep` which modules hold experts (sharded over the
expert-parallel ranks, in contiguous blocks of global expert ids: ep rank ``r`` of ``ep`` holds experts
``r·E/ep … (r+1)·E/ep - 1``) and which layers gather routing statistics over the data-parallel ranks.
Everything else (attention, embeddings, norms, routers) is dense: replicated and data-parallel.
"""

from __future__ import annotations

from parallelkit.distributed.expert_parallel import ExpertParallelPlan, MoESite
from parallelkit.models.moe_gpt.model import MoEGPT


def expert_parallel_plan(model: MoEGPT) -> ExpertParallelPlan:
    """One :class:`MoESite` per MoE layer: its grouped experts and the layer that owns the routing seam."""
    return ExpertParallelPlan(
        num_experts=model.num_experts,
        sites=[
            MoESite(name=name, experts=layer.experts, experts_dict=layer.experts.experts, routing_owner=layer)
            for name, layer in model.moe_layers().items()
        ],
    )
