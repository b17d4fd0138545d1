"""Expert parallelism for Mixture-of-Experts models: a preset of the composed strategy (any device, gloo included)."""

from __future__ import annotations

import torch
from typing_extensions import override

from parallelkit.distributed.elastic import DEFAULT_TIMEOUT_S
from parallelkit.distributed.expert_parallel import ExpertParallelPlan, check_expert_parallel
from parallelkit.distributed.parallel_dims import ParallelDims
from parallelkit.distributed.parallelize import EXPERT_GRAD_ALLREDUCE, ParallelOptions
from parallelkit.errors import ConfigError
from parallelkit.models.plans import model_plans
from parallelkit.strategies.composed import ComposedStrategy

__all__ = ["EXPERT_GRAD_ALLREDUCE", "ExpertParallelStrategy"]


class ExpertParallelStrategy(ComposedStrategy):
    """Experts sharded over ``ep`` consecutive data-parallel ranks; everything else data-parallel.

    The model's plan names its MoE layers (``expert_parallel_plan``, :mod:`parallelkit.models.plans`);
    :func:`~parallelkit.distributed.expert_parallel.apply_ep` keeps ``num_experts / ep`` experts per rank and routes
    tokens with all-to-alls. Dense parameters are averaged over all data-parallel ranks; expert parameters only
    over the ``dp / ep`` ranks that hold the same experts. With a capacity factor that drops nothing — or any
    capacity: drops are decided over the global micro-batch — the loss equals one process's.

    Args:
        ep: expert-parallel degree; divides both the number of processes and ``model.num_experts``.
        dp: data-parallel degree (``-1``: all processes).
        bucket_mb: gradient all-reduce bucket size in MiB.
        plan: where the model's expert plan is (``mypkg.parallelize``); ``None``: the model's own methods, then
            the ``parallelize`` module beside its class.
        save_distributed_checkpoint / timeout_s / process_group_backend: as for :class:`MeshStrategy`.

    Example::

        Trainer(strategy=ExpertParallelStrategy(ep=2), devices=4, accelerator="cpu")   # 2 × 2 experts groups
    """

    strategy_name = "moe"

    def __init__(
        self,
        ep: int = 2,
        dp: int = -1,
        bucket_mb: float = 25.0,
        plan: str | None = None,
        save_distributed_checkpoint: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        process_group_backend: str | None = None,
    ) -> None:
        if not isinstance(bucket_mb, (int, float)) or isinstance(bucket_mb, bool) or bucket_mb <= 0:
            raise ConfigError(f"strategy.bucket_mb should be a number greater than 0. Got {bucket_mb!r}.")
        super().__init__(ParallelDims.request(dp=dp, ep=ep), ParallelOptions(bucket_mb=float(bucket_mb)), plan=plan,
                         save_distributed_checkpoint=save_distributed_checkpoint, timeout_s=timeout_s,
                         process_group_backend=process_group_backend)

    @override
    def check_model(self, model: torch.nn.Module, world_size: int | None = None) -> None:
        """Before any process starts: the model has an expert-parallel plan and ``ep`` divides its experts (also at
        ``ep = 1``: this strategy exists for MoE models)."""
        check_expert_parallel(self._expert_plan(model), self.requested_dims.ep)

    def _expert_plan(self, model: torch.nn.Module) -> ExpertParallelPlan:
        return model_plans(model, self.plan_source).expert_parallel_plan(who="strategy=moe")
