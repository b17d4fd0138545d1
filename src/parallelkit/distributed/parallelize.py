"""The one composition: every enabled technique applied to a model, in one order, from one :class:`ParallelDims`.

Every mesh strategy (``zero``, ``tp``, ``pp``, ``moe``, ``hybrid4d``, and ``auto``'s choice) calls
:func:`parallelize` with its degrees and options; the named strategies differ only in their defaults. The
order is torchtitan's (``parallelize_llama``), each step needing the previous one's result:

1. **TP (+ SP)** on the whole model, over the ``tp`` axis: parameters become DTensors; module names stay, so
   the pipeline cut below still finds them.
2. **CP**: the model's attention over the ``cp`` group (ring or all-to-all) and its positions those of the whole
   sequence (:func:`~parallelkit.distributed.context_parallel.apply_cp`); the strategy cuts each batch with the
   returned handle. Its ranks average gradients with the data-parallel ones (step 7).
3. **EP** for a Mixture-of-Experts model: experts spread over ``ep`` consecutive data-parallel ranks, tokens
   routed by all-to-all; also at ``ep == 1`` for such a model, so that capacity is decided over all
   data-parallel ranks (the loss then does not depend on how the batch is split).
4. **Activation recompute** and 5. **compile**: applied by ``parallelkit.run`` to every strategy's model
   (``recompute=``, ``compile=``), DDP and DeepSpeed included, before the strategy sees it.
6. **Pipeline split**: this rank's stages cut out of the (TP- and EP-split) model by its pipeline plan.
7. **FSDP / ZeRO / DP** on what this rank runs (the model, or its stages): FSDP2 over ``(dp, sharding)``
   when ``sharding > 1`` at ZeRO stage 3 (HSDP when both are > 1, 2-D with TP; sharded over ``sharding × cp``
   with CP), else a bucketed gradient all-reduce over ``dp`` (``dp × cp`` with CP) (stages 1-2 shard the optimizer over ``sharding`` once it exists:
   :func:`apply_optimizer_sharding`). Expert parameters are left out and averaged over the ranks holding
   the same experts.
8. **Pipeline schedule** around the (sharded) stages: FSDP2 must wrap the modules the schedule runs; weights tied
   between the first and the last stage (input and output embeddings) get their gradients summed over the two
   stages' ranks after backward (:func:`~parallelkit.distributed.tied_weights.apply_tied_embedding_sync`).

What the steps made (the TP context of a step, the gradient syncs run after backward in order, the pipeline)
comes back in a :class:`Composition`, for the strategy to keep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from parallelkit.distributed.blocks import select_units
from parallelkit.distributed.context_parallel import ContextParallel, apply_cp
from parallelkit.distributed.expert_parallel import (
    ExpertParallelHandle,
    apply_ep,
    check_expert_parallel,
)
from parallelkit.distributed.fsdp import apply_fsdp, is_sharded
from parallelkit.distributed.grad_sync import (
    DEFAULT_BUCKET_MB,
    GradAllReduce,
    apply_grad_allreduce,
)
from parallelkit.distributed.parallel_dims import CP, DP, PP, SHARDING, TP, ParallelDims
from parallelkit.distributed.pipeline_parallel import (
    PipelineParallel,
    apply_pp,
    stage_blocks,
    stage_ids_for_rank,
)
from parallelkit.distributed.tensor_parallel import apply_tp
from parallelkit.distributed.tied_weights import apply_tied_embedding_sync
from parallelkit.errors import ConfigError

#: kind of the all-reduce that averages expert gradients over the ranks holding the same experts.
EXPERT_GRAD_ALLREDUCE = "expert_grad_allreduce"


@dataclass(frozen=True)
class ParallelOptions:
    """Everything the composition reads besides the degrees (the strategy options, named as on the command line).

    Args:
        sequence_parallel: TP also splits norm/dropout regions along the sequence.
        zero_stage: what ``sharding`` shards: 1 optimizer state, 2 + gradients (both once the optimizer exists),
            3 + parameters (FSDP2).
        per_block / shard_modules / shard_min_params: stage 3's sharding units (the model's repeated blocks by
            default; by class; by size; ``per_block=False``: the whole model as one unit).
        reshard_after_forward: stage 3 frees gathered parameters after forward; ``None``: yes without a
            pipeline, no with one (a stage's forward runs once per micro-batch: M all-gathers otherwise).
        prefetch: stage 3 gathers the next unit while the current one computes.
        offload: ``none``, ``optimizer`` (stages 1-2) or ``params`` (stage 3).
        bucket_mb: bucket size of gradient all-reduces and of stages 1-2's collectives.
        microbatches / schedule / virtual_stages / split / trace: the pipeline (``pp > 1``).
        cp_mode: context parallelism's attention (``cp > 1``): ``ring`` or ``ulysses`` (all-to-all).
    """

    sequence_parallel: bool = False
    cp_mode: str = "ring"
    zero_stage: int = 3
    per_block: bool = True
    shard_modules: tuple[str, ...] | None = None
    shard_min_params: int | None = None
    reshard_after_forward: bool | None = None
    prefetch: bool = True
    offload: str = "none"
    bucket_mb: float = DEFAULT_BUCKET_MB
    microbatches: int = 4
    schedule: str = "1f1b"
    virtual_stages: int = 1
    split: tuple[int, ...] | None = None
    trace: bool = False

    def reshard(self, pp: int) -> bool:
        return (pp == 1) if self.reshard_after_forward is None else bool(self.reshard_after_forward)


@dataclass
class Composition:
    """What :func:`parallelize` made, for the strategy to keep (returned, not set on it: each step's inputs and
    results are its signature)."""

    tensor_parallel: Any = None  # apply_tp's handle: the TP context of a step, and the TP gradient sync
    context_parallel: ContextParallel | None = None  # apply_cp's handle: the batch cut, the ring's counts
    ep_handle: ExpertParallelHandle | None = None
    expert_dp_group: Any = None  # the ranks holding the same experts
    pipeline: PipelineParallel | None = None
    stage_blocks: list[list[int]] | None = None  # blocks of every pipeline stage
    tied_embeddings: Any = None  # the pipeline's tied-weight gradient sum (its ``duplicates``: counted once in a norm)
    grad_syncs: list[GradAllReduce] = field(default_factory=list)  # in the order they run after backward


def parallelize(model: torch.nn.Module, dims: ParallelDims, mesh: Any, plans: Any, options: ParallelOptions, *,
                rank: int, device: torch.device, comm_stats: Any = None) -> Composition:
    """Apply every technique ``dims`` turns on to ``model`` in place, in the module docstring's order.

    Args:
        model: the single-device model (its parallel plans in ``plans``, a :class:`~parallelkit.models.plans.ModelPlans`).
        dims: the resolved degrees; ``mesh``: the named mesh they built (:meth:`ParallelDims.build_mesh`).
        options: the strategy's :class:`ParallelOptions`.
        rank: this process's global rank; ``device``: where it computes.
        comm_stats: where the collectives of every technique are counted.
    """
    done = Composition()
    # 1. TP (+ SP): first, so that EP, the pipeline cut and FSDP2 see the DTensor parameters it makes. Its
    # gradient sync (partial sums of replicated parameters on sequence shards) runs first after backward.
    if dims.tp_enabled:
        plan = plans.tensor_parallel_plan(dims.tp, sequence_parallel=options.sequence_parallel,
                                          who=f"strategy.tp={dims.tp}")
        done.tensor_parallel = apply_tp(model, mesh[TP], plan, comm_stats=comm_stats)
        done.grad_syncs.append(done.tensor_parallel)
    # 2. CP: after TP (attention then sees this rank's heads), before the pipeline cut (the stages keep the modules).
    if dims.cp_enabled:
        plan = plans.context_parallel_plan(who=f"strategy.cp={dims.cp}")
        done.context_parallel = apply_cp(model, mesh[CP], plan, mode=options.cp_mode, comm_stats=comm_stats)
    # 3. EP, on the whole model: the pipeline cut then keeps the local experts of this rank's stages.
    expert_plan = expert_plan_if_moe(plans)
    if dims.ep_enabled and expert_plan is None:
        expert_plan = plans.expert_parallel_plan(who=f"strategy.ep={dims.ep}")  # raises: no MoE layers
    if expert_plan is not None:
        check_expert_parallel(expert_plan, dims.ep)
        # new_subgroups_by_enumeration is collective: every rank creates every group, in this order.
        ep_group, _ = dist.new_subgroups_by_enumeration(dims.expert_parallel_groups())
        done.expert_dp_group, _ = dist.new_subgroups_by_enumeration(dims.expert_data_parallel_groups())
        routing_group, _ = dist.new_subgroups_by_enumeration(dims.data_parallel_groups())
        done.ep_handle = apply_ep(model, expert_plan, ep_group=ep_group, routing_group=routing_group, comm_stats=comm_stats)
    # 4. recompute, 5. compile: parallelkit.run, before the strategy.
    # 6. pipeline split: this rank's stages; the rest of the model is dropped.
    modules = [model]
    if dims.pp_enabled:
        num_stages = dims.pp * options.virtual_stages
        blocks = stage_blocks(plans.pipeline_blocks(), num_stages, list(options.split) if options.split else None)
        stage_ids = stage_ids_for_rank(dims.coordinates(rank)[PP], dims.pp, options.virtual_stages, options.schedule)
        loss_fn = plans.pipeline_loss()  # before the cut: a loss may need modules of the model
        modules = plans.pipeline_stages(blocks, stage_ids)
        done.stage_blocks = [[b.start, b.stop] for b in blocks]
    # 7. FSDP / ZeRO / DP on what this rank runs.
    done.grad_syncs += apply_data_parallel(modules, dims, mesh, options, comm_stats, done.ep_handle, done.expert_dp_group)
    # 8. the schedule around the sharded stages; tied first/last-stage weights summed after the TP and DP syncs
    # (it needs the gradients in their parameters' layout), before the optimizer step.
    if dims.pp_enabled:
        done.pipeline = apply_pp(modules, stage_ids, num_stages, mesh.get_group(PP), microbatches=options.microbatches,
                                 schedule=options.schedule, loss_fn=loss_fn, device=device, comm_stats=comm_stats,
                                 trace=options.trace)
        done.tied_embeddings = apply_tied_embedding_sync(modules, stage_ids, num_stages, mesh.get_group(PP), comm_stats=comm_stats)
        done.grad_syncs.append(done.tied_embeddings)
    return done


def expert_plan_if_moe(plans: Any) -> Any:
    """The model's expert-parallel plan if it has one with MoE layers, else None (a plan that refuses, with its
    reason, matters only when ``ep > 1``: :func:`parallelize` asks for it then)."""
    make = plans.find("expert_parallel_plan")
    try:
        plan = make(plans.model) if make is not None else None
    except ConfigError:
        return None
    return plan if plan is not None and plan.sites else None


def sharding_units(model: torch.nn.Module, options: ParallelOptions) -> list[torch.nn.Module]:
    """Stage 3's sharding units of ``model`` (see :class:`ParallelOptions`); none where the model already chose its
    own (a LightningModule's ``configure_model`` called ``fully_shard``)."""
    if is_sharded(model):
        if options.shard_modules or options.shard_min_params is not None:
            raise ConfigError(
                f"{type(model).__name__}.configure_model already shards the model (fully_shard), and "
                "strategy.shard_modules / strategy.shard_min_params would choose other units. Use one or the other."
            )
        return []
    if not options.per_block:
        return []
    return select_units(model, shard_modules=list(options.shard_modules or []) or None, min_params=options.shard_min_params)


def apply_data_parallel(modules: list[torch.nn.Module], dims: ParallelDims, mesh: Any, options: ParallelOptions,
                        comm_stats: Any, ep_handle: ExpertParallelHandle | None = None,
                        expert_dp_group: Any = None) -> list[GradAllReduce]:
    """Step 7 for ``modules`` (the model, or this rank's pipeline stages); returns the gradient syncs it adds.

    Dense parameters: FSDP2 over the ``(dp, sharding)`` sub-mesh at stage 3 with ``sharding > 1``; else their
    gradients averaged over the data-parallel ranks that hold whole copies (``dp``, and ``sharding`` too at
    stages 1-2, whose optimizer sharding then takes over the averaging). Expert parameters are left out of both
    and averaged over ``expert_dp_group``, the ranks that hold the same experts.
    """
    expert_ids = {id(p) for p in ep_handle.expert_params} if ep_handle is not None else set()
    params = [p for module in modules for p in module.parameters() if p.requires_grad]
    experts = [p for p in params if id(p) in expert_ids]
    dense = [p for p in params if id(p) not in expert_ids]
    syncs: list[GradAllReduce] = []
    if dims.sharding_enabled and options.zero_stage == 3:
        # Context-parallel ranks hold the same parameters: FSDP2 shards them over sharding × cp (torchtitan's dp_shard_cp).
        shard = flat_axes(mesh, (SHARDING, CP)) if dims.cp_enabled else SHARDING
        for module in modules:
            apply_fsdp(module, mesh[(DP, shard)] if dims.dp > 1 else mesh[shard], units=sharding_units(module, options),
                       reshard_after_forward=options.reshard(dims.pp), prefetch=options.prefetch,
                       offload_params=options.offload == "params", ignored_params=set(experts) or None, comm_stats=comm_stats)
    elif not dims.sharding_enabled:
        replicas = mesh[flat_axes(mesh, (DP, SHARDING, CP))] if dims.cp_enabled else mesh[DP]  # sharding is 1 here
        syncs.append(apply_grad_allreduce(dense, replicas.get_group(), comm_stats=comm_stats, bucket_mb=options.bucket_mb))
    # stages 1-2 (sharding > 1): ZeroOptimizer reduce-scatters the dense gradients (apply_optimizer_sharding).
    if experts:
        syncs.append(apply_grad_allreduce(experts, expert_dp_group, comm_stats=comm_stats, bucket_mb=options.bucket_mb,
                                          kind=EXPERT_GRAD_ALLREDUCE))
    return syncs


def flat_axes(mesh: Any, axes: tuple[str, ...]) -> str:
    """The name of ``axes`` flattened into one axis of ``mesh``, made once (the axes are adjacent in the mesh order:
    :class:`ParallelDims` checks it for the gradient axes when ``cp > 1``)."""
    name = "_".join(axes)
    if name not in getattr(mesh._get_root_mesh(), "_flatten_mapping", {}):
        mesh[axes]._flatten(name)
    return name


def apply_optimizer_sharding(optimizers: list[Any], dims: ParallelDims, mesh: Any, options: ParallelOptions,
                             param_names: dict[Any, str], comm_stats: Any) -> list[Any]:
    """Step 7's second half at ZeRO stages 1-2: shard each optimizer's state (and at stage 2 its gradients) over
    ``sharding``, replicated over ``dp``; returns the :class:`~parallelkit.distributed.zero_optimizer.ZeroOptimizer` s."""
    from parallelkit.distributed.zero_optimizer import ZeroOptimizer

    if not (dims.sharding_enabled and options.zero_stage in (1, 2)):
        return []
    return [
        ZeroOptimizer(
            optimizer,
            stage=options.zero_stage,
            shard_group=mesh.get_group(SHARDING),
            replicate_group=mesh.get_group(DP) if dims.dp > 1 else None,
            param_names=param_names,
            offload=options.offload == "optimizer",
            bucket_mb=options.bucket_mb,
            comm_stats=comm_stats,
        )
        for optimizer in optimizers
    ]
