"""Tensor parallel (Megatron-style, on DTensor) with plain data parallelism on the remaining ranks: a preset of the
composed strategy."""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from parallelkit.distributed.parallel_dims import ParallelDims
from parallelkit.distributed.parallelize import ParallelOptions
from parallelkit.errors import ConfigError
from parallelkit.strategies.composed import ComposedStrategy
from parallelkit.strategies.tensor_parallel_steps import TensorParallelSteps, say_if_experts_replicated

__all__ = ["TensorParallelStrategy", "TensorParallelSteps", "say_if_experts_replicated"]


class TensorParallelStrategy(ComposedStrategy):
    """Split every transformer layer over ``tp`` ranks; replicate that group ``dp`` times.

    A preset of :class:`~parallelkit.strategies.composed.ComposedStrategy` with tensor and data parallel degrees
    only. The model's plan (``tensor_parallel_plan``, found by :mod:`parallelkit.models.plans`) is applied with
    :func:`~parallelkit.distributed.tensor_parallel.apply_tp`; gradients are then averaged over the
    data-parallel axis only (tensor-parallel peers hold different shards and read the same batches).
    Forward, loss and backward run under the plan's context: ``loss_parallel`` for a vocabulary-parallel
    output layer, and counting of every collective DTensor issues (``comm.by_kind`` ``tp_block.*``,
    ``tp.*`` in ``summary.json``).

    Args:
        tp: tensor-parallel degree; must divide the model's heads, width and vocabulary.
        dp: data-parallel degree; ``-1`` = the remaining ranks.
        sequence_parallel: also split LayerNorm/dropout regions along the sequence (all-gather and
            reduce-scatter instead of all-reduce; the sequence length must divide by ``tp``).
        plan: where the model's plans are (``mypkg.parallelize``); ``None``: the model's own methods, then the
            ``parallelize`` module beside its class (:mod:`parallelkit.models.plans`).
        **kwargs: :class:`~parallelkit.strategies.composed.ComposedStrategy` options (``timeout_s``, ...).

    Example::

        python train.py strategy=tp strategy.tp=2 trainer.devices=4   # tp=2 × dp=2
    """

    strategy_name = "tp"

    def __init__(self, tp: int = 2, dp: int = -1, sequence_parallel: bool = False, plan: str | None = None, **kwargs: Any) -> None:
        if not isinstance(sequence_parallel, bool):
            raise ConfigError(f"strategy.sequence_parallel should be true or false. Got {sequence_parallel!r}.")
        for name in ("sharding", "pp", "ep"):
            if kwargs.get(name, 1) != 1:
                raise ConfigError(
                    f"strategy=tp takes only tp and dp degrees; strategy.{name}={kwargs[name]} would be ignored. Use strategy=hybrid4d to combine them."
                )
            kwargs.pop(name, None)
        super().__init__(ParallelDims.request(dp=dp, tp=tp), ParallelOptions(sequence_parallel=sequence_parallel), plan=plan, **kwargs)

    # ---------------------------------------------------------------- planning (before launch)
    @override
    def _requested_dims(self, world_size: int) -> ParallelDims:
        tp = self.requested_dims.tp
        if isinstance(tp, int) and not isinstance(tp, bool) and tp > world_size:
            raise ConfigError(
                f"strategy.tp={tp} is larger than the {world_size} process(es) started "
                f"(trainer.devices × trainer.num_nodes). Use strategy.tp ≤ {world_size}, or start more processes."
            )
        return super()._requested_dims(world_size)
