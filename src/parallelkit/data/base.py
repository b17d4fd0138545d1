"""What every parallelkit datamodule shares: the batch plan and the data-parallel sampler."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from parallelkit.data.batching import BatchPlan
from parallelkit.data.sampler import DataParallelBatchSampler
from parallelkit.errors import ConfigError


class DataParallelDataModule(pl.LightningDataModule):
    """Base datamodule: subclasses build ``self.train_set``/``self.val_set`` in :meth:`build`.

    The batch plan is resolved by :meth:`configure` (called by ``parallelkit.run`` before any process
    starts), and the loaders shard by the strategy's data-parallel rank, not the global rank.
    """

    def __init__(
        self,
        global_batch_size: int | None = None,
        per_device_batch_size: int | None = None,
        val_batch_size: int | None = None,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.global_batch_size = global_batch_size
        self.per_device_batch_size = per_device_batch_size
        self.val_batch_size = val_batch_size
        self.seed = seed
        self.num_workers = num_workers
        self.plan: BatchPlan | None = None
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self._train_sampler: DataParallelBatchSampler | None = None
        self._resume: tuple[int, int] | None = None

    # Subclasses -------------------------------------------------------------
    def build(self) -> None:
        """Create ``train_set`` and ``val_set``; raise :class:`ConfigError` for unusable input."""
        raise NotImplementedError

    def model_kwargs(self) -> dict[str, Any]:
        """Constructor arguments the model takes from the data (vocabulary size, feature sizes)."""
        return {}

    # Shared -----------------------------------------------------------------
    def configure(self, data_parallel_size: int, accumulate: int) -> BatchPlan:
        """Resolve the batch plan for this run and build the data sets. Safe to call more than once."""
        self.plan = BatchPlan.resolve(
            global_batch_size=self.global_batch_size,
            per_device_batch_size=self.per_device_batch_size,
            data_parallel_size=data_parallel_size,
            accumulate=accumulate,
        )
        if self.train_set is None:
            self.build()
        if len(self.train_set) < self.plan.global_batch_size:
            raise ConfigError(
                f"The training set has {len(self.train_set)} samples, fewer than one global batch of "
                f"{self.plan.global_batch_size}. Use a smaller data.global_batch_size or a larger data set."
            )
        return self.plan

    def _data_parallel_rank(self) -> int:
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        size = kwargs.get("num_replicas", 1)
        if self.plan is None or size != self.plan.data_parallel_size:
            raise ConfigError(
                f"The strategy shards data over {size} data-parallel ranks, but the batch plan was made for "
                f"{None if self.plan is None else self.plan.data_parallel_size}. Let parallelkit.run build the "
                "run, or call datamodule.configure(data_parallel_size, accumulate) yourself."
            )
        return kwargs.get("rank", 0)

    @override
    def train_dataloader(self) -> DataLoader:
        sampler = DataParallelBatchSampler(len(self.train_set), self.plan, self._data_parallel_rank(), self.seed)
        if self._resume is not None:
            sampler.resume_at(*self._resume)
        self._train_sampler = sampler
        return PositionedDataLoader(self.train_set, batch_sampler=sampler, num_workers=self.num_workers)

    # Exact resume -----------------------------------------------------------
    # Lightning restores its loop counters but restarts a plain DataLoader at the beginning of the epoch;
    # the checkpoint therefore records how many micro-batches of the epoch were consumed, and the sampler
    # skips them on resume, so a resumed run sees exactly the batches an uninterrupted run would.
    @override
    def state_dict(self) -> dict[str, Any]:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return {}
        # ``processed`` counts the batches whose training step finished in this epoch (checkpoints are
        # written in on_train_batch_end, after the count; the loader itself has prefetched one more).
        processed = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        epochs = getattr(trainer.fit_loop, "epoch_progress", None)
        if epochs is not None and epochs.current.completed == epochs.current.started and processed >= trainer.num_training_batches:
            # Written after an epoch ran all its batches (current_epoch already counts it): the next epoch starts at its
            # beginning, though the batch counters still hold the finished epoch's until the next one starts. (An epoch
            # counted as finished before its batches were, by a run stopped mid-epoch, keeps its position:
            # periodic_checkpoint.continue_the_epoch puts it back in that epoch.)
            return {"epoch": trainer.current_epoch, "batches_done": 0}
        return {"epoch": trainer.current_epoch, "batches_done": processed}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        self._resume = (int(state_dict["epoch"]), int(state_dict["batches_done"]))
        if self._train_sampler is not None:
            self._train_sampler.resume_at(*self._resume)

    @override
    def val_dataloader(self) -> DataLoader:
        sampler = self._val_sampler(self._data_parallel_rank())
        return DataLoader(self.val_set, batch_sampler=sampler, num_workers=self.num_workers)

    def _val_sampler(self, rank: int) -> DataParallelBatchSampler:
        micro = self.val_batch_size or self.plan.micro_batch_size * self.plan.accumulate
        plan = BatchPlan(micro * self.plan.data_parallel_size, micro, self.plan.data_parallel_size, 1)
        return DataParallelBatchSampler(len(self.val_set), plan, rank, self.seed, shuffle=False)

    def empty_validation(self) -> str | None:
        """Why validation would have no batch on some rank (after :meth:`configure`), or None: it has batches.
        Lightning would only say "Total length of DataLoader across ranks is zero" and skip it."""
        sampler = self._val_sampler(0)
        if len(sampler) > 0:
            return None
        micro, ranks = sampler.plan.micro_batch_size, sampler.plan.data_parallel_size
        return (f"the validation set holds {len(self.val_set)} samples, fewer than one batch of {micro} on each of {ranks} "
                f"data-parallel rank(s) ({micro * ranks}); a larger data.val_fraction, a smaller data.val_batch_size or more "
                "data gives it one")


class PositionedDataLoader(DataLoader):
    """The training loader: resumable mid-epoch, with its position kept by its data module.

    Lightning asks the training loader for ``state_dict``/``load_state_dict`` before a mid-epoch resume and, without
    them, warns that the loader would restart at the beginning of the epoch. This one does not: the data module
    records the position (:meth:`DataParallelDataModule.state_dict`: the epoch and the micro-batches Lightning
    counted as processed, the loader's prefetched one excluded) and Lightning restores it before it builds the
    loader, whose sampler then skips those micro-batches. The loader has no state of its own to add.
    """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore here: the data module set the sampler's position (``resume_at``) already."""
