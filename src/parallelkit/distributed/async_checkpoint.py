"""Asynchronous checkpoints: the training step goes on while a background thread writes a staged copy.

``checkpoint.async_save=true`` (:class:`~parallelkit.callbacks.periodic_checkpoint.PeriodicCheckpoint`). A save
has two halves:

- **staging**, on the training thread, between two steps: Lightning's checkpoint dict (the same one
  ``trainer.save_checkpoint`` writes) is copied to host memory — tensors into staging buffers that are allocated
  at the first save and reused by every later one (a fresh allocation faults its pages in, which costs as much
  as the write itself), the rest deep-copied, so nothing the next steps change (parameters, moments, the loss
  history) reaches the file. A DTensor is staged as its local shard and wrapped again with its own spec
  (:func:`local_shard_stager`): torch's stager deep-copies a DTensor's spec and device mesh and allocates through
  DTensor dispatch, per tensor, which made the tensor-parallel stall 3x the copy of its bytes;
- **writing**, on a background thread, while training goes on.

A save can also defer part of its staging (``start(..., defer=...)``): the tensors that nothing changes before the
next optimizer step (parameters and optimizer moments, under Lightning's automatic optimization) are copied on the
background thread while the next step's forward and backward run, and the training thread waits for that copy
(:meth:`AsyncCheckpointWriter.wait_staged`) before the optimizer changes them. Training then stands still for
Lightning's dump and the copy of what does change earlier (module buffers, callbacks' and loops' state), plus
whatever of the deferred copy is not done by the time the optimizer steps; that wait is counted in the stall.

Two layouts, as the strategy writes them synchronously:

- ``file`` (``strategy=single``, ``ddp``; any strategy whose checkpoint is Lightning's one file): rank 0 stages
  and writes ``torch.save`` through :func:`parallelkit.run_dir.write_atomically`; other ranks hold nothing to write.
- ``sharded`` (the mesh strategies: ``zero``, ``tp``, ``pp``, ``moe``, ``hybrid4d``): every rank stages only its
  own shards and writes them with ``torch.distributed.checkpoint.save`` on the background thread (as torch's
  ``async_save`` does from its own) into ``NAME.tmp``, over a gloo group of its own (a background collective on
  the training group would interleave with the step's); when torch's save returns on rank 0 every rank's shards
  and the ``.metadata`` are on disk, and rank 0 writes ``meta.pt`` (the completion marker) and swaps ``NAME.tmp``
  in, as
  :meth:`~parallelkit.strategies.base.ParallelKitStrategyMixin.save_directory_atomically` does. No rank gathers
  anything.

The second name of a checkpoint (``epoch=E-step=S.ckpt`` beside ``last.ckpt``) is a hard link of the first one's
files (checkpoint files are never modified in place: a new one is renamed over the old), or a copy where the file
system has no hard links. At most one save is in flight: :meth:`AsyncCheckpointWriter.start` is only called
once :meth:`AsyncCheckpointWriter.wait` returned. A writer killed with its process leaves ``NAME.tmp`` (or a
hidden temporary file) beside the previous checkpoint, which stays whole.

Strategies that write checkpoints their own way (DeepSpeed's engine, the parameter server's table snapshots) are
refused with :class:`~parallelkit.errors.ConfigError` (:func:`checkpoint_layout`).
"""

from __future__ import annotations

import functools
import os
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

from parallelkit.errors import ConfigError

FILE, SHARDED = "file", "sharded"
META_FILE = "meta.pt"  # Lightning's ModelParallelStrategy writes the non-tensor state here, last


def checkpoint_layout(strategy: Any) -> str:
    """How ``strategy`` writes a checkpoint: ``"file"`` or ``"sharded"``; :class:`ConfigError` where the asynchronous
    writer cannot reproduce it (a strategy that overrides ``save_checkpoint`` with a writer of its own)."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.strategies import ModelParallelStrategy, Strategy

    name = getattr(strategy, "strategy_name", type(strategy).__name__)
    owner = next(c for c in type(strategy).__mro__ if "save_checkpoint" in vars(c))
    # Lightning's model-parallel layouts: its own class's, or a subclass's that declares it writes them (MeshStrategy;
    # declared, not imported: distributed/ sits below strategies/).
    model_parallel = owner is ModelParallelStrategy or vars(owner).get("writes_model_parallel_layout", False)
    if model_parallel and getattr(strategy, "_save_distributed_checkpoint", False):
        return SHARDED
    if owner is Strategy or model_parallel:  # the latter: one file, gathered on rank 0
        io = getattr(strategy, "checkpoint_io", None)
        if io is None or isinstance(io, TorchCheckpointIO):
            return FILE
        raise ConfigError(f"checkpoint.async_save=true writes the checkpoint file itself, but strategy={name} writes it through "
                          f"{type(io).__name__}, which would be bypassed. Use checkpoint.async_save=false.")
    raise ConfigError(
        f"checkpoint.async_save=true does not work with strategy={name}: it writes its checkpoints its own way "
        f"({owner.__qualname__}.save_checkpoint: e.g. DeepSpeed's engine, or the parameter server's table snapshots), which a "
        "background writer cannot take over. Use checkpoint.async_save=false (every save then blocks training while it writes)."
    )


@dataclass
class SaveRecord:
    """One checkpoint: its step, the names it was written to, how long training stood still for it (``stall_s``:
    staging) and when it was complete on disk (``write_s`` after it began); ``error`` if the write failed."""

    step: int
    paths: list[Path]
    began: float
    stall_s: float = 0.0
    dump_s: float = 0.0  # of stall_s: Lightning's checkpoint dump (the rest: staging, and starting the write)
    staged_wait_s: float = 0.0  # of stall_s: the wait for the deferred staging, before the next optimizer step
    deferred: int = 0  # tensors whose copy was deferred to the background thread
    write_s: float | None = None
    error: BaseException | None = None
    #: whether some rank's write of this save failed (every rank's writer thread agrees on it when its write ended)
    failed_anywhere: bool | None = None
    staged: threading.Event = field(default_factory=threading.Event)  # every tensor copied: the live state may change
    done: threading.Event = field(default_factory=threading.Event)


class AsyncCheckpointWriter:
    """Stage a Lightning checkpoint between two steps, write it on a background thread; one save in flight at most.

    Args:
        layout: ``"file"`` or ``"sharded"`` (:func:`checkpoint_layout`).
        timeout_s: how long a background collective of a sharded save waits for the other ranks.

    Example::

        writer = AsyncCheckpointWriter(checkpoint_layout(trainer.strategy))
        writer.setup(trainer.strategy)
        writer.start(trainer, [Path("ckpts/last.ckpt")])  # returns once staged
        ...                                                # training steps
        record = writer.wait()                             # on disk (or record.error)
    """

    def __init__(self, layout: str, timeout_s: float = 600.0) -> None:
        if layout not in (FILE, SHARDED):
            raise ValueError(f"layout must be {FILE!r} or {SHARDED!r}, got {layout!r}")
        self.layout = layout
        self.timeout_s = float(timeout_s)
        self.records: list[SaveRecord] = []
        self._thread: threading.Thread | None = None
        self._stager: Any = None
        self._swept: set[Path] = set()  # the temporary directories of sharded saves checked for a dead writer's
        self._group: Any = None

    # ---------------------------------------------------------------------------------------- set-up
    def setup(self, strategy: Any) -> None:
        """On every rank, while the ranks are in step (a callback's ``setup``): the gloo group of the background
        collectives (sharded layout) and the staging buffers' owner."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import StagingOptions

        # No pinned or shared memory (host tensors already), staging on the calling thread: its buffers are cached
        # per source storage and reused by the next save, which overwrites them only once this one is written.
        self._stager = local_shard_stager(StagingOptions(False, False, False, False))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))

    def close(self) -> None:
        """Release the staging buffers (after the last :meth:`wait`)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    # ---------------------------------------------------------------------------------------- saving
    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def start(self, trainer: Any, paths: list[Path], defer: Callable[[torch.Tensor], bool] | None = None) -> SaveRecord:
        """Stage the trainer's checkpoint (every rank, in step: Lightning's dump may run collectives) and start
        writing it to ``paths`` (the first written, the others linked to it). Call :meth:`wait` first: it returns
        once every rank's writer has finished (they agree on failures at the end), so a sharded save's rank 0 has
        renamed the temporary directory the next save's shards go to.

        ``defer``: which tensors of the model's and the optimizers' state dicts may be copied on the background
        thread, after this returns; the caller must call :meth:`wait_staged` before anything changes them (the
        next optimizer step). ``None``: everything is staged before this returns."""
        if self._thread is not None:
            raise RuntimeError("AsyncCheckpointWriter.start: a save is still in flight; wait() for it first (one save at a time).")
        if self._stager is None:
            self.setup(trainer.strategy)
        strategy = trainer.strategy
        began = time.perf_counter()
        record = SaveRecord(step=trainer.global_step, paths=[Path(p) for p in paths], began=began)
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)  # what trainer.save_checkpoint writes
        record.dump_s = time.perf_counter() - began
        if self.layout == FILE:
            work = self._stage_file(strategy, checkpoint, record, defer)
        else:
            work = self._stage_sharded(strategy, checkpoint, record, defer)
        record.stall_s = time.perf_counter() - began
        self.records.append(record)
        self._thread = threading.Thread(target=self._write, args=(work, record), name=f"parallelkit-checkpoint-{record.step}")
        self._thread.start()
        return record

    def wait_staged(self) -> float:
        """Block until the save in flight (if any) holds its own copy of every tensor; the seconds waited (added to
        the record's ``stall_s``). Call it before the state a deferred tensor belongs to changes."""
        if self._thread is None or self.records[-1].staged.is_set():
            return 0.0
        record, began = self.records[-1], time.perf_counter()
        record.staged.wait()
        waited = time.perf_counter() - began
        record.staged_wait_s += waited
        record.stall_s += waited
        return waited

    def wait(self) -> SaveRecord | None:
        """Block until the save in flight (if any) is on disk or failed; return its record (``record.error``)."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        return self.records[-1]

    # ---------------------------------------------------------------------------------------- the two layouts
    def _stage_file(self, strategy: Any, checkpoint: dict[str, Any], record: SaveRecord,
                    defer: Callable[[torch.Tensor], bool] | None) -> Callable[[], None]:
        if not strategy.is_global_zero:  # Lightning's one file is rank 0's
            return lambda: self._stage_deferred(None, [], record)
        checkpoint, deferred = _split(checkpoint, defer, under=("state_dict", "optimizer_states"))
        staged = self._stager.stage(checkpoint)
        first, others = record.paths[0], record.paths[1:]

        def write() -> None:
            from parallelkit import run_dir  # through the module: fault injection replaces write_atomically there

            self._stage_deferred(staged, deferred, record)
            first.parent.mkdir(parents=True, exist_ok=True)
            run_dir.write_atomically(first, lambda file: torch.save(staged, file))
            for other in others:
                _link_file(first, other)

        return write

    def _stage_sharded(self, strategy: Any, checkpoint: dict[str, Any], record: SaveRecord,
                       defer: Callable[[torch.Tensor], bool] | None) -> Callable[[], None]:
        import torch.distributed.checkpoint as dcp

        first, others = record.paths[0], record.paths[1:]
        tmp = first.with_name(first.name + ".tmp")
        if tmp not in self._swept:
            # A writer that died in an earlier process left it: gone before any rank writes a shard there. Only the
            # first save to a name can find one (this process's own writes rename theirs away, and a failed write
            # stops the job), so later saves skip this synchronisation of every rank.
            if strategy.is_global_zero and tmp.exists():
                shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
            strategy.barrier("async_checkpoint.stage")
            self._swept.add(tmp)
        tmp.mkdir(parents=True, exist_ok=True)
        # Lightning's ModelParallelStrategy.save_checkpoint layout: tensors through DCP, the rest in meta.pt (rank 0).
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        tensors.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        meta = self._stager.stage(checkpoint) if strategy.is_global_zero else None
        tensors, deferred = _split(tensors, defer)
        staged = self._stager.stage(tensors)
        is_zero = strategy.is_global_zero

        def write() -> None:
            self._stage_deferred(staged, deferred, record)
            # Over the writer's own gloo group, as torch's dcp.async_save writes from its thread: every rank's shards
            # and the .metadata are on disk once rank 0's save returns.
            dcp.save(staged, checkpoint_id=str(tmp), process_group=self._group)
            if not is_zero:
                return
            torch.save(meta, tmp / META_FILE)
            _swap_in_directory(tmp, first)
            for other in others:
                _link_tree(first, other)

        return write

    def _stage_deferred(self, staged: Any, deferred: list[tuple[tuple, torch.Tensor]], record: SaveRecord) -> None:
        """On the background thread: copy the deferred tensors into ``staged`` (at their paths), then say so."""
        record.deferred = len(deferred)
        if deferred:
            copies = self._stager.stage([tensor for _, tensor in deferred])
            for (path, _), copy in zip(deferred, copies):
                parent = staged
                for key in path[:-1]:
                    parent = parent[key]
                parent[path[-1]] = copy
        record.staged.set()

    def _write(self, work: Callable[[], None], record: SaveRecord) -> None:
        try:
            work()
        except BaseException as err:  # noqa: BLE001 - handed to the training thread at wait()
            record.error = err
        finally:
            record.staged.set()  # also when staging failed: the training thread must not wait forever
            record.write_s = time.perf_counter() - record.began
            try:
                record.failed_anywhere = self._agree_on_failure(record.error is not None)
            except BaseException as err:  # noqa: BLE001 - e.g. a rank died: this save counts as failed here
                record.error = record.error or err
                record.failed_anywhere = True
            record.done.set()

    def _agree_on_failure(self, failed: bool) -> bool:
        """On the writer's thread, once this rank's write ended: whether any rank's failed. Every rank's writer does
        this for every save, over the writer's own group, so the training thread learns it at :meth:`wait` without a
        collective of its own (which would wait for the slowest rank to reach the next save)."""
        if self._group is None:
            return failed
        import torch.distributed as dist

        flag = torch.tensor([float(failed)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())


def _split(tree: Any, defer: Callable[[torch.Tensor], bool] | None,
           under: tuple[str, ...] | None = None) -> tuple[Any, list[tuple[tuple, torch.Tensor]]]:
    """``tree`` with each tensor that ``defer`` accepts replaced by ``None`` (in new containers: the state dicts'
    inner dicts can be the optimizer's own), and those tensors with their paths. Only dicts and lists are walked,
    and at the top level only the keys in ``under`` (when given)."""
    deferred: list[tuple[tuple, torch.Tensor]] = []
    if defer is None:
        return tree, deferred

    def walk(obj: Any, path: tuple) -> Any:
        if isinstance(obj, torch.Tensor) and defer(obj):
            deferred.append((path, obj))
            return None
        if type(obj) in (dict, OrderedDict):
            return type(obj)((key, walk(value, (*path, key))) for key, value in obj.items())
        if type(obj) is list:
            return [walk(value, (*path, i)) for i, value in enumerate(obj)]
        return obj

    if under is None:
        return walk(tree, ()), deferred
    return {key: (walk(value, (key,)) if key in under else value) for key, value in tree.items()}, deferred


def storage_key(tensor: torch.Tensor) -> int:
    """The address of the memory a tensor (a DTensor: its local shard) lives in: views and aliases share it."""
    local = getattr(tensor, "_local_tensor", tensor)
    return local.untyped_storage().data_ptr()


@functools.cache
def _local_shard_stager_class() -> type:
    from torch.distributed.checkpoint.staging import DefaultStager
    from torch.distributed.tensor import DTensor

    class _LocalShardStager(DefaultStager):
        """torch's ``DefaultStager`` that stages each DTensor's local shard as a plain tensor (through the same cached
        buffers) and wraps the copy in a DTensor of the original's spec. The spec (mesh, placements, global shape
        and offsets) does not change between steps, so the staged DTensor shares it instead of deep-copying it."""

        def stage(self, state_dict: Any, **kwargs: Any) -> Any:
            found: list[tuple[tuple, Any]] = []

            def strip(obj: Any, path: tuple) -> Any:
                if isinstance(obj, DTensor):
                    found.append((path, obj._spec))
                    return obj._local_tensor
                if type(obj) in (dict, OrderedDict):  # the containers of state dicts; anything else is copied whole
                    return type(obj)((key, strip(value, (*path, key))) for key, value in obj.items())
                if type(obj) is list:
                    return [strip(value, (*path, i)) for i, value in enumerate(obj)]
                return obj

            staged = super().stage(strip(state_dict, ()), **kwargs)
            for path, spec in found:
                parent = staged
                for key in path[:-1]:
                    parent = parent[key]
                parent[path[-1]] = DTensor(parent[path[-1]], spec, requires_grad=False)
            return staged

    return _LocalShardStager


def local_shard_stager(options: Any) -> Any:
    """A ``DefaultStager(options)`` that stages DTensors as their local shards (the class is built on first use: it
    imports torch.distributed.checkpoint, which a run without asynchronous saves never needs)."""
    return _local_shard_stager_class()(options)


def _swap_in_directory(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``, the old one moved aside first and removed after (as the synchronous save does)."""
    old = final.with_name(final.name + ".old")
    if final.exists() or final.is_symlink():
        if old.is_dir():
            shutil.rmtree(old)
        elif old.exists():
            old.unlink()
        final.rename(old)
    tmp.rename(final)
    if old.is_dir():
        shutil.rmtree(old)
    elif old.exists():
        old.unlink()


def _link_file(source: Path, target: Path) -> None:
    """``target`` becomes a second name of ``source`` (a copy where hard links are refused), atomically."""
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(source, tmp)
    except OSError:
        shutil.copyfile(source, tmp)
    os.replace(tmp, target)


def _link_tree(source: Path, target: Path) -> None:
    """``target`` becomes a directory of hard links to ``source``'s files (copies where links are refused), swapped in whole."""
    tmp = target.with_name(target.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, tmp, copy_function=link)
    _swap_in_directory(tmp, target)
