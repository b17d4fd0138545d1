"""The progress bar of a step-bounded run: optimizer steps out of ``trainer.max_steps``, across epochs.

parallelkit's runs are bounded by ``trainer.max_steps`` with ``max_epochs=-1``. Lightning's bars count the
batches of the current epoch and start again at each one (the default experiment's 500 steps are five
epochs of ~100 batches: the bar filled five times), and Rich's names the epoch against ``max_epochs - 1``
("Epoch 0/-2"). Here the training bar shows the run's real progress, ``global_step / max_steps``, named by the
epoch alone. A run bounded by epochs keeps Lightning's bar as it is.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE
from lightning.pytorch.callbacks.progress.tqdm_progress import _update_n
from typing_extensions import override


def _step_bounded(trainer: Any) -> bool:
    return trainer.max_steps is not None and trainer.max_steps > 0 and (trainer.max_epochs is None or trainer.max_epochs < 0)


class _StepBounded:
    """What both bars share: the training bar's total (the attribute Lightning's bars read for it)."""

    trainer: Any

    @property
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps if _step_bounded(self.trainer) else super().total_train_batches


class StepRichProgressBar(_StepBounded, RichProgressBar):
    """Lightning's ``RichProgressBar`` (its default when Rich is installed), counting steps to ``max_steps``.

    Example::

        Trainer(max_steps=500, callbacks=[StepRichProgressBar()])   # "Epoch 2 ━━━━━━ 250/500"
    """

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if not _step_bounded(self.trainer):
            return super()._get_train_description(current_epoch)
        description = f"Epoch {current_epoch}"  # without "/{max_epochs - 1}": the epochs are unbounded
        width = len(self.validation_description)  # padded like Lightning's, so the bars do not flicker
        return f"{description:{width}}" if width > len(description) else description

    @override
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        reuse = self.progress is not None and self.train_progress_bar_id is not None and not self._leave and not self.is_disabled
        if not _step_bounded(trainer) or not reuse:
            super().on_train_epoch_start(trainer, pl_module)  # creates the bar (at 0) or resets it per epoch
            if _step_bounded(trainer):
                self._update(self.train_progress_bar_id, trainer.global_step)
            return
        # Lightning resets the bar each epoch (drawn at 0, its clock restarted): moved on instead, so that it shows
        # the step reached and the run's time, not the epoch's.
        self.progress.update(self.train_progress_bar_id, total=self.total_train_batches, completed=trainer.global_step,
                             description=self._get_train_description(trainer.current_epoch), visible=True)
        self.refresh()

    @override
    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if _step_bounded(trainer) and trainer.global_step >= trainer.max_steps:
            # The run's last step: the bar's final line, once. Left running until teardown, it is drawn again after
            # every line printed meanwhile (Lightning's "`Trainer.fit` stopped", the run's summary table).
            self._stop_progress()

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not _step_bounded(trainer):
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._update(self.train_progress_bar_id, trainer.global_step)  # Lightning's: batch_idx + 1 of this epoch
        self._update_metrics(trainer, pl_module)
        self.refresh()


class StepTQDMProgressBar(_StepBounded, TQDMProgressBar):
    """Lightning's ``TQDMProgressBar`` (without Rich), counting steps to ``max_steps``."""

    @override
    def on_train_epoch_start(self, trainer: Any, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        if _step_bounded(trainer):
            _update_n(self.train_progress_bar, trainer.global_step)

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not _step_bounded(trainer):
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        n = trainer.global_step
        if self.train_progress_bar is not None and self._should_update(n, self.train_progress_bar.total):
            _update_n(self.train_progress_bar, n)
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))


def step_progress_bar() -> RichProgressBar | TQDMProgressBar:
    """The bar Lightning would pick (Rich if installed), counting steps to ``max_steps``."""
    return StepRichProgressBar() if _RICH_AVAILABLE else StepTQDMProgressBar()
