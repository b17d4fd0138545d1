"""What a run directory already holds, and what a new run in it may do — decided before any rank starts.

A run directory (``hydra.run.dir``) keeps a run's whole history: ``metrics.csv``, ``summary.json`` and
``checkpoints/``. Running again in it never deletes or truncates any of that:

- a run that **finished** (``summary.json`` with all ``trainer.max_steps`` steps) is not retrained: one line
  says so and the job exits 0, with or without ``ckpt_path=last``;
- an **unfinished** run (metrics, checkpoints, no complete summary) is refused without ``ckpt_path``: one
  paragraph names the directory, the step it reached and what to do, exit code 2;
- a **resume** from step K goes on in place. What the earlier run wrote *after* step K — metrics rows, newer
  checkpoints, a summary of more steps — is about to be recomputed (exactly, by an exact resume) and is moved
  into side files (``metrics.after-step-K.N.csv``, ``checkpoints/after-step-K.N/``,
  ``summary.after-step-K.N.json``), never dropped, so that ``metrics.csv`` ends with every step once (a finished
  run's ``summary.json``, taken further with a larger ``trainer.max_steps``, becomes ``summary.until-step-S.N.json``);
- ``ckpt_path=last`` without a checkpoint says in one line that training starts from step 0, and why.

:func:`plan` inspects and decides on every rank (read-only, so that ranks started by torchrun reach the same
verdict); :meth:`RunDirPlan.apply` moves files on rank 0 only, as the last step before the other ranks are
let go (bad input found after the plan must leave the directory as it was).
"""

from __future__ import annotations

import csv
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from parallelkit.errors import ConfigError

SUMMARY = "summary.json"
METRICS = "metrics.csv"
CHECKPOINTS = "checkpoints"
LAST = "last.ckpt"
# PeriodicCheckpoint's names (Lightning's ModelCheckpoint default): epoch=0-step=200.ckpt, a file or a directory.
STEP_NAME = re.compile(r"^epoch=\d+-step=(\d+)")


class RunFinished(SystemExit):
    """The run directory holds a finished run: nothing to do (exit code 0)."""

    def __init__(self) -> None:
        super().__init__(0)


def write_atomically(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> None:
    """Write ``path`` through a temporary file in the same directory, flushed to disk, then renamed over it.

    A reader sees the old file or the whole new one, never part of it; a failed write (a full disk) leaves the
    old file and removes the temporary one. (fsspec's transaction, which Lightning uses, writes its temporary
    file under ``/tmp`` and *copies* it over the target when that is another file system: not atomic.)
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The optimizer step a checkpoint was saved at: a file, a sharded directory (``meta.pt``) or a DeepSpeed
    directory (``<tag>/*model_states.pt``); ``None`` if it cannot be read."""
    path = Path(path)
    if path.is_dir():
        candidates = [path / "meta.pt", *sorted(path.glob("*/*model_states.pt"))]
        path = next((p for p in candidates if p.is_file()), path)
    try:
        return int(_load_trusted(path)["global_step"])
    except Exception:  # noqa: BLE001 - unreadable or half-written: the checks before launch say what is wrong
        return None


def checkpoint_epoch(path: str | os.PathLike) -> int | None:
    """The epochs a checkpoint counts as finished (Lightning's ``epoch``); ``None`` if it cannot be read."""
    path = Path(path)
    if path.is_dir():
        path = path / "meta.pt"
    try:
        return int(_load_trusted(path)["epoch"])
    except Exception:  # noqa: BLE001 - as checkpoint_step
        return None


# Packages whose types a checkpoint of this run may hold besides tensors (DeepSpeed's enums, Lightning's and
# numpy's state): nothing from them runs code when rebuilt, unlike ``os.system`` in a crafted file.
_TRUSTED_PACKAGES = ("torch", "numpy", "lightning", "lightning_fabric", "deepspeed", "parallelkit", "omegaconf")


def _load_trusted(path: Path) -> Any:
    """``torch.load`` without running arbitrary pickled code: tensors and plain types, and the types of the
    packages that write checkpoints here; a file that needs anything else is unreadable (``None`` above)."""
    import importlib
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError:
        pass
    names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    if any(name.split(".")[0] not in _TRUSTED_PACKAGES for name in names):
        raise pickle.UnpicklingError(f"{path} holds types outside {_TRUSTED_PACKAGES}: {names}")
    allowed = []
    for name in names:
        module, _, attr = name.rpartition(".")
        allowed.append(getattr(importlib.import_module(module), attr))
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def logged_steps(path: Path) -> int | None:
    """How many optimizer steps have a row in ``metrics.csv`` (rows are 0-based: ``step`` s is optimizer step s+1)."""
    if not path.is_file():
        return None
    top = None
    with open(path, newline="") as file:
        for row in csv.DictReader(file):
            step = _row_step(row)
            if step is not None:
                top = step + 1 if top is None else max(top, step + 1)
    return top


@dataclass
class RunDirPlan:
    """What a run in ``out`` will do: resume from ``ckpt_path`` (``None``: from step 0) at step ``resume_step``,
    after moving aside what an earlier run wrote past it (``set_aside``, in :meth:`apply`)."""

    out: Path
    ckpt_path: str | None
    resume_step: int | None = None  # None: a fresh directory, nothing to move
    notes: list[str] = field(default_factory=list)

    def apply(self) -> list[Path]:
        """On rank 0, just before training: move what will be recomputed into side files; say what moved."""
        from lightning.pytorch.utilities import rank_zero_info

        for note in self.notes:
            rank_zero_info(note)
        # What a writer killed mid-write left (write_atomically's temporary files): never a whole checkpoint.
        for stale in (self.out / CHECKPOINTS).glob(".*.tmp[0-9]*") if (self.out / CHECKPOINTS).is_dir() else []:
            stale.unlink(missing_ok=True)
        moved = set_aside(self.out, self.resume_step) if self.resume_step is not None else []
        if moved:
            names = ", ".join(str(p.relative_to(self.out)) for p in moved)
            rank_zero_info(f"parallelkit: resuming at step {self.resume_step}: what the earlier run wrote after it is kept in {names}.")
        return moved


def plan(out: Path, ckpt_path: str | None, max_steps: int, max_epochs: int | None = None) -> RunDirPlan:
    """Decide what a training run in ``out`` does (see the module docstring). Read-only: safe on every rank.

    Raises:
        RunFinished: ``out`` holds a finished run (after printing one line).
        ConfigError: ``out`` holds an unfinished run and no ``ckpt_path`` was given.
    """
    from lightning.pytorch.utilities import rank_zero_info

    summary_steps = _summary_steps(out / SUMMARY)
    last = _last_checkpoint(out / CHECKPOINTS)
    last_step = checkpoint_step(last) if last is not None else None
    logged = logged_steps(out / METRICS)
    # A run by epochs (max_steps ≤ 0) is finished when its newest checkpoint has the epochs asked for now: the same
    # command with a larger trainer.max_epochs takes it further.
    epochs = checkpoint_epoch(last) if last is not None and max_steps <= 0 and max_epochs is not None and max_epochs > 0 else None
    more_epochs = epochs is not None and epochs < max_epochs
    if ckpt_path in (None, "last") and summary_steps is not None and not more_epochs and (max_steps <= 0 or summary_steps >= max_steps):
        of = f"{summary_steps} of trainer.max_steps={max_steps} steps" if max_steps > 0 else f"{summary_steps} steps, all its epochs"
        rank_zero_info(f"parallelkit: {out} already holds a finished run ({of}, {SUMMARY}); nothing to train. "
                       "To train again, choose another hydra.run.dir.")
        raise RunFinished()
    reached = max((s for s in (summary_steps, last_step, logged) if s is not None), default=None)
    if ckpt_path is None:
        if reached is None and last is None:
            return RunDirPlan(out, None)
        what = (f"a run of {summary_steps} steps, fewer than trainer.max_steps={max_steps}" if summary_steps is not None
                else f"an unfinished run: it reached step {reached if reached is not None else '?'}")
        newest = f"its newest checkpoint is {last} (step {last_step})" if last is not None else "it has no checkpoint"
        raise ConfigError(
            f"hydra.run.dir={out} holds {what}, and {newest}. A new run there would start from step 0 over its files. "
            "Add ckpt_path=last to go on from its newest checkpoint (nothing is lost: what it wrote after that "
            "checkpoint is kept in side files), or choose another hydra.run.dir to start afresh."
        )
    if ckpt_path == "last":
        if last is None:
            why = (f"the earlier run there stopped at step {reached} before writing one" if reached
                   else "there is no earlier run in it")
            note = f"parallelkit: ckpt_path=last: no checkpoint in {out / CHECKPOINTS}, so training starts from step 0 ({why})."
            return RunDirPlan(out, None, 0 if reached else None, [note])
        return RunDirPlan(out, str(last), last_step)
    return RunDirPlan(out, ckpt_path, checkpoint_step(ckpt_path) if reached is not None else None)


def set_aside(out: Path, step: int) -> list[Path]:
    """Move what a run wrote after optimizer step ``step`` into side files named ``after-step-<step>.<n>``."""
    n = 1
    while any(p.exists() for p in _side_names(out, step, n)) or list(out.glob(f"summary.until-step-*.{n}.json")):
        n += 1
    metrics_side, checkpoints_side, summary_side = _side_names(out, step, n)
    moved = []
    if _split_metrics(out / METRICS, step, metrics_side):
        moved.append(metrics_side)
    later = [p for p in _newer_checkpoints(out / CHECKPOINTS, step)]
    if later:
        checkpoints_side.mkdir(parents=True)
        for entry in later:
            entry.rename(checkpoints_side / entry.name)
        moved.append(checkpoints_side)
    summary_steps = _summary_steps(out / SUMMARY)
    if summary_steps is not None:
        # The resumed run writes its own at the end (with the whole loss history); the earlier one keeps its
        # measurements. A finished run taken further (a larger trainer.max_steps) is summarised "until" its end.
        if summary_steps <= step:
            summary_side = summary_side.with_name(f"summary.until-step-{summary_steps}.{n}.json")
        (out / SUMMARY).rename(summary_side)
        moved.append(summary_side)
    return moved


def _side_names(out: Path, step: int, n: int) -> tuple[Path, Path, Path]:
    tag = f"after-step-{step}.{n}"
    return out / f"metrics.{tag}.csv", out / CHECKPOINTS / tag, out / f"summary.{tag}.json"


def _split_metrics(path: Path, step: int, side: Path) -> bool:
    """Rows of optimizer steps > ``step`` (``step`` column ≥ ``step``) go to ``side``; the rest stay, in order.

    The side file is complete on disk before ``metrics.csv`` is replaced: a crash in between leaves a row in
    both files, never in neither.
    """
    if not path.is_file():
        return False
    with open(path, newline="") as file:
        reader = csv.DictReader(file)
        header = list(reader.fieldnames or [])
        rows = list(reader)
    later = [r for r in rows if (s := _row_step(r)) is not None and s >= step]
    if not later:
        return False
    keep = [r for r in rows if not ((s := _row_step(r)) is not None and s >= step)]
    for target, selected in ((side, later), (path, keep)):
        write_atomically(target, lambda f, selected=selected: _write_rows(f, header, selected))
    return True


def _write_rows(file: IO[bytes], header: list[str], rows: list[dict[str, str]]) -> None:
    import io

    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=header, restval="", extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    file.write(text.getvalue().encode())


def _row_step(row: dict[str, Any]) -> int | None:
    try:
        return int(float(row.get("step") or ""))
    except ValueError:
        return None


def _summary_steps(path: Path) -> int | None:
    try:
        return int(json.loads(path.read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _last_checkpoint(directory: Path) -> Path | None:
    """``last.ckpt``; or, if a sharded save died between moving the old one aside and renaming the new one in
    (``strategies/mesh.py``), the old one, which is complete; or, if ``last.ckpt`` was removed by hand, the
    newest step checkpoint."""
    steps = sorted((int(m.group(1)), p) for p in directory.glob("epoch=*-step=*.ckpt") if (m := STEP_NAME.match(p.name))) if directory.is_dir() else []
    for candidate in (directory / LAST, directory / f"{LAST}.old", *(p for _, p in reversed(steps))):
        if candidate.is_file() or (candidate.is_dir() and any(candidate.iterdir())):
            return candidate
    return None


def _newer_checkpoints(directory: Path, step: int) -> list[Path]:
    """Checkpoints (and what lives beside them, e.g. a parameter server's ``NAME_ps/``) of steps after ``step``."""
    if not directory.is_dir():
        return []
    later = []
    for entry in sorted(directory.iterdir()):
        match = STEP_NAME.match(entry.name)
        if match and int(match.group(1)) > step:
            later.append(entry)
    last = directory / LAST
    if last.exists() and (checkpoint_step(last) or 0) > step:
        later += [e for e in sorted(directory.iterdir()) if e.name == LAST or e.name.startswith("last_")]
    return later


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` writing each checkpoint file with :func:`write_atomically`: beside its
    final name, flushed, then renamed over it, so a full disk or a killed writer leaves the previous one whole.

    Example::

        strategy.checkpoint_io = AtomicCheckpointIO()
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        import torch

        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options (got {storage_options!r}).")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda file: torch.save(checkpoint, file))
