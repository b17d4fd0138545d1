"""Hybrid parallelism: tensor × expert × sharding/data × pipeline parallel on one named mesh.

A thin composition of the techniques in :mod:`parallelkit.distributed`, in the fixed order torchtitan's
``parallelize_*`` uses (each step needs the previous one's result, see :func:`compose_before_pipeline`):

1. **TP** (:func:`~parallelkit.distributed.tensor_parallel.apply_tp`) on the *whole* model, over the ``tp``
   mesh axis: parameters become DTensors; module names stay, so the pipeline cut below still finds them.
2. **EP** (:func:`~parallelkit.distributed.expert_parallel.apply_ep`) for a Mixture-of-Experts model:
   experts spread over ``ep`` consecutive data-parallel ranks, tokens routed by all-to-all, capacity
   decided over all data-parallel ranks (so nothing depends on how the batch is split).
3. **recompute**: already applied by ``run.py`` to every strategy's model (``recompute=``).
4. **sharding / DP** (:func:`apply_data_parallel`): FSDP2 over the ``(dp, sharding)`` sub-mesh (HSDP when
   both are > 1, 2-D with TP like torchtitan), or plain gradient averaging over ``dp`` when
   ``sharding == 1``; experts are left out of FSDP2 and averaged over the ranks holding the same ones.
5. **PP** (:func:`~parallelkit.distributed.pipeline_parallel.apply_pp`, through :class:`PipelineStrategy`):
   cuts the (TP- and EP-split) model into this rank's stages, applies step 4 to the stages, and owns the
   training step.

``pp == 1`` runs Lightning's ordinary step (:class:`Hybrid4DStrategy`); ``pp > 1`` needs the pipeline's
step (:class:`Hybrid4DPipelineStrategy`). ``strategy=hybrid4d`` builds the right one with
:func:`hybrid4d`. Combinations not composed yet raise :class:`ConfigError` before any process starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import override

from parallelkit.capabilities import LIGHTNING_BACKWARD
from parallelkit.distributed.elastic import DEFAULT_TIMEOUT_S
from parallelkit.distributed.expert_parallel import ExpertParallelHandle, ExpertParallelPlan, apply_ep, check_expert_parallel
from parallelkit.distributed.fsdp import apply_fsdp
from parallelkit.distributed.grad_sync import GradAllReduce, apply_grad_allreduce
from parallelkit.distributed.parallel_dims import DEFAULT_MESH_ORDER, DP, PP, SHARDING, TP, ParallelDims
from parallelkit.distributed.tensor_parallel import apply_tp
from parallelkit.errors import ConfigError
from parallelkit.models.plans import model_plans
from parallelkit.strategies.mesh import MeshStrategy
from parallelkit.strategies.moe import EXPERT_GRAD_ALLREDUCE
from parallelkit.strategies.pp import PipelineStrategy
from parallelkit.strategies.tp import TensorParallelSteps, say_if_experts_replicated

STRATEGY_NAME = "hybrid4d"


def check_hybrid_degrees(dp: Any, sharding: Any, tp: Any, pp: Any, ep: Any, sequence_parallel: bool) -> None:
    """Refuse, before launch, the combinations this version does not compose (naming each and why)."""
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(
                f"strategy=hybrid4d needs an explicit strategy.{name} ≥ 1 (got {value!r}): it decides the model split. "
                "Use -1 for strategy.dp or strategy.sharding to take the remaining ranks."
            )
    problems = []
    if sequence_parallel and pp > 1:
        problems.append(
            f"strategy.sequence_parallel=true with strategy.pp={pp}: sequence-sharded activations between pipeline "
            "stages are not composed yet (set sequence_parallel=false)"
        )
    if sequence_parallel and sharding != 1:
        problems.append(
            f"strategy.sequence_parallel=true with strategy.sharding={sharding}: the partial-sum LayerNorm gradients of "
            "sequence parallel are not reduced through FSDP2 yet (set sequence_parallel=false)"
        )
    if problems:
        raise ConfigError("strategy=hybrid4d cannot run this combination: " + "; ".join(problems) + ".")


def expert_plan_if_moe(model: torch.nn.Module, source: Any = None) -> ExpertParallelPlan | None:
    """The model's expert-parallel plan if it has one with MoE layers, else None (a plan that refuses, with its
    reason, matters only when ``ep > 1``: :meth:`HybridParts.check_model` asks for it then)."""
    make = model_plans(model, source).find("expert_parallel_plan")
    try:
        plan = make(model) if make is not None else None
    except ConfigError:
        return None
    return plan if plan is not None and plan.sites else None


@dataclass
class Composition:
    """What composing the techniques made, for the strategy to keep (:meth:`HybridParts._adopt`, the one place
    it does): returned rather than set on the strategy, so each step's inputs and results are its signature."""

    tensor_parallel: Any = None  # apply_tp's handle: the TP context of the step, and the TP gradient sync
    ep_handle: ExpertParallelHandle | None = None
    expert_dp_group: Any = None  # the ranks holding the same experts
    grad_syncs: list[GradAllReduce] = field(default_factory=list)  # in the order they run after backward


@dataclass(frozen=True)
class HybridOptions:
    """The strategy options the composition reads."""

    plan_source: str | None
    sequence_parallel: bool
    per_block: bool
    reshard_after_forward: bool


def compose_before_pipeline(model: torch.nn.Module, dims: ParallelDims, mesh: Any, options: HybridOptions,
                            comm_stats: Any) -> Composition:
    """Steps 1-4 of the module docstring's order on ``mesh`` (the model in place); returns the handles.

    TP first: EP, FSDP2 and the pipeline cut must see the DTensor parameters TP makes. EP next, on the whole
    model: the pipeline cut then keeps the local experts of this rank's stages. The TP gradient sync
    (partial sums under sequence parallel) comes first in ``grad_syncs``, before any data-parallel average,
    which averages each rank's local shards. With a pipeline, step 4 runs on the stages after the cut.
    """
    done = Composition()
    # 1. TP
    if dims.tp > 1:
        plan = model_plans(model, options.plan_source).tensor_parallel_plan(
            dims.tp, sequence_parallel=options.sequence_parallel, who=f"strategy=hybrid4d with strategy.tp={dims.tp}")
        done.tensor_parallel = apply_tp(model, mesh[TP], plan, comm_stats=comm_stats)
        done.grad_syncs.append(done.tensor_parallel)
    # 2. EP: also at ep == 1 for an MoE model, so that capacity is decided over all data-parallel ranks.
    expert_plan = expert_plan_if_moe(model, options.plan_source)
    if expert_plan is not None:
        # new_subgroups_by_enumeration is collective: every rank creates every group, in this order.
        ep_group, _ = dist.new_subgroups_by_enumeration(dims.expert_parallel_groups())
        done.expert_dp_group, _ = dist.new_subgroups_by_enumeration(dims.expert_data_parallel_groups())
        routing_group, _ = dist.new_subgroups_by_enumeration(dims.data_parallel_groups())
        done.ep_handle = apply_ep(model, expert_plan, ep_group=ep_group, routing_group=routing_group, comm_stats=comm_stats)
    # 3. recompute: run.py, before the strategy.
    # 4. sharding / DP: on the whole model here; with a pipeline, on this rank's stages once they are cut
    # (PipelineStrategy calls apply_data_parallel).
    if dims.pp == 1:
        done.grad_syncs += apply_data_parallel([model], dims, mesh, options, comm_stats, done.ep_handle, done.expert_dp_group)
    return done


def apply_data_parallel(modules: list[torch.nn.Module], dims: ParallelDims, mesh: Any, options: HybridOptions, comm_stats: Any,
                        ep_handle: ExpertParallelHandle | None = None, expert_dp_group: Any = None) -> list[GradAllReduce]:
    """Step 4 for ``modules`` (the model, or its pipeline stages); returns the gradient syncs it adds.

    Dense parameters: FSDP2 over the ``(dp, sharding)`` sub-mesh when ``sharding > 1`` (HSDP if ``dp > 1``
    too), else plain gradient averaging over ``dp``. Expert parameters (EP keeps different ones on the ranks
    of an expert-parallel group, ``ep_handle``) are left out of FSDP2 and averaged over ``expert_dp_group``,
    the ranks that hold the same ones.
    """
    expert_ids = {id(p) for p in ep_handle.expert_params} if ep_handle is not None else set()
    params = [p for module in modules for p in module.parameters() if p.requires_grad]
    experts = [p for p in params if id(p) in expert_ids]
    dense = [p for p in params if id(p) not in expert_ids]
    syncs: list[GradAllReduce] = []
    if dims.sharding > 1:
        for module in modules:
            apply_fsdp(
                module,
                mesh[(DP, SHARDING)] if dims.dp > 1 else mesh[SHARDING],
                units=None if options.per_block else [],
                reshard_after_forward=options.reshard_after_forward,
                ignored_params=set(experts) or None,
                comm_stats=comm_stats,
            )
    else:
        syncs.append(apply_grad_allreduce(dense, mesh[DP].get_group(), comm_stats=comm_stats))
    if experts:
        syncs.append(apply_grad_allreduce(experts, expert_dp_group, comm_stats=comm_stats, kind=EXPERT_GRAD_ALLREDUCE))
    return syncs


def resolve_reshard_after_forward(value: bool | None, pp: int) -> bool:
    """FSDP2's ``reshard_after_forward`` for the sharding step: ``value``, or by default ZeRO-3 (free the gathered
    parameters after forward) without a pipeline, and keep them through the step with one, as torchtitan
    does: a pipeline runs a stage's forward once per micro-batch, and resharding would all-gather it M times."""
    return (pp == 1) if value is None else bool(value)


class HybridParts:
    """What the two hybrid strategies share: their options, the model checks before launch, EP bookkeeping.

    Mixed in before :class:`TensorParallelSteps` and the Lightning-facing base class.
    """

    ep_handle: ExpertParallelHandle | None = None
    expert_dp_group: Any = None

    def _init_hybrid(self, sequence_parallel: bool, per_block: bool, reshard_after_forward: bool | None, plan: str | None) -> None:
        self.plan_source = plan
        self.sequence_parallel = sequence_parallel
        self.per_block = per_block
        self.reshard_after_forward = resolve_reshard_after_forward(reshard_after_forward, self._degrees[PP])
        self.tensor_parallel = None
        self.ep_handle = None

    def _options(self) -> HybridOptions:
        return HybridOptions(self.plan_source, self.sequence_parallel, self.per_block, self.reshard_after_forward)

    def _compose(self, model: torch.nn.Module) -> None:
        """Steps 1-4 (1-2 with a pipeline) on the whole model, their handles kept."""
        self._adopt(compose_before_pipeline(model, self.parallel_dims, self.device_mesh, self._options(), self.comm_stats))

    def _adopt(self, done: Composition) -> None:
        # The one place the composition's results become the strategy's (the TP context of the step, the
        # expert bookkeeping of checkpoints and summaries, and the gradient syncs run after backward).
        self.tensor_parallel = done.tensor_parallel
        self.ep_handle = done.ep_handle
        self.expert_dp_group = done.expert_dp_group
        self.grad_syncs.extend(done.grad_syncs)

    def default_devices(self, accelerator: str) -> int:
        """On CPU without ``trainer.devices``: the smallest world the degrees fit (a ``-1`` degree takes 1)."""
        if accelerator == "gpu":
            return super().default_devices(accelerator)
        return math.prod(v for k, v in self._degrees.items() if k in (DP, SHARDING, TP, PP) and v != -1)

    def check_model(self, model: torch.nn.Module, world_size: int) -> None:
        """Before launch: the model can be split as planned (heads % tp, experts % ep; the pipeline's blocks
        are checked by ``check_workload``)."""
        dims = self.plan(world_size)
        plans = model_plans(model, self.plan_source)
        if dims.tp > 1:
            plans.tensor_parallel_plan(dims.tp, sequence_parallel=self.sequence_parallel, who=f"strategy=hybrid4d with strategy.tp={dims.tp}")
            if dims.ep == 1:
                say_if_experts_replicated(model, self.plan_source, f"strategy=hybrid4d with strategy.tp={dims.tp} and strategy.ep=1")
        if dims.ep > 1:
            check_expert_parallel(plans.expert_parallel_plan(who=f"strategy=hybrid4d with strategy.ep={dims.ep}"), dims.ep)

    def bind_trainer_config(self, trainer_cfg: dict[str, Any]) -> None:
        _refuse_norm_clipping_with_experts(self._degrees["ep"], trainer_cfg.get("gradient_clip_val"), trainer_cfg.get("gradient_clip_algorithm"))

    def setup(self, trainer: Any) -> None:
        _refuse_norm_clipping_with_experts(self._degrees["ep"], trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
        super().setup(trainer)

    def param_groups_key(self) -> str:
        # ranks of different expert shards list different expert parameters (see MeshStrategy.param_groups_key)
        key = super().param_groups_key()
        if self.ep_handle is not None and self.parallel_dims.ep > 1:
            key += "_experts_" + "_".join(map(str, self.ep_handle.local_experts))
        return key

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self.ep_handle is not None:  # each rank reads its own experts (plain tensors beside FSDP's DTensors)
            return self._load_per_rank_checkpoint(checkpoint_path, weights_only)
        return super().load_checkpoint(checkpoint_path, weights_only)

    def summary_metrics(self, trainer: Any) -> dict[str, Any]:
        metrics = super().summary_metrics(trainer)
        if self.ep_handle is not None:
            metrics["expert_parallel"] = {"ep": self.parallel_dims.ep, "local_experts": self.ep_handle.local_experts}
        return metrics


def _refuse_norm_clipping_with_experts(ep: int, clip: Any, algorithm: Any) -> None:
    if ep > 1 and clip and (algorithm or "norm") == "norm":
        raise ConfigError(
            f"strategy=hybrid4d with strategy.ep={ep} does not support trainer.gradient_clip_val={clip} by norm: each "
            "rank holds different experts, so each would compute a different gradient norm and the replicas would "
            "drift apart. Use trainer.gradient_clip_algorithm=value, or leave gradient_clip_val null."
        )


class Hybrid4DStrategy(HybridParts, TensorParallelSteps, MeshStrategy):
    """``dp × sharding × tp`` (× ``ep``; ``pp == 1``): Lightning's own training step inside the TP context.

    Example::

        python train.py strategy=hybrid4d strategy.pp=1 strategy.tp=2 strategy.sharding=2 trainer.devices=4
    """

    strategy_name = STRATEGY_NAME
    capabilities = frozenset({LIGHTNING_BACKWARD})

    def __init__(self, dp: int = -1, sharding: int = 1, tp: int = 2, ep: int = 1, *, sequence_parallel: bool = False,
                 per_block: bool = True, reshard_after_forward: bool | None = None, plan: str | None = None, **kwargs: Any) -> None:
        check_hybrid_degrees(dp, sharding, tp, 1, ep, sequence_parallel)
        super().__init__(dp=dp, sharding=sharding, tp=tp, pp=1, ep=ep, **kwargs)
        self._init_hybrid(sequence_parallel, per_block, reshard_after_forward, plan)

    @override
    def parallelize(self, model: torch.nn.Module) -> None:
        self._compose(model)


class Hybrid4DPipelineStrategy(HybridParts, TensorParallelSteps, PipelineStrategy):
    """``dp × sharding × tp × pp`` (× ``ep``; ``pp > 1``): the pipeline owns the step; TP splits every stage's
    layers, FSDP2 shards every stage.

    The pipeline's schedule (forward, loss, backward) runs inside the TP context, so a vocabulary-parallel
    output layer's loss runs under ``loss_parallel`` on the last stage.
    """

    strategy_name = STRATEGY_NAME

    def __init__(self, dp: int = -1, sharding: int = 1, tp: int = 2, pp: int = 2, ep: int = 1, *,
                 sequence_parallel: bool = False, per_block: bool = True, reshard_after_forward: bool | None = None,
                 plan: str | None = None, **kwargs: Any) -> None:
        check_hybrid_degrees(dp, sharding, tp, pp, ep, sequence_parallel)
        super().__init__(pp=pp, dp=dp, plan=plan, **kwargs)
        self._degrees.update(sharding=sharding, tp=tp, ep=ep)  # PipelineStrategy takes pp and dp only; ParallelDims validates all
        self._init_hybrid(sequence_parallel, per_block, reshard_after_forward, plan)

    @override
    def parallelize(self, model: torch.nn.Module) -> None:
        self._compose(model)  # 1-3 (TP, EP) on the whole model
        super().parallelize(model)  # 5. PP: cut into this rank's stages, 4. sharding/DP on them, then the schedule

    @override
    def apply_data_parallel(self, stage_modules: list[torch.nn.Module]) -> list[GradAllReduce]:
        return apply_data_parallel(stage_modules, self.parallel_dims, self.device_mesh, self._options(), self.comm_stats,
                                   self.ep_handle, self.expert_dp_group)

    @override
    def _loss_from_last_stage(self, loss: torch.Tensor | None) -> torch.Tensor:
        # Under loss_parallel the last stage's loss is a replicated DTensor: every tp rank holds the value.
        if loss is not None and hasattr(loss, "to_local"):
            loss = loss.to_local()
        return super()._loss_from_last_stage(loss)


def hybrid4d(
    dp: int = -1,
    sharding: int = 1,
    tp: int = 2,
    pp: int = 2,
    ep: int = 1,
    mesh_order: tuple[str, ...] | list[str] = DEFAULT_MESH_ORDER,
    sequence_parallel: bool = False,
    per_block: bool = True,
    reshard_after_forward: bool | None = None,
    microbatches: int = 4,
    schedule: str = "1f1b",
    virtual_stages: int | None = None,
    split: list[int] | None = None,
    trace: bool = False,
    plan: str | None = None,
    save_distributed_checkpoint: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    process_group_backend: str | None = None,
) -> MeshStrategy:
    """``strategy=hybrid4d``: the strategy for these degrees (``-1``: the remaining ranks, dp or sharding).

    Args:
        dp / sharding / tp / pp / ep: the degrees (:class:`ParallelDims`); the mesh is ``mesh_order``
            (default ``pp, dp, sharding, tp``: tp innermost = adjacent ranks, pp outermost).
        sequence_parallel: TP also splits LayerNorm/dropout regions along the sequence.
        per_block / reshard_after_forward: FSDP2 options when ``sharding > 1`` (see ``strategy=zero``);
            ``reshard_after_forward=None``: ZeRO-3 without a pipeline, kept gathered through the step with one
            (:func:`resolve_reshard_after_forward`).
        microbatches / schedule / virtual_stages / split / trace: pipeline options when ``pp > 1``.
        plan: where the model's plans are (``mypkg.parallelize``); ``None``: the model's own methods, then the
            ``parallelize`` module beside its class (:mod:`parallelkit.models.plans`).
    """
    common = dict(dp=dp, sharding=sharding, tp=tp, ep=ep, mesh_order=mesh_order, sequence_parallel=sequence_parallel,
                  per_block=per_block, reshard_after_forward=reshard_after_forward, plan=plan,
                  save_distributed_checkpoint=save_distributed_checkpoint, timeout_s=timeout_s,
                  process_group_backend=process_group_backend)
    check_hybrid_degrees(dp, sharding, tp, pp, ep, sequence_parallel)
    if pp > 1:
        return Hybrid4DPipelineStrategy(pp=pp, microbatches=microbatches, schedule=schedule, virtual_stages=virtual_stages,
                                        split=split, trace=trace, **common)
    return Hybrid4DStrategy(**common)
