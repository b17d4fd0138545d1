"""The step-bounded Rich bar (parallelkit.callbacks.progress_bar) over several epochs: one clock for the run."""

from __future__ import annotations

import io

import lightning.pytorch as pl
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader, TensorDataset

from parallelkit.callbacks.progress_bar import StepRichProgressBar


class _Clock(pl.Callback):
    """After the bar's own hooks: its training task's start time at each epoch, and whether it is still live at the end."""

    def __init__(self, bar: StepRichProgressBar) -> None:
        self.bar, self.starts, self.live_at_train_end = bar, [], None

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        task = next(t for t in self.bar.progress.tasks if t.id == self.bar.train_progress_bar_id)
        self.starts.append((task.start_time, task.completed))

    def on_train_end(self, trainer, pl_module) -> None:
        self.live_at_train_end = not self.bar._progress_stopped


class _FourBatches(BoringModel):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(4, 32)), batch_size=1, collate_fn=lambda b: torch.stack([x[0] for x in b]))


def test_the_bar_keeps_the_runs_clock_across_epochs_and_stops_at_the_last_step(tmp_path):
    bar = StepRichProgressBar(console_kwargs={"file": io.StringIO(), "force_terminal": True})
    clock = _Clock(bar)
    trainer = pl.Trainer(max_steps=10, max_epochs=-1, callbacks=[bar, clock], logger=False, enable_checkpointing=False,
                         enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path, accelerator="cpu", devices=1)
    trainer.fit(_FourBatches())
    assert [completed for _, completed in clock.starts] == [0, 4, 8]  # three epochs, the bar at the step reached
    assert len({start for start, _ in clock.starts}) == 1, clock.starts  # one start time: the run's, not each epoch's
    assert clock.live_at_train_end is False  # stopped at the last step, before the run's summary prints
