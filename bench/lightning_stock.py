"""Lightning's stock ``Trainer(strategy="ddp")`` on the same job, for ``bench/overhead.py``'s third column.

A plain Lightning script, no Hydra and no parallelkit strategy or callbacks: parallelkit's ``TrainModule``
(GPT, AdamW, warm-up + cosine schedule) and ``CharsDataModule`` so that model, data order and losses match
the other two contenders, and otherwise Lightning's defaults — Rich progress bar, Rich model summary,
the default logger (CSV here: TensorBoard is not installed), the default checkpoint callback, the
sanity check (2 validation batches before training: ``TrainModule`` has a ``validation_step``), Lightning's
popen launcher, and ordinary interpreter shutdown at the end. The one non-default, ``use_distributed_sampler=False``, keeps parallelkit's deterministic
batch order (Lightning's ``DistributedSampler`` would shuffle differently).

Step times are taken by :class:`StepTimer` with the logic of parallelkit's ``RunSummary`` (wall time between
consecutive optimizer steps, stamped in ``on_train_batch_end``), losses reduced once at the end.

    python bench/lightning_stock.py --out DIR --steps 100 --n-layer 4 --n-embd 128 --seq-len 64 --global-batch-size 32

The ``--no-*`` flags switch Lightning features off one by one, to attribute the overhead (``bench/ablate.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from parallelkit.data.chars import CharsDataModule
from parallelkit.models.gpt import GPT
from parallelkit.models.module import TrainModule

from workload_args import add_workload_arguments  # bench/ is sys.path[0] when run as a script


class QuietTrainModule(TrainModule):
    """``TrainModule`` without its per-step ``self.log`` (ablation ``--no-log-call``)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return self.model.loss(self(inputs), targets)


class StepTimer(Callback):
    """Wall time between consecutive optimizer steps and per-step losses, like parallelkit's ``RunSummary``."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.losses: list[torch.Tensor] = []
        self.step_ends: list[float] = []
        self.seen_step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen_step = trainer.global_step
        self.step_ends = [time.perf_counter()]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self.seen_step:
            self.seen_step = trainer.global_step
            self.step_ends.append(time.perf_counter())
            self.losses.append(outputs["loss"].detach())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        losses = trainer.strategy.reduce(torch.stack(self.losses), reduce_op="mean").tolist()
        if trainer.is_global_zero:
            durations = [b - a for a, b in zip(self.step_ends[:-1], self.step_ends[1:])]
            os.makedirs(self.out, exist_ok=True)
            summary = {
                "contender": "lightning_stock",
                "world_size": trainer.world_size,
                "steps": len(losses),
                "train_loss": losses,
                "step_time_s_median": statistics.median(durations),
                "step_times_s": durations,
            }
            with open(os.path.join(self.out, "summary.json"), "w") as f:
                json.dump(summary, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    add_workload_arguments(p)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--probe", action="store_true", help="add bench/probe.py's PhaseProbe (start-up timestamps)")
    p.add_argument("--no-progress-bar", action="store_true", help="enable_progress_bar=False")
    p.add_argument("--no-model-summary", action="store_true", help="enable_model_summary=False")
    p.add_argument("--no-logger", action="store_true", help="logger=False")
    p.add_argument("--no-checkpoint", action="store_true", help="enable_checkpointing=False")
    p.add_argument("--no-log-call", action="store_true", help="no self.log(...) in training_step")
    p.add_argument("--no-sigterm-broadcast", action="store_true", help="skip Lightning 2.6's per-step SIGTERM broadcast")
    p.add_argument("--bare", action="store_true", help="all the --no-* flags")
    args = p.parse_args()
    if args.bare:
        for flag in ("progress_bar", "model_summary", "logger", "checkpoint", "log_call", "sigterm_broadcast"):
            setattr(args, f"no_{flag}", True)
    if args.no_sigterm_broadcast:
        from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

        _TrainingEpochLoop._broadcast_sigterm_tensor = lambda self: None  # a collective + .item() every step

    pl.seed_everything(args.seed)
    datamodule = CharsDataModule(seq_len=args.seq_len, global_batch_size=args.global_batch_size, seed=args.seed)
    datamodule.configure(data_parallel_size=args.devices, accumulate=1)
    pl.seed_everything(args.seed)
    model = GPT(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, **datamodule.model_kwargs())
    optimizer = partial(torch.optim.AdamW, lr=3.0e-3, betas=(0.9, 0.99), weight_decay=0.01)  # conf/optim/adamw.yaml
    decay = args.steps if args.decay_steps is None else args.decay_steps
    module = (QuietTrainModule if args.no_log_call else TrainModule)(model, optimizer, warmup_steps=args.warmup_steps, decay_steps=decay, min_lr_ratio=0.1)
    callbacks: list[Callback] = [StepTimer(args.out)]
    if args.probe:  # built here, after data and model, like parallelkit.run builds its callbacks
        from probe import PhaseProbe  # bench/ is this script's directory

        callbacks.append(PhaseProbe(args.out))

    trainer = pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.steps,
        default_root_dir=args.out,
        callbacks=callbacks,
        use_distributed_sampler=False,
        **({"enable_progress_bar": False} if args.no_progress_bar else {}),
        **({"enable_model_summary": False} if args.no_model_summary else {}),
        **({"logger": False} if args.no_logger else {}),
        **({"enable_checkpointing": False} if args.no_checkpoint else {}),
    )
    trainer.fit(module, datamodule=datamodule)


if __name__ == "__main__":
    main()
