"""What every parallelkit strategy offers on top of Lightning's: planned degrees, a mesh, counted traffic.

A strategy *plans* before any process starts (``plan(world_size, accelerator)`` validates the degrees
and returns :class:`ParallelDims`), and builds its mesh once the process group exists. Callbacks and
``parallelkit.run`` ask these capabilities, never the strategy's type.
"""

from __future__ import annotations

from typing import Any

import torch

from parallelkit.distributed.comm_stats import CommStats
from parallelkit.distributed.parallel_dims import ParallelDims
from parallelkit.errors import ConfigError
from parallelkit.strategies.protocol import StrategyProtocol

METRICS = "metrics"

# Capabilities a callback may ask for with ``strategy.supports(...)`` (never by checking the class).
#: gradients are averaged by a ``DistributedDataParallel`` module that accepts DDP comm hooks.
DDP_COMM_HOOK = "ddp_comm_hook"
#: every rank holds the full (unsharded, unsplit) parameters, so they can be averaged or compared directly.
REPLICATED_PARAMS = "replicated_params"
#: Lightning runs ``training_step`` and ``backward`` itself (a pipeline schedule does not).
LIGHTNING_BACKWARD = "lightning_backward"


class ParallelKitStrategyMixin(StrategyProtocol):
    """Mixed into each parallelkit strategy before its Lightning base class: the run protocol
    (:class:`~parallelkit.strategies.protocol.StrategyProtocol`), planned degrees, capabilities, counted traffic."""

    #: the name used by ``strategy=NAME`` and written to ``summary.json``.
    strategy_name: str = "?"
    #: the largest world the strategy can use (None: any).
    max_world_size: int | None = None
    #: what callbacks may rely on (see the capability constants above).
    capabilities: frozenset[str] = frozenset({LIGHTNING_BACKWARD})

    def _init_parallelkit(self) -> None:
        self.comm_stats = CommStats()
        self._parallel_dims: ParallelDims | None = None
        self.device_mesh = None

    # ---------------------------------------------------------------- planning (before launch)
    def plan(self, world_size: int) -> ParallelDims:
        """Validate the requested degrees for ``world_size`` processes (raises :class:`ConfigError`)."""
        if self.max_world_size is not None and world_size > self.max_world_size:
            raise ConfigError(
                f"strategy={self.strategy_name} runs at most {self.max_world_size} process(es), but "
                f"trainer.devices × trainer.num_nodes = {world_size}. Use trainer.devices=1, or a distributed "
                "strategy such as strategy=ddp."
            )
        return self._requested_dims(world_size)

    def _requested_dims(self, world_size: int) -> ParallelDims:
        return ParallelDims.from_degrees(world_size, dp=-1)

    @property
    def parallel_dims(self) -> ParallelDims:
        if self._parallel_dims is None:
            self._parallel_dims = self.plan(self.world_size)
        return self._parallel_dims

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data is sharded by the data-parallel rank (tensor/pipeline peers read the same batch), not the global rank."""
        dims = self.parallel_dims
        return {"num_replicas": dims.data_parallel_size, "rank": dims.data_parallel_rank(self.global_rank)}

    # ---------------------------------------------------------------- run-time capabilities
    def supports(self, capability: str) -> bool:
        """Whether this strategy (as configured) offers ``capability`` (one of the constants in this module)."""
        return capability in self.capabilities

    def global_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """Mean of a per-rank metric over all ranks (counted as ``metrics`` traffic)."""
        return self._counted_reduce(tensor, "mean")

    def global_max(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._counted_reduce(tensor, "max")

    def _counted_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if self.world_size > 1:
            self.comm_stats.record(METRICS, tensor, "all_reduce", self.world_size)
        return self.reduce(tensor.clone(), reduce_op=op)

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state that this rank holds right now."""
        return model_state_bytes(self.lightning_module, self.optimizers)


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # DTensor: this rank's shard
    return local.numel() * local.element_size()


def model_state_bytes(module: torch.nn.Module | None, optimizers: list[Any]) -> dict[str, int]:
    params = list(module.parameters()) if module is not None else []
    state = 0
    for optimizer in optimizers:
        for per_param in optimizer.state.values():
            state += sum(_local_bytes(v) for v in per_param.values() if isinstance(v, torch.Tensor))
    return {
        "params": sum(_local_bytes(p) for p in params),
        "grads": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": state,
    }


def require_capabilities(strategy: Any, who: str, needs: dict[str, str], instead: str = "strategy=ddp") -> None:
    """Raise :class:`ConfigError` if ``strategy`` lacks a capability in ``needs`` (capability → why ``who`` needs it).

    Decided by asking the strategy (``supports``), never by its class, so a new strategy that offers the
    capability works with the callback unchanged.
    """
    supports = getattr(strategy, "supports", None)
    name = getattr(strategy, "strategy_name", type(strategy).__name__)
    missing = {c: why for c, why in needs.items() if supports is None or not supports(c)}
    if missing:
        raise ConfigError(
            f"{who} does not work with strategy={name}: "
            + "; ".join(f"{why}, which strategy={name} does not offer ({c!r})" for c, why in missing.items())
            + f". Use {instead}, or drop the callback."
        )
