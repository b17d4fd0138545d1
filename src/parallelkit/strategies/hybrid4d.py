"""Hybrid parallelism: tensor × expert × sharding/data × pipeline parallel on one named mesh.

A preset of :class:`~parallelkit.strategies.composed.ComposedStrategy` that exposes every degree; the order the
techniques are applied in is :func:`parallelkit.distributed.parallelize.parallelize`'s (TP+SP → EP → pipeline
split → FSDP/DP → schedule). ``strategy=auto`` builds one of these for the layout it chooses.
"""

from __future__ import annotations

from typing import Any

from parallelkit.distributed.elastic import DEFAULT_TIMEOUT_S
from parallelkit.distributed.parallel_dims import DEFAULT_MESH_ORDER, ParallelDims
from parallelkit.distributed.parallelize import ParallelOptions
from parallelkit.errors import ConfigError
from parallelkit.strategies.composed import ComposedStrategy, pipeline_options

STRATEGY_NAME = "hybrid4d"


def require_explicit_split(tp: Any, pp: Any, ep: Any, cp: Any = 1) -> None:
    """The degrees that decide the model split must be explicit (no ``-1``): the split depends on them."""
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(
                f"strategy=hybrid4d needs an explicit strategy.{name} ≥ 1 (got {value!r}): it decides the model split. "
                "Use -1 for strategy.dp or strategy.sharding to take the remaining ranks."
            )


class Hybrid4DStrategy(ComposedStrategy):
    """``dp × sharding × cp × tp × pp`` (× ``ep``): every degree and option of the composition.

    Args:
        dp / sharding / cp / tp / pp / ep: the degrees (:class:`ParallelDims`; ``-1``: the remaining ranks, dp or
            sharding); the mesh is ``mesh_order`` (default ``pp, dp, sharding, cp, tp``: tp innermost = adjacent
            ranks, cp beside it, pp outermost).
        cp_mode: context parallelism's attention when ``cp > 1``: ``ring`` (default) or ``ulysses`` (all-to-all).
        stage: what ``sharding`` shards (ZeRO stage 3 = FSDP2, composes with every axis; 1-2 with data
            parallelism only).
        sequence_parallel: TP also splits LayerNorm/dropout regions along the sequence.
        per_block / reshard_after_forward / prefetch: FSDP2 options when ``sharding > 1`` (see ``strategy=zero``);
            ``reshard_after_forward=None``: ZeRO-3 without a pipeline, kept gathered through the step with one.
        microbatches / schedule / virtual_stages / split / trace: pipeline options when ``pp > 1``.
        plan: where the model's plans are (``mypkg.parallelize``); ``None``: the model's own methods, then the
            ``parallelize`` module beside its class (:mod:`parallelkit.models.plans`).
        **composed: :class:`ComposedStrategy`'s own (``accumulate_grad_batches``, ``auto_plan``: what
            ``strategy=auto`` chose).

    Example::

        python train.py strategy=hybrid4d strategy.tp=2 strategy.pp=2 strategy.sequence_parallel=true trainer.devices=4
    """

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        dp: int = -1,
        sharding: int = 1,
        tp: int = 2,
        pp: int = 2,
        ep: int = 1,
        cp: int = 1,
        cp_mode: str = "ring",
        mesh_order: tuple[str, ...] | list[str] = DEFAULT_MESH_ORDER,
        stage: int = 3,
        sequence_parallel: bool = False,
        per_block: bool = True,
        reshard_after_forward: bool | None = None,
        prefetch: bool = True,
        microbatches: int = 4,
        schedule: str = "1f1b",
        virtual_stages: int | None = None,
        split: list[int] | None = None,
        trace: bool = False,
        plan: str | None = None,
        save_distributed_checkpoint: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        process_group_backend: str | None = None,
        **composed: Any,
    ) -> None:
        require_explicit_split(tp, pp, ep, cp)
        dims = ParallelDims.request(dp=dp, sharding=sharding, tp=tp, pp=pp, ep=ep, cp=cp, mesh_order=mesh_order)
        options = ParallelOptions(zero_stage=stage, sequence_parallel=sequence_parallel, cp_mode=cp_mode, per_block=per_block,
                                  reshard_after_forward=reshard_after_forward, prefetch=prefetch,
                                  **pipeline_options(microbatches, schedule, virtual_stages, split, trace))
        super().__init__(dims, options, plan=plan, save_distributed_checkpoint=save_distributed_checkpoint,
                         timeout_s=timeout_s, process_group_backend=process_group_backend, **composed)


#: ``strategy=hybrid4d``'s ``_target_`` (and the name code written against earlier versions calls).
hybrid4d = Hybrid4DStrategy
