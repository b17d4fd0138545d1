"""Records the run's measurements and writes ``summary.json`` (rank 0) at the end of training.

Per optimizer step it keeps this rank's loss and a timestamp, with no collective. Every
``trainer.log_every_n_steps`` steps the pending losses are averaged over ranks in one all-reduce and
written to ``metrics.csv`` as ``train_loss`` (the global mean, one row per step) and to the progress bar.
At the end it gathers the maxima of memory figures over ranks and writes the summary atomically.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from parallelkit.distributed.comm_stats import CommStats
from parallelkit.distributed.parallel_dims import ParallelDims
from parallelkit.errors import TrainingDiverged
from parallelkit.process_stats import model_state_bytes, os_bytes_written, peak_rss_bytes
from parallelkit.models.plans import parallel_model


class RunSummary(Callback):
    """Measure the run and write ``output_dir/summary.json``.

    Args:
        output_dir: where ``summary.json`` goes.
        global_batch_size: samples per optimizer step over all ranks.
        num_params: parameters of the full (unsharded) model.
        print_table: print a final table on rank 0.

    Example::

        Trainer(callbacks=[RunSummary("out", global_batch_size=32, num_params=n)])
    """

    def __init__(self, output_dir: str | os.PathLike, global_batch_size: int, num_params: int, print_table: bool = True) -> None:
        self.output_dir = Path(output_dir)
        self.global_batch_size = global_batch_size
        self.num_params = num_params
        self.print_table = print_table
        self.train_loss: list[float] = []  # global means, filled at each flush
        self._pending: list[torch.Tensor] = []  # this rank's step losses not yet averaged
        self._accum: torch.Tensor | None = None
        self._seen_step = 0
        self._step_ends: list[float] = []
        self._grad_bytes = 0
        self.summary: dict[str, Any] | None = None
        self._trainer: pl.Trainer | None = None

    # ---------------------------------------------------------------- per step
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainer = trainer
        self._seen_step = trainer.global_step
        self._step_ends = [time.perf_counter()]

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        # Gradients exist only between backward and zero_grad: measure them on the first step.
        if not self._grad_bytes:
            self._grad_bytes = _state_bytes(trainer.strategy)["grads"]

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is None:
            return
        # Lightning divides each micro-batch loss by accumulate_grad_batches: their sum is the step's mean.
        loss = loss.detach().float()
        if not bool(torch.isfinite(loss)) and not any(getattr(c, "skips_nonfinite_steps", False) for c in trainer.callbacks):
            raise TrainingDiverged(
                f"the training loss is {loss.item()} at step {trainer.global_step + 1} on rank {trainer.global_rank}: training "
                "diverged. Lower optim.optimizer.lr, add warm-up (optim.schedule.warmup_steps), clip gradients "
                "(trainer.gradient_clip_val), or use callbacks=[amp] with dtype=fp16 to skip overflowing steps."
            )
        self._accum = loss if self._accum is None else self._accum + loss
        if trainer.global_step != self._seen_step:  # an optimizer step has just happened
            self._seen_step = trainer.global_step
            self._step_ends.append(time.perf_counter())
            self._pending.append(self._accum)
            self._accum = None
            # Providers of per-step values (e.g. the MoE model's routing metrics): one metrics.csv row per step.
            step_values: dict[str, float] = {}
            for provider in _step_metric_providers(trainer, pl_module):
                step_values.update(provider.step_metrics())
            if step_values:
                log_step_metrics(trainer, step_values)
            if len(self._pending) >= max(trainer.log_every_n_steps, 1):
                self._flush(trainer)

    def _flush(self, trainer: pl.Trainer) -> None:
        if not self._pending:
            return
        means = _global_mean(trainer.strategy, torch.stack(self._pending)).cpu().tolist()
        first_step = len(self.train_loss) + 1
        self.train_loss.extend(means)
        self._pending = []
        for offset, value in enumerate(means):
            for logger in trainer.loggers:
                logger.log_metrics({"train_loss": value}, step=first_step + offset - 1)
        for logger in trainer.loggers:
            logger.save()
        trainer.progress_bar_metrics["train_loss"] = means[-1]

    # ---------------------------------------------------------------- end of training
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flush(trainer)
        strategy = trainer.strategy
        steps = len(self.train_loss)
        durations = [b - a for a, b in zip(self._step_ends[:-1], self._step_ends[1:])]
        median = statistics.median(durations) if durations else float("nan")
        state = _state_bytes(strategy)
        state["grads"] = max(state["grads"], self._grad_bytes)
        local_max = torch.tensor([float(peak_rss_bytes()), *map(float, state.values()), float(os_bytes_written())], dtype=torch.float64)
        maxima = _global_max(strategy, local_max).tolist()
        comm: CommStats | None = getattr(strategy, "comm_stats", None)
        # Traffic was counted in this process only: divide by the steps it ran (not a resumed run's history).
        steps_here = max(len(self._step_ends) - 1, 1)
        comm_per_step = comm.per_step(steps_here) if comm is not None else {"bytes_sent_per_step": None, "collectives_per_step": None}
        val = trainer.callback_metrics.get("val_loss")
        self.summary = {
            "strategy": getattr(strategy, "strategy_name", type(strategy).__name__),
            "world_size": trainer.world_size,
            "dims": _dims(strategy, trainer.world_size),
            "steps": steps,
            "global_batch_size": self.global_batch_size,
            "num_params": self.num_params,
            "train_loss": self.train_loss,
            "final_loss": self.train_loss[-1] if self.train_loss else None,
            "val_loss": float(val) if val is not None else None,
            "step_time_s_median": median,
            "samples_per_s": self.global_batch_size / median if durations and median > 0 else None,
            "peak_rss_bytes": int(maxima[0]),
            "model_state_bytes": dict(zip(state.keys(), (int(v) for v in maxima[1:-1]))),
            "os_bytes_written": int(maxima[-1]),  # max over ranks, whole process life (see os_bytes_written)
            "comm": comm_per_step,
        }
        # Strategies, callbacks and models add their own entries (MoE load, loss scale, ...). Called on
        # every rank in the same order, so a provider may use collectives.
        for provider in _metric_providers(trainer, pl_module):
            extra = provider.summary_metrics(trainer)
            clash = set(extra) & set(self.summary)
            if clash:
                raise RuntimeError(f"{type(provider).__name__}.summary_metrics() would overwrite {sorted(clash)} in summary.json")
            self.summary.update(extra)
        self._write(self.summary)

    @rank_zero_only
    def _write(self, summary: dict[str, Any]) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.output_dir / "summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2))
        os.replace(tmp, self.output_dir / "summary.json")  # never a half-written summary
        if self.print_table:
            print_summary_table(summary, self.output_dir)

    @override
    def state_dict(self) -> dict[str, Any]:
        # Checkpoints are written on every rank at once: average the pending losses now (one collective),
        # so a resumed run's history has every step up to the checkpoint.
        if self._pending and self._trainer is not None:
            self._flush(self._trainer)
        return {"train_loss": list(self.train_loss)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.train_loss = list(state_dict.get("train_loss", []))


def _metric_providers(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[Any]:
    candidates = [trainer.strategy, *_models(pl_module), *trainer.callbacks]
    return [c for c in candidates if c is not None and callable(getattr(c, "summary_metrics", None))]


def _step_metric_providers(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[Any]:
    """Like :func:`_metric_providers`, for ``step_metrics() -> dict`` (called on every rank after each step)."""
    candidates = [trainer.strategy, *_models(pl_module), *trainer.callbacks]
    return [c for c in candidates if c is not None and callable(getattr(c, "step_metrics", None))]


def _models(pl_module: pl.LightningModule) -> list[Any]:
    """The LightningModule and, if it wraps one (parallelkit's TrainModule), its model: both may report metrics."""
    inner = parallel_model(pl_module)
    return [pl_module] if inner is pl_module else [pl_module, inner]


def log_step_metrics(trainer: pl.Trainer, metrics: dict[str, float], step: int | None = None) -> None:
    """Write per-step values to ``metrics.csv`` (every logger) without ``self.log``'s per-step cost.

    ``step`` defaults to the optimizer step that has just finished (0-based, like ``train_loss`` rows).
    Call it on every rank; only rank 0's loggers write.
    """
    step = trainer.global_step - 1 if step is None else step
    for logger in trainer.loggers:
        logger.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)


def _global_mean(strategy: Any, tensor: torch.Tensor) -> torch.Tensor:
    if hasattr(strategy, "global_mean"):
        return strategy.global_mean(tensor)
    return strategy.reduce(tensor.clone(), reduce_op="mean")


def _global_max(strategy: Any, tensor: torch.Tensor) -> torch.Tensor:
    if hasattr(strategy, "global_max"):
        return strategy.global_max(tensor)
    return strategy.reduce(tensor.clone(), reduce_op="max")


def _state_bytes(strategy: Any) -> dict[str, int]:
    if hasattr(strategy, "model_state_bytes"):
        return strategy.model_state_bytes()
    return model_state_bytes(strategy.lightning_module, strategy.optimizers)


def _dims(strategy: Any, world_size: int) -> dict[str, int]:
    dims = getattr(strategy, "parallel_dims", None)
    if isinstance(dims, ParallelDims):
        return dims.as_dict()
    return ParallelDims(world_size=world_size, dp=world_size).as_dict()  # a stock Lightning strategy


def print_summary_table(summary: dict[str, Any], output_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    def mib(n: float | None) -> str:
        return "-" if n is None else f"{n / 2**20:,.2f} MiB"

    losses = summary["train_loss"]
    dims = " × ".join(f"{k}={v}" for k, v in summary["dims"].items() if v > 1) or "1"
    table = Table(title=f"parallelkit · {summary['strategy']} · {summary['world_size']} process(es)", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("degrees", dims),
        ("steps", str(summary["steps"])),
        ("train loss first → last", f"{losses[0]:.4f} → {losses[-1]:.4f}" if losses else "-"),
        ("validation loss", "-" if summary["val_loss"] is None else f"{summary['val_loss']:.4f}"),
        ("step time (median)", f"{summary['step_time_s_median'] * 1e3:.1f} ms"),
        ("samples / s", "-" if summary["samples_per_s"] is None else f"{summary['samples_per_s']:,.0f}"),
        ("parameters", f"{summary['num_params']:,}"),
        ("params / grads / optimizer (max rank)", " / ".join(mib(v) for v in summary["model_state_bytes"].values())),
        ("peak RSS (max rank)", mib(summary["peak_rss_bytes"])),
        ("comm per step (per rank)", f"{mib(summary['comm']['bytes_sent_per_step'])} in {summary['comm']['collectives_per_step'] or 0:.1f} collectives"),
    ]
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    # Below the table, whole and as typed: a table cell is cut to the terminal's width ("…/outputs/d…"), and
    # Rich would read a run directory's "[amp]" (callbacks=[amp]) as markup.
    print(f"summary: {output_dir / 'summary.json'}", flush=True)
