"""Expert parallelism for Mixture-of-Experts models, on Lightning's Trainer (any device, gloo included)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from typing_extensions import override

from parallelkit.capabilities import LIGHTNING_BACKWARD
from parallelkit.distributed.elastic import DEFAULT_TIMEOUT_S
from parallelkit.distributed.expert_parallel import MOE_ALL_TO_ALL, ExpertParallelPlan, apply_ep, check_expert_parallel
from parallelkit.distributed.grad_sync import apply_grad_allreduce
from parallelkit.distributed.parallel_dims import DP
from parallelkit.errors import ConfigError
from parallelkit.models.plans import model_plans
from parallelkit.strategies.mesh import MeshStrategy

EXPERT_GRAD_ALLREDUCE = "expert_grad_allreduce"


class ExpertParallelStrategy(MeshStrategy):
    """Experts sharded over ``ep`` consecutive data-parallel ranks; everything else data-parallel.

    The model's plan names its MoE layers (``expert_parallel_plan``, :mod:`parallelkit.models.plans`); :func:`apply_ep` keeps
    ``num_experts / ep`` experts per rank and routes tokens with all-to-alls. Dense parameters are averaged
    over all data-parallel ranks; expert parameters only over the ``dp / ep`` ranks that hold the same
    experts. With a capacity factor that drops nothing — or any capacity: drops are decided over the global
    micro-batch — the loss equals one process's.

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
    capabilities = frozenset({LIGHTNING_BACKWARD})

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
        super().__init__(dp=dp, ep=ep, save_distributed_checkpoint=save_distributed_checkpoint, timeout_s=timeout_s, process_group_backend=process_group_backend)
        self.bucket_mb = float(bucket_mb)
        self.plan_source = plan
        self.ep_handle = None
        self._all_to_all_bytes_seen = 0

    @override
    def setup(self, trainer: Any) -> None:
        self.check_trainer(trainer)
        super().setup(trainer)

    def check_trainer(self, trainer: Any) -> None:
        """Refuse what would silently go wrong: gradient-norm clipping sees only this rank's experts."""
        if trainer.gradient_clip_val and (trainer.gradient_clip_algorithm or "norm") == "norm":
            raise ConfigError(
                f"strategy=moe does not support trainer.gradient_clip_val={trainer.gradient_clip_val} with norm clipping: "
                "each rank holds different experts, so each would compute a different gradient norm and the dense "
                "replicas would drift apart. Use trainer.gradient_clip_algorithm=value, or leave gradient_clip_val null."
            )

    @override
    def check_model(self, model: torch.nn.Module, world_size: int | None = None) -> None:
        """Before any process starts: the model has an expert-parallel plan and ``ep`` divides its experts."""
        check_expert_parallel(self._expert_plan(model), self._degrees["ep"])

    def _expert_plan(self, model: torch.nn.Module) -> ExpertParallelPlan:
        return model_plans(model, self.plan_source).expert_parallel_plan(who="strategy=moe")

    @override
    def parallelize(self, model: torch.nn.Module) -> None:
        dims = self.parallel_dims
        plan = self._expert_plan(model)
        check_expert_parallel(plan, dims.ep)
        # new_group must be called by every rank for every group, in the same order.
        ep_group, _ = dist.new_subgroups_by_enumeration(dims.expert_parallel_groups())
        expert_dp_group, _ = dist.new_subgroups_by_enumeration(dims.expert_data_parallel_groups())
        dp_group = self.device_mesh.get_group(DP)
        # EP first (it deletes the other ranks' experts), then data parallelism on what is left.
        self.ep_handle = apply_ep(model, plan, ep_group=ep_group, routing_group=dp_group, comm_stats=self.comm_stats)
        self.grad_syncs = [
            apply_grad_allreduce(self.ep_handle.dense_params, dp_group, comm_stats=self.comm_stats, bucket_mb=self.bucket_mb),
            apply_grad_allreduce(self.ep_handle.expert_params, expert_dp_group, comm_stats=self.comm_stats, bucket_mb=self.bucket_mb, kind=EXPERT_GRAD_ALLREDUCE),
        ]

    def step_metrics(self) -> dict[str, float]:
        """This rank's token all-to-all bytes of the step that just finished (a ``metrics.csv`` column)."""
        total = self.comm_stats.bytes(MOE_ALL_TO_ALL)
        step, self._all_to_all_bytes_seen = total - self._all_to_all_bytes_seen, total
        return {"moe_all_to_all_bytes": step}

    @override
    def param_groups_key(self) -> str:
        # ranks of different expert shards list different expert parameters (see MeshStrategy.param_groups_key)
        handle = self.ep_handle
        return "param_groups" if handle is None else "param_groups_experts_" + "_".join(map(str, handle.local_experts))

    @override
    def summary_metrics(self, trainer: Any) -> dict[str, Any]:
        handle = self.ep_handle
        return {**super().summary_metrics(trainer),
                "expert_parallel": {"ep": self.parallel_dims.ep, "local_experts": handle.local_experts if handle else None}}
