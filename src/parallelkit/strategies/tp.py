"""Tensor parallel (Megatron-style, on DTensor) with plain data parallelism on the remaining ranks."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from typing_extensions import override

from parallelkit.capabilities import LIGHTNING_BACKWARD
from parallelkit.distributed.grad_sync import apply_grad_allreduce
from parallelkit.distributed.parallel_dims import DP, TP, ParallelDims
from parallelkit.distributed.tensor_parallel import TensorParallel, TensorParallelPlan, apply_tp
from parallelkit.errors import ConfigError
from parallelkit.models.plans import model_plans
from parallelkit.strategies.mesh import MeshStrategy

def say_if_experts_replicated(model: torch.nn.Module, source: Any, who: str) -> None:
    """One line on rank 0 when ``model`` has Mixture-of-Experts layers: tensor parallelism keeps every expert whole
    on every tensor-parallel rank (the models' tp plans leave them out; expert parallelism is what spreads them),
    so their memory is not divided by tp — the user should not learn that from a memory figure."""
    from lightning.pytorch.utilities import rank_zero_info

    make = model_plans(model, source).find("expert_parallel_plan")
    try:
        plan = make(model) if make is not None else None
    except ConfigError:  # a plan that refuses (no MoE layers in this configuration)
        return
    if plan is None or not plan.sites:
        return
    rank_zero_info(f"parallelkit: {who} keeps the {plan.num_experts} experts of each of the {len(plan.sites)} MoE layers of "
                   f"{type(model).__name__} whole on every tensor-parallel rank (replicated, not split); strategy=moe, or "
                   "strategy=hybrid4d with strategy.ep > 1, spreads them over ranks.")


class TensorParallelSteps:
    """Runs a strategy's steps inside its :class:`TensorParallel` handle's context (``self.tensor_parallel``).

    Shared by :class:`TensorParallelStrategy` and the hybrid strategies (``strategy=hybrid4d``), which put it
    before their mesh/pipeline base class. With ``self.tensor_parallel`` unset (no tensor parallelism) the
    steps run as the base class runs them.
    """

    tensor_parallel: TensorParallel | None = None

    def _tp_context(self, count: bool = True) -> Any:
        return self.tensor_parallel.context(count=count) if self.tensor_parallel is not None else contextlib.nullcontext()

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        # Forward, backward, the gradient sync and clipping (norms reduced over tp) run inside: all counted.
        with self._tp_context():
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.tensor_parallel is not None:
            self.tensor_parallel.begin_step()
        with self._tp_context():
            return super().training_step(*args, **kwargs)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # loss_parallel's cross-entropy has its own backward rule: it must be active here too. (Under
        # gradient accumulation Lightning runs the non-final micro-batches outside optimizer_step.)
        with self._tp_context():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        # Counted under the validation phase (comm_validation), apart from a training step's traffic.
        with self._tp_context():
            return super().validation_step(*args, **kwargs)


class TensorParallelStrategy(TensorParallelSteps, MeshStrategy):
    """Split every transformer layer over ``tp`` ranks; replicate that group ``dp`` times.

    The model's plan (``tensor_parallel_plan``, found by :mod:`parallelkit.models.plans`) is applied with
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
        **kwargs: :class:`~parallelkit.strategies.mesh.MeshStrategy` options (``timeout_s``, ...).

    Example::

        python train.py strategy=tp strategy.tp=2 trainer.devices=4   # tp=2 × dp=2
    """

    strategy_name = "tp"
    capabilities = frozenset({LIGHTNING_BACKWARD})

    def __init__(self, tp: int = 2, dp: int = -1, sequence_parallel: bool = False, plan: str | None = None, **kwargs: Any) -> None:
        if not isinstance(sequence_parallel, bool):
            raise ConfigError(f"strategy.sequence_parallel should be true or false. Got {sequence_parallel!r}.")
        for name in ("sharding", "pp", "ep"):
            if kwargs.get(name, 1) != 1:
                raise ConfigError(f"strategy=tp takes only tp and dp degrees; strategy.{name}={kwargs[name]} would be ignored. Use strategy=hybrid4d to combine them.")
        super().__init__(dp=dp, tp=tp, **kwargs)
        self.sequence_parallel = sequence_parallel
        self.plan_source = plan
        self.tensor_parallel: TensorParallel | None = None

    # ---------------------------------------------------------------- planning (before launch)
    @override
    def _requested_dims(self, world_size: int) -> ParallelDims:
        tp = self._degrees[TP]
        if isinstance(tp, int) and not isinstance(tp, bool) and tp > world_size:
            raise ConfigError(
                f"strategy.tp={tp} is larger than the {world_size} process(es) started "
                f"(trainer.devices × trainer.num_nodes). Use strategy.tp ≤ {world_size}, or start more processes."
            )
        return super()._requested_dims(world_size)

    @override
    def check_model(self, model: torch.nn.Module, world_size: int) -> None:
        """Raise :class:`ConfigError` if ``model`` cannot be split as planned (called before launch)."""
        self._plan_for(model, self.plan(world_size).tp)
        say_if_experts_replicated(model, self.plan_source, "strategy=tp")

    def _plan_for(self, model: torch.nn.Module, tp: int) -> TensorParallelPlan:
        return model_plans(model, self.plan_source).tensor_parallel_plan(tp, sequence_parallel=self.sequence_parallel, who="strategy=tp")

    # ---------------------------------------------------------------- composition
    @override
    def parallelize(self, model: torch.nn.Module) -> None:
        # Order: tensor parallel first (parameters become DTensors), then data parallel over the dp axis,
        # which averages each rank's local shards. After backward, partial-sum gradients are completed
        # over tp (TensorParallel.sync) before they are averaged over dp.
        mesh = self.device_mesh
        self.tensor_parallel = apply_tp(model, mesh[TP], self._plan_for(model, self.parallel_dims.tp), comm_stats=self.comm_stats)
        self.grad_syncs.append(self.tensor_parallel)
        self.grad_syncs.append(apply_grad_allreduce(model.parameters(), mesh[DP].get_group(), comm_stats=self.comm_stats))
