"""Lightning's ``LearningRateMonitor``, logging the learning rate at every optimizer step.

Lightning's monitor with ``logging_interval="step"`` logs only on the steps ``trainer.log_every_n_steps``
selects (every 25th here): the warm-up of the default schedule (20 steps) never showed in ``metrics.csv``.
The learning rate is read on the rank itself, with no communication, so every step costs nothing; the
trainer's ``log_every_n_steps`` keeps pacing what does communicate (the loss average of ``RunSummary``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import LearningRateMonitor as LightningLearningRateMonitor
from typing_extensions import override


class LearningRateMonitor(LightningLearningRateMonitor):
    """Log each optimizer's learning rate (``lr-AdamW``, ...) at every optimizer step (and/or every epoch).

    Args:
        logging_interval, log_momentum, log_weight_decay: as Lightning's ``LearningRateMonitor``.

    Example::

        python train.py callbacks=[lr_monitor]    # metrics.csv: one lr-AdamW value per step
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._logged_step: int | None = None

    @override
    def on_train_batch_start(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        if self.logging_interval == "epoch":
            return
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        if step == self._logged_step:  # a later micro-batch of the same step (gradient accumulation)
            return
        self._logged_step = step
        stats = self._extract_stats(trainer, "step" if self.logging_interval is None else "any")
        if stats:
            for logger in trainer.loggers:
                logger.log_metrics(stats, step=step)
