"""The steps of a strategy whose model is tensor-parallel: each runs inside the TP handle's context."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from parallelkit.distributed.tensor_parallel import TensorParallel
from parallelkit.errors import ConfigError
from parallelkit.models.plans import model_plans


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

    Mixed into :class:`~parallelkit.strategies.composed.ComposedStrategy` before the pipeline steps and the mesh
    base class (the pipeline's schedule then runs inside the TP context too). With ``self.tensor_parallel`` unset
    (no tensor parallelism) the steps run as the base class runs them.
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


