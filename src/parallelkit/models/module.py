"""One generic LightningModule that trains any parallelkit model.

Models stay plain ``nn.Module``s with ``forward(inputs)`` and ``loss(outputs, targets)``; keeping the
loss separate lets a pipeline schedule call it on the last stage only.
"""

from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
import torch
from typing_extensions import override

#: the checkpoint entry that says how to export the model (``parallelkit.export``).
EXPORT_KEY = "parallelkit_export"
#: the checkpoint entry that lists the parameters' names in the single-device model's order (the order a one-process
#: optimizer numbers them in): ``python -m parallelkit.checkpoint convert`` needs it for a one-file checkpoint from
#: ranks that each saved several pipeline stages (interleaved schedules) or experts, whose lists lose that order.
PARAM_ORDER_KEY = "parallelkit_param_order"


class TrainModule(pl.LightningModule):
    """Wraps a model, its optimizer factory and an optional learning-rate schedule.

    Args:
        model: a module with ``forward(inputs)`` and ``loss(outputs, targets)``.
        optimizer: ``params -> Optimizer`` (Hydra ``_partial_: true`` of e.g. ``torch.optim.AdamW``).
        warmup_steps: linear learning-rate warm-up over this many steps (0 = none).
        decay_steps: cosine decay to ``min_lr_ratio × lr`` over this many steps after warm-up (0 = constant).
        min_lr_ratio: final learning rate as a fraction of the initial one.
        step_seed: if set, each training micro-batch reseeds torch's generator from (seed, epoch, batch, rank).

    Example::

        module = TrainModule(GPT(), functools.partial(torch.optim.AdamW, lr=1e-3))
        Trainer(strategy=DDPStrategy()).fit(module, datamodule=dm)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Callable[..., torch.optim.Optimizer],
        warmup_steps: int = 0,
        decay_steps: int = 0,
        min_lr_ratio: float = 0.1,
        step_seed: int | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.optimizer_factory = optimizer
        self.warmup_steps = warmup_steps
        self.decay_steps = decay_steps
        self.min_lr_ratio = min_lr_ratio
        self.step_seed = step_seed
        # Before any strategy splits or shards the model: the names in the single-device model's order.
        self._param_order = [name for name, _ in self.named_parameters()]

    @property
    def parallel_model(self) -> torch.nn.Module:
        """What strategies parallelize and look plans up for: the wrapped model (see ``parallelkit.models.plans``)."""
        return self.model

    @override
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        # Not logged here: self.log costs ~0.7 ms a step. parallelkit's RunSummary callback averages the
        # returned losses over ranks every log_every_n_steps steps, for metrics.csv, summary.json and the bar.
        return _plain(self.model.loss(self(inputs), targets))

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        loss = _plain(self.model.loss(self(inputs), targets))
        self.log("val_loss", loss, prog_bar=True, sync_dist=True, on_epoch=True)
        return loss

    # Exact resume: the random stream of each training micro-batch (dropout masks) is derived from
    # (seed, epoch, batch index, data-parallel rank) at the start of the batch, so it does not depend on
    # what consumed random numbers before (data loader iterators, validation, a restart): a resumed run
    # draws exactly what the uninterrupted run drew. Tensor/pipeline peers share a data-parallel rank and
    # therefore draw the same masks for the activations they hold replicated.
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.step_seed is not None:
            trainer = self.trainer
            dp_rank = (getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}).get("rank", 0)
            seed = _mix(self.step_seed, trainer.current_epoch, batch_idx, dp_rank)
            # The generators themselves, not torch.manual_seed: that one also visits every other device type
            # behind dynamo's disable wrapper (0.1-0.8 ms a step measured here, on the critical path).
            torch.default_generator.manual_seed(seed)
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.manual_seed(seed)  # this rank's device

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record what ``python -m parallelkit.export`` needs to write the model in its own library's format,
        for a model that says (``export_metadata()``: e.g. a Hugging Face model's config), and the tokenizer the
        data module used (its ``tokenizer_path``), beside the weights in every checkpoint format; and the
        parameters' single-device order (:data:`PARAM_ORDER_KEY`)."""
        checkpoint[PARAM_ORDER_KEY] = list(self._param_order)
        describe = getattr(self.model, "export_metadata", None)
        if callable(describe):
            meta = describe()
            datamodule = getattr(self._trainer, "datamodule", None)
            checkpoint[EXPORT_KEY] = {**meta, "state_dict_prefix": "model." + meta.get("state_dict_prefix", ""),
                                      "tokenizer": getattr(datamodule, "tokenizer_path", None)}

    @override
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


def _plain(loss: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel loss is a replicated DTensor: hand Lightning the plain tensor (no communication)."""
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def _mix(*values: int) -> int:
    """A 63-bit seed from several integers (splitmix-style), so nearby inputs give unrelated streams."""
    x = 0x9E3779B97F4A7C15
    for v in values:
        x = (x ^ (int(v) + 0x9E3779B97F4A7C15 + (x << 6) + (x >> 2))) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    return x & 0x7FFFFFFFFFFFFFFF
