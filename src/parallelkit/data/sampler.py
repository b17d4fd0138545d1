"""A deterministic batch sampler sharded by the data-parallel rank only.

Lightning's automatic ``DistributedSampler`` always shuffles with its own seed and shards by global rank;
exact comparisons with one process need more: one global order of samples per epoch (from ``seed`` and
the epoch), cut into global batches, and each global batch cut into ``accumulate`` chunks of
``data_parallel_size × micro`` samples, of which this rank takes its slice. One process with the same
global batch sees exactly the same samples in every optimizer step. Ranks that differ only in their
tensor- or pipeline-parallel coordinate get the same data-parallel rank, hence the same batches.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from parallelkit.data.batching import BatchPlan


class GlobalOrder(Sampler[int]):
    """The order of all samples in one epoch: a permutation from ``seed + epoch``, or the identity.

    Lightning's fit loop calls ``set_epoch`` on ``loader.batch_sampler.sampler``, so the per-epoch state
    lives here, in the batch sampler's ``sampler`` attribute.
    """

    def __init__(self, num_samples: int, seed: int, shuffle: bool) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.num_samples))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.num_samples, generator=generator).tolist())


class DataParallelBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches (lists of indices) in the global order.

    Args:
        num_samples: size of the dataset.
        plan: the batch sizes (global, micro, data-parallel size, accumulation).
        rank: this process's data-parallel rank.
        seed: base seed; epoch ``e`` uses ``seed + e``.
        shuffle: permute the samples each epoch (training) or keep their order (validation).

    Example::

        sampler = DataParallelBatchSampler(len(ds), plan, rank=dp_rank, seed=0)
        loader = DataLoader(ds, batch_sampler=sampler)
    """

    def __init__(self, num_samples: int, plan: BatchPlan, rank: int, seed: int = 0, shuffle: bool = True) -> None:
        if not 0 <= rank < plan.data_parallel_size:
            raise ValueError(f"rank {rank} is outside {plan.data_parallel_size} data-parallel ranks")
        self.num_samples = num_samples
        self.plan = plan
        self.rank = rank
        self.sampler = GlobalOrder(num_samples, seed, shuffle)
        # Incomplete global batches are dropped: every optimizer step sees the full global batch.
        self.steps_per_epoch = num_samples // plan.global_batch_size
        self._resume: dict[int, int] = {}  # epoch → micro-batches already consumed (mid-epoch resume)

    def resume_at(self, epoch: int, batches_done: int) -> None:
        """The next pass over ``epoch`` starts after its first ``batches_done`` micro-batches (once)."""
        self._resume = {epoch: batches_done}

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def __len__(self) -> int:
        return self.steps_per_epoch * self.plan.accumulate

    def __iter__(self) -> Iterator[list[int]]:
        order = list(self.sampler)
        plan = self.plan
        chunk = plan.micro_batch_size * plan.data_parallel_size
        skip = self._resume.pop(self.epoch, 0)
        for step in range(self.steps_per_epoch):
            for accum in range(plan.accumulate):
                if skip:
                    skip -= 1
                    continue
                start = step * plan.global_batch_size + accum * chunk + self.rank * plan.micro_batch_size
                yield order[start : start + plan.micro_batch_size]
