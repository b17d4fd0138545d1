"""One generic LightningModule that trains any parallelkit model.

Models stay plain ``nn.Module``s with ``forward(inputs)`` and ``loss(outputs, targets)``; keeping the
loss separate lets a pipeline schedule call it on the last stage only.
"""

from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
import torch


class TrainModule(pl.LightningModule):
    """Wraps a model, its optimizer factory and an optional learning-rate schedule.

    Args:
        model: a module with ``forward(inputs)`` and ``loss(outputs, targets)``.
        optimizer: ``params -> Optimizer`` (Hydra ``_partial_: true`` of e.g. ``torch.optim.AdamW``).
        warmup_steps: linear learning-rate warm-up over this many steps (0 = none).
        decay_steps: cosine decay to ``min_lr_ratio × lr`` over this many steps after warm-up (0 = constant).
        min_lr_ratio: final learning rate as a fraction of the initial one.

    Example::

        module = TrainModule(GPT(), functools.partial(torch.optim.AdamW, lr=1e-3))
        Trainer(strategy=DDPStrategy()).fit(module, datamodule=dm)
    """

    def __init__(self, model: torch.nn.Module, optimizer: Callable[..., torch.optim.Optimizer], warmup_steps: int = 0, decay_steps: int = 0, min_lr_ratio: float = 0.1) -> None:
        super().__init__()
        self.model = model
        self.optimizer_factory = optimizer
        self.warmup_steps = warmup_steps
        self.decay_steps = decay_steps
        self.min_lr_ratio = min_lr_ratio

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        # Not logged here: self.log costs ~0.7 ms a step. parallelkit's RunSummary callback averages the
        # returned losses over ranks every log_every_n_steps steps, for metrics.csv, summary.json and the bar.
        return self.model.loss(self(inputs), targets)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = self.model.loss(self(inputs), targets)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True, on_epoch=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.parameters())
        if not self.warmup_steps and not self.decay_steps:
            return optimizer
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def _lr_factor(self, step: int) -> float:
        import math

        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if not self.decay_steps:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / self.decay_steps)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
