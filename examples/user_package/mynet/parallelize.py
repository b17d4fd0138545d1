"""The parallel plans of :class:`mynet.model.CharMLP`, beside its class, where parallelkit looks for them.

(Or name this module in the config, ``strategy.plan=mynet.parallelize``, or give the model methods of the
same names.) The model code stays single-device; these functions tell parallelkit's techniques how to
split it.
"""

from __future__ import annotations

from torch import nn

from parallelkit.distributed.tensor_parallel import TensorParallelPlan
from parallelkit.errors import ConfigError


def tensor_parallel_plan(model, tp: int, *, sequence_parallel: bool = False) -> TensorParallelPlan:
    """Megatron's MLP split in every block: ``up`` column-parallel (each rank computes hidden / tp units, no
    communication), ``down`` row-parallel (partial sums, one all-reduce). Everything else stays whole."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    hidden = model.blocks[0].up.out_features
    if hidden % tp or sequence_parallel:
        raise ConfigError(f"mynet splits its {hidden} hidden units over tp ranks, without sequence parallel: "
                          f"use a strategy.tp that divides {hidden}, and strategy.sequence_parallel=false.")
    return TensorParallelPlan(layout={"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()},
                              scopes={"blocks.*": "tp_block"})


def pipeline_blocks(model) -> int:
    """The pipeline deals out the blocks: stage 0 also embeds, the last stage also predicts."""
    return len(model.blocks)


def pipeline_stages(model, blocks_per_stage: list[range], stage_ids: list[int]) -> list[nn.Module]:
    """This rank's stages (views on the model's modules), and nothing else of the model kept."""
    last = len(blocks_per_stage) - 1
    stages = []
    for stage in stage_ids:
        parts = [model.blocks[i] for i in blocks_per_stage[stage]]
        stages.append(nn.Sequential(*([model.embed] if stage == 0 else []), *parts, *([model.head] if stage == last else [])))
    kept = {i for stage in stage_ids for i in blocks_per_stage[stage]}
    for i in range(len(model.blocks)):
        if i not in kept:
            model.blocks[i] = nn.Identity()  # frees the block; the kept ones keep their names (checkpoints)
    if 0 not in stage_ids:
        model.embed = None
    if last not in stage_ids:
        model.head = None
    return stages
