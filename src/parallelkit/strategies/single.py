"""One process, one device: the reference every exact strategy is compared against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from typing_extensions import override

from parallelkit.capabilities import LIGHTNING_BACKWARD, MIXED_PRECISION, REPLICATED_PARAMS, SPARSE_GRADIENTS
from parallelkit.distributed.checkpoint_io import load_into_single_process
from parallelkit.distributed.parallel_dims import ParallelDims
from parallelkit.strategies.base import ParallelKitStrategyMixin


class SingleStrategy(ParallelKitStrategyMixin, SingleDeviceStrategy):
    """Train in this process on one device (``cuda:0`` when the accelerator is a GPU, else the CPU).

    Args:
        device: the device; ``None`` picks it from the accelerator.

    Example::

        Trainer(strategy=SingleStrategy(), devices=1)
    """

    strategy_name = "single"
    max_world_size = 1
    capabilities = frozenset({REPLICATED_PARAMS, LIGHTNING_BACKWARD, MIXED_PRECISION, SPARSE_GRADIENTS})

    def __init__(self, device: str | None = None) -> None:
        super().__init__(device=device or "cpu")
        self._init_parallelkit()
        self._device_given = device is not None

    @override
    def bind_accelerator(self, accelerator: str) -> None:
        """Pick the device for ``trainer.accelerator`` unless one was given explicitly."""
        if not self._device_given:
            self._root_device = torch.device("cuda", 0) if accelerator == "gpu" else torch.device("cpu")

    @override
    def _requested_dims(self, world_size: int) -> ParallelDims:
        return ParallelDims(world_size=1)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Also resumes from a sharded (or DeepSpeed) checkpoint directory written by a multi-rank run (gathered here)."""
        if Path(checkpoint_path).is_dir():
            return load_into_single_process(checkpoint_path, self.lightning_module)
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
