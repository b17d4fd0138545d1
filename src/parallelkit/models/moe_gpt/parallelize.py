"""Parallel plans for :mod:`parallelkit.models.moe_gpt`: where the experts go under expert parallelism.

``model.py`` stays single-device code; :func:`expert_parallel_plan` tells
:func:`parallelkit.distributed.expert_parallel.apply_ep` which modules hold experts (sharded over the
expert-parallel ranks, in contiguous blocks of global expert ids: ep rank ``r`` of ``ep`` holds experts
``r·E/ep … (r+1)·E/ep - 1``) and which layers gather routing statistics over the data-parallel ranks.
Everything else (attention, embeddings, norms, routers) is dense: replicated and data-parallel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ParallelStyle

from parallelkit.distributed.expert_parallel import ExpertParallelPlan, MoESite
from parallelkit.models.gpt.model import GPT
from parallelkit.models.gpt.parallelize import GPTPipelineStage, pipeline_blocks
from parallelkit.models.gpt.parallelize import context_parallel_plan  # noqa: F401 - GPT's attention and positions, unchanged
from parallelkit.models.gpt.parallelize import pipeline_stages as gpt_pipeline_stages
from parallelkit.models.gpt.parallelize import tensor_parallel_plan as gpt_tensor_parallel_plan
from parallelkit.models.moe_gpt.model import MoEGPT, MoELayer

__all__ = ["expert_parallel_plan", "tensor_parallel_plan", "pipeline_blocks", "pipeline_stages", "pipeline_loss"]


def expert_parallel_plan(model: MoEGPT) -> ExpertParallelPlan:
    """One :class:`MoESite` per MoE layer: its grouped experts and the layer that owns the routing seam."""
    return ExpertParallelPlan(
        num_experts=model.num_experts,
        sites=[
            MoESite(name=name, experts=layer.experts, experts_dict=layer.experts.experts, routing_owner=layer)
            for name, layer in model.moe_layers().items()
        ],
    )


# ==================================================================== tensor parallel plan
# Attention, embeddings, output layer and the dense blocks' MLPs split as in the GPT (Megatron-LM's
# layout). An MoE layer is not split: its router and experts stay whole on every tensor-parallel rank,
# which all see the same (replicated) residual stream, route it alike and run the same experts; expert
# parallelism, not tensor parallelism, is what spreads the experts. Its aux loss becomes a replicated
# DTensor, so that it adds to the replicated DTensor loss of the vocabulary-parallel cross-entropy (a
# plain tensor there would receive a DTensor gradient in backward).


class ReplicatedAuxLoss(ParallelStyle):
    """After each forward, wrap the MoE layer's ``aux_loss`` as a DTensor replicated over the tp mesh."""

    def _apply(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        def as_replicated(layer: torch.nn.Module, args: Any, output: Any) -> None:
            if layer.aux_loss is not None and not isinstance(layer.aux_loss, DTensor):
                layer.aux_loss = DTensor.from_local(layer.aux_loss, device_mesh, [Replicate()], run_check=False)

        module.register_forward_hook(as_replicated)
        return module


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's value on this rank (autograd-aware); a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def tensor_parallel_plan(model: MoEGPT, tp: int, *, sequence_parallel: bool = False):
    """The GPT's plan for ``tp`` ranks, minus the MLP entries of the blocks whose MLP is an MoE layer."""
    from parallelkit.errors import ConfigError

    if sequence_parallel:
        raise ConfigError(
            "strategy.sequence_parallel=true does not work with model=moe_gpt: an MoE layer routes the whole "
            "residual stream, which sequence parallelism splits over the tensor-parallel ranks. Set "
            "strategy.sequence_parallel=false."
        )
    plan = gpt_tensor_parallel_plan(model, tp)
    mlp = {key: style for key, style in plan.layout.items() if key.startswith("layers.*.mlp")}
    for key in mlp:
        del plan.layout[key]
    for index, block in model.layers.items():
        if isinstance(block.mlp, MoELayer):
            plan.layout[f"layers.{index}.mlp"] = ReplicatedAuxLoss()
        else:
            plan.layout.update({key.replace("*", index, 1): style for key, style in mlp.items()})
    return plan


# ==================================================================== pipeline split points
# The GPT's cut (a stage owns consecutive blocks; the first the embeddings, the last the head). What a
# pipeline adds for MoE: the load-balancing (and z-) losses of every stage's MoE layers belong to the
# micro-batch's loss, which only the last stage computes. Each stage therefore hands on the running sum
# of its MoE layers' extra losses beside the activations, and the last stage's loss adds it to the
# cross-entropy: the same loss as one process, and its gradient reaches every stage's routers through
# the pipeline's own backward.


class MoEGPTPipelineStage(GPTPipelineStage):
    """A GPT stage that also passes on ``aux``: the sum of the extra losses of the MoE layers so far."""

    def forward(self, x: torch.Tensor, aux: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if aux is None:  # the first stage
            aux = torch.zeros((), dtype=torch.float32, device=x.device)
        x = self.embed(x)
        for block in self.layers.values():
            x = block(x)
            if isinstance(block.mlp, MoELayer) and block.mlp.aux_loss is not None:
                aux = aux + local(block.mlp.aux_loss)  # a plain tensor travels between stages
        return self.head(x), aux


def pipeline_stages(model: MoEGPT, blocks_per_stage, stage_ids):
    """The GPT's stages (see :func:`parallelkit.models.gpt.parallelize.pipeline_stages`), carrying the aux loss."""
    return gpt_pipeline_stages(model, blocks_per_stage, stage_ids, stage_class=MoEGPTPipelineStage)


def pipeline_loss(model: MoEGPT):
    """The last stage's loss: cross-entropy of the logits plus the aux losses gathered along the pipeline."""

    def loss(output, targets):
        logits, aux = output
        return local(GPT.loss(logits, targets)) + aux  # under loss_parallel the cross-entropy is a DTensor

    return loss
