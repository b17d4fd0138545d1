"""Hybrid parallelism: tensor parallel × sharding/data parallel × pipeline parallel on one named mesh.

A thin composition of the techniques in :mod:`parallelkit.distributed`, in the fixed order torchtitan's
``parallelize_*`` uses (each step needs the previous one's result, see :func:`compose_before_pipeline`):

1. **TP** (:func:`~parallelkit.distributed.tensor_parallel.apply_tp`) on the *whole* model, over the ``tp``
   mesh axis: parameters become DTensors; module names stay, so the pipeline cut below still finds them.
2. **EP**: not composed here yet (refused before launch; ``strategy=moe`` runs ep × dp).
3. **recompute**: already applied by ``run.py`` to every strategy's model (``recompute=``).
4. **sharding / DP**: FSDP2 (:func:`~parallelkit.distributed.fsdp.apply_fsdp`) over the ``(dp, sharding)``
   sub-mesh (HSDP when both are > 1, 2-D with TP like torchtitan), or plain gradient averaging over ``dp``
   (:func:`~parallelkit.distributed.grad_sync.apply_grad_allreduce`) when ``sharding == 1``.
5. **PP** (:func:`~parallelkit.distributed.pipeline_parallel.apply_pp`, through :class:`PipelineStrategy`):
   cuts the (TP-split) model into this rank's stages and owns the training step; the stage's gradients
   are then averaged over ``dp``.

``pp == 1`` runs Lightning's ordinary step (:class:`Hybrid4DStrategy`); ``pp > 1`` needs the pipeline's
step (:class:`Hybrid4DPipelineStrategy`). ``strategy=hybrid4d`` builds the right one with
:func:`hybrid4d`. Combinations not composed yet raise :class:`ConfigError` before any process starts.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from parallelkit.distributed.fsdp import apply_fsdp
from parallelkit.distributed.grad_sync import apply_grad_allreduce
from parallelkit.distributed.parallel_dims import DEFAULT_MESH_ORDER, DP, PP, SHARDING, TP, ParallelDims
from parallelkit.distributed.tensor_parallel import apply_tp
from parallelkit.errors import ConfigError
from parallelkit.strategies.base import LIGHTNING_BACKWARD
from parallelkit.strategies.mesh import DEFAULT_TIMEOUT_S, MeshStrategy
from parallelkit.strategies.pp import PipelineStrategy
from parallelkit.strategies.tp import TensorParallelSteps, tensor_parallel_plan_of

STRATEGY_NAME = "hybrid4d"


def check_hybrid_degrees(dp: Any, sharding: Any, tp: Any, pp: Any, ep: Any, sequence_parallel: bool) -> None:
    """Refuse, before launch, the combinations this version does not compose (naming each and why)."""
    for name, value in (("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(
                f"strategy=hybrid4d needs an explicit strategy.{name} ≥ 1 (got {value!r}): it decides the model split. "
                "Use -1 for strategy.dp or strategy.sharding to take the remaining ranks."
            )
    problems = []
    if ep != 1:
        problems.append(
            f"strategy.ep={ep}: expert parallel is not composed with tp/sharding/pp in hybrid4d yet "
            "(use strategy=moe for ep × dp)"
        )
    if pp > 1 and sharding != 1:
        problems.append(
            f"strategy.sharding={sharding} with strategy.pp={pp}: FSDP2 sharding of pipeline stages is not composed yet "
            "(use strategy.dp for the data-parallel ranks of a pipeline)"
        )
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


def compose_before_pipeline(strategy: Any, model: torch.nn.Module) -> None:
    """Steps 1-4 of the module docstring's order, on ``strategy``'s mesh (in place).

    TP first: FSDP2 and the pipeline cut must see the DTensor parameters TP makes. The TP gradient sync
    (partial sums under sequence parallel) is appended to ``grad_syncs`` before any data-parallel average,
    which averages each rank's local shards. With a pipeline, the dp average is appended by
    :class:`PipelineStrategy` after the cut (only the stage's parameters).
    """
    dims: ParallelDims = strategy.parallel_dims
    mesh = strategy.device_mesh
    # 1. TP
    if dims.tp > 1:
        plan = tensor_parallel_plan_of(model)(model, dims.tp, sequence_parallel=strategy.sequence_parallel)
        strategy.tensor_parallel = apply_tp(model, mesh[TP], plan, comm_stats=strategy.comm_stats)
        strategy.grad_syncs.append(strategy.tensor_parallel)
    # 2. EP: refused by check_hybrid_degrees.  3. recompute: run.py, before the strategy.
    # 4. sharding / DP (without a pipeline; PipelineStrategy adds the stage's dp average itself)
    if dims.pp > 1:
        return
    if dims.sharding > 1:
        apply_fsdp(
            model,
            mesh[(DP, SHARDING)] if dims.dp > 1 else mesh[SHARDING],
            per_block=strategy.per_block,
            reshard_after_forward=strategy.reshard_after_forward,
            comm_stats=strategy.comm_stats,
        )
    else:
        strategy.grad_syncs.append(apply_grad_allreduce(model.parameters(), mesh[DP].get_group(), comm_stats=strategy.comm_stats))


def _default_devices(strategy: Any, accelerator: str) -> int | None:
    """On CPU without ``trainer.devices``: the smallest world the degrees fit (a ``-1`` degree takes 1)."""
    if accelerator == "gpu":
        return None
    return math.prod(v for k, v in strategy._degrees.items() if k in (DP, SHARDING, TP, PP) and v != -1)


def _check_model(strategy: Any, model: torch.nn.Module, world_size: int) -> None:
    tp = strategy.plan(world_size).tp
    if tp > 1:  # heads, width, vocabulary (and sequence) must divide by tp
        tensor_parallel_plan_of(model)(model, tp, sequence_parallel=strategy.sequence_parallel)


def _refuse_norm_clipping(tp: int, clip: Any, algorithm: Any) -> None:
    if tp > 1 and clip and (algorithm or "norm") == "norm":
        raise ConfigError(
            f"strategy=hybrid4d with pp > 1 and tp={tp} does not support trainer.gradient_clip_val={clip} by norm yet: "
            "the pipeline's whole-model norm does not sum tensor-parallel shards. Use "
            "trainer.gradient_clip_algorithm=value, strategy.pp=1, or no clipping."
        )


class Hybrid4DStrategy(TensorParallelSteps, MeshStrategy):
    """``dp × sharding × tp`` (``pp == 1``): Lightning's own training step inside the TP context.

    Example::

        python train.py strategy=hybrid4d strategy.pp=1 strategy.tp=2 strategy.sharding=2 trainer.devices=4
    """

    strategy_name = STRATEGY_NAME
    capabilities = frozenset({LIGHTNING_BACKWARD})

    def __init__(self, dp: int = -1, sharding: int = 1, tp: int = 2, ep: int = 1, *, sequence_parallel: bool = False,
                 per_block: bool = True, reshard_after_forward: bool = True, **kwargs: Any) -> None:
        check_hybrid_degrees(dp, sharding, tp, 1, ep, sequence_parallel)
        super().__init__(dp=dp, sharding=sharding, tp=tp, pp=1, ep=ep, **kwargs)
        self.sequence_parallel = sequence_parallel
        self.per_block = per_block
        self.reshard_after_forward = reshard_after_forward
        self.tensor_parallel = None

    def default_devices(self, accelerator: str) -> int:
        return _default_devices(self, accelerator) or super().default_devices(accelerator)

    def check_model(self, model: torch.nn.Module, world_size: int) -> None:
        _check_model(self, model, world_size)

    def parallelize(self, model: torch.nn.Module) -> None:
        compose_before_pipeline(self, model)


class Hybrid4DPipelineStrategy(TensorParallelSteps, PipelineStrategy):
    """``dp × tp × pp`` (``pp > 1``): the pipeline owns the step; TP splits every stage's layers.

    The pipeline's schedule (forward, loss, backward) runs inside the TP context, so a vocabulary-parallel
    output layer's loss runs under ``loss_parallel`` on the last stage.
    """

    strategy_name = STRATEGY_NAME

    def __init__(self, dp: int = -1, sharding: int = 1, tp: int = 2, pp: int = 2, ep: int = 1, *,
                 sequence_parallel: bool = False, per_block: bool = True, reshard_after_forward: bool = True,
                 **kwargs: Any) -> None:
        check_hybrid_degrees(dp, sharding, tp, pp, ep, sequence_parallel)
        super().__init__(pp=pp, dp=dp, **kwargs)
        self._degrees.update(tp=tp)  # PipelineStrategy takes pp and dp only; ParallelDims validates all
        self.sequence_parallel = sequence_parallel
        self.per_block = per_block
        self.reshard_after_forward = reshard_after_forward
        self.tensor_parallel = None

    def default_devices(self, accelerator: str) -> int:
        return _default_devices(self, accelerator) or super().default_devices(accelerator)

    def check_model(self, model: torch.nn.Module, world_size: int) -> None:
        _check_model(self, model, world_size)

    def parallelize(self, model: torch.nn.Module) -> None:
        compose_before_pipeline(self, model)  # 1-3 (TP) on the whole model
        super().parallelize(model)  # 5. PP: cut into this rank's stages, then 4. dp average of the stage's grads

    def bind_trainer_config(self, trainer_cfg: dict[str, Any]) -> None:
        """Before launch: refuse norm clipping with TP inside a pipeline (its stage norm is not composed yet)."""
        _refuse_norm_clipping(self._degrees[TP], trainer_cfg.get("gradient_clip_val"), trainer_cfg.get("gradient_clip_algorithm"))

    def setup(self, trainer: Any) -> None:
        _refuse_norm_clipping(self._degrees[TP], trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
        super().setup(trainer)

    def _loss_from_last_stage(self, loss: torch.Tensor | None) -> torch.Tensor:
        # Under loss_parallel the last stage's loss is a replicated DTensor: every tp rank holds the value.
        if loss is not None and hasattr(loss, "to_local"):
            loss = loss.to_local()
        return super()._loss_from_last_stage(loss)


_PIPELINE_ONLY = ("microbatches", "schedule", "virtual_stages", "split", "trace")


def hybrid4d(
    dp: int = -1,
    sharding: int = 1,
    tp: int = 2,
    pp: int = 2,
    ep: int = 1,
    mesh_order: tuple[str, ...] | list[str] = DEFAULT_MESH_ORDER,
    sequence_parallel: bool = False,
    per_block: bool = True,
    reshard_after_forward: bool = True,
    microbatches: int = 4,
    schedule: str = "1f1b",
    virtual_stages: int | None = None,
    split: list[int] | None = None,
    trace: bool = False,
    save_distributed_checkpoint: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    process_group_backend: str | None = None,
) -> MeshStrategy:
    """``strategy=hybrid4d``: the strategy for these degrees (``-1``: the remaining ranks, dp or sharding).

    Args:
        dp / sharding / tp / pp / ep: the degrees (:class:`ParallelDims`); the mesh is ``mesh_order``
            (default ``pp, dp, sharding, tp``: tp innermost = adjacent ranks, pp outermost).
        sequence_parallel: TP also splits LayerNorm/dropout regions along the sequence.
        per_block / reshard_after_forward: FSDP2 options when ``sharding > 1`` (see ``strategy=zero``).
        microbatches / schedule / virtual_stages / split / trace: pipeline options when ``pp > 1``.
    """
    common = dict(dp=dp, sharding=sharding, tp=tp, ep=ep, mesh_order=mesh_order, sequence_parallel=sequence_parallel,
                  per_block=per_block, reshard_after_forward=reshard_after_forward,
                  save_distributed_checkpoint=save_distributed_checkpoint, timeout_s=timeout_s,
                  process_group_backend=process_group_backend)
    check_hybrid_degrees(dp, sharding, tp, pp, ep, sequence_parallel)
    if pp > 1:
        return Hybrid4DPipelineStrategy(pp=pp, microbatches=microbatches, schedule=schedule, virtual_stages=virtual_stages,
                                        split=split, trace=trace, **common)
    return Hybrid4DStrategy(**common)
