"""Pipeline parallel with data parallelism on the remaining ranks: a preset of the composed strategy.

Each rank keeps only its stages of the model and runs the micro-batch schedule in its training step
(:mod:`parallelkit.strategies.pipeline_steps`); the stage gradients are averaged over the ``dp`` axis.
"""

from __future__ import annotations

from parallelkit.distributed.elastic import DEFAULT_TIMEOUT_S
from parallelkit.distributed.parallel_dims import DEFAULT_MESH_ORDER, ParallelDims
from parallelkit.distributed.parallelize import ParallelOptions
from parallelkit.errors import ConfigError
from parallelkit.strategies.composed import ComposedStrategy, pipeline_options
from parallelkit.strategies.pipeline_steps import PP_GRAD_NORM, PP_LOSS, TRACE_DIR, PipelineSteps, squared_norm

__all__ = ["PP_GRAD_NORM", "PP_LOSS", "TRACE_DIR", "PipelineSteps", "PipelineStrategy", "squared_norm"]


class PipelineStrategy(ComposedStrategy):
    """Pipeline parallel over the ``pp`` mesh axis, data parallel over ``dp``.

    Args:
        pp: pipeline ranks (stages per pipeline = ``pp × virtual_stages``).
        dp: data-parallel replicas of the pipeline (``-1``: the remaining ranks).
        microbatches: micro-batches each rank's batch is cut into per step.
        schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b`` or ``zero_bubble``.
        virtual_stages: stages per rank for the interleaved schedules (default 2 there, else 1).
        split: the first block of stages 1..S-1 (default: balanced blocks).
        trace: record every compute and send/recv wait; written to ``DIR/pipeline_trace/`` at the end.
        plan: where the model's pipeline plan is (``mypkg.parallelize``); ``None``: the model's own methods,
            then the ``parallelize`` module beside its class (:mod:`parallelkit.models.plans`).
        save_distributed_checkpoint / timeout_s / process_group_backend: see :class:`MeshStrategy`.

    Example::

        Trainer(strategy=PipelineStrategy(pp=2, microbatches=4, schedule="1f1b"), devices=4)  # dp = 2
    """

    strategy_name = "pp"

    def __init__(
        self,
        pp: int = 2,
        dp: int = -1,
        microbatches: int = 4,
        schedule: str = "1f1b",
        virtual_stages: int | None = None,
        split: list[int] | None = None,
        trace: bool = False,
        plan: str | None = None,
        mesh_order: tuple[str, ...] | list[str] = DEFAULT_MESH_ORDER,
        save_distributed_checkpoint: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        process_group_backend: str | None = None,
    ) -> None:
        if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
            raise ConfigError(f"strategy.pp should be an int greater than 0 (pipeline ranks). Got {pp!r}.")
        options = ParallelOptions(**pipeline_options(microbatches, schedule, virtual_stages, split, trace))
        super().__init__(ParallelDims.request(dp=dp, pp=pp, mesh_order=mesh_order), options, plan=plan,
                         save_distributed_checkpoint=save_distributed_checkpoint, timeout_s=timeout_s,
                         process_group_backend=process_group_backend)
