"""BatchPlan (how a global batch is cut) and DataParallelBatchSampler (which samples each rank reads).

The sampler's contract (DESIGN §3, §5): with the same seed and global batch, the union of every
data-parallel rank's micro-batches of an optimizer step, over all accumulation chunks, is exactly the
batch one process reads in that step. Expectations are computed here from ``torch.randperm`` directly,
not from the sampler's own output.
"""

from __future__ import annotations

import functools
import re
from collections import Counter

import pytest
import torch

from parallelkit.data.batching import BatchPlan
from parallelkit.data.sampler import DataParallelBatchSampler
from parallelkit.distributed.parallel_dims import PP, TP, ParallelDims
from parallelkit.errors import ConfigError

# --------------------------------------------------------------------------- helpers


def plan_for(global_batch: int, dp: int, accumulate: int) -> BatchPlan:
    return BatchPlan.resolve(global_batch_size=global_batch, per_device_batch_size=None, data_parallel_size=dp, accumulate=accumulate)


def rank_steps(sampler: DataParallelBatchSampler) -> list[list[list[int]]]:
    """This rank's micro-batches grouped by optimizer step: steps[s] = [chunk_0, ..., chunk_{acc-1}]."""
    batches = list(sampler)
    acc = sampler.plan.accumulate
    assert len(batches) % acc == 0
    return [batches[i : i + acc] for i in range(0, len(batches), acc)]


def step_unions(num_samples: int, plan: BatchPlan, seed: int, epoch: int = 0, rank_seed=lambda seed, rank: seed) -> list[Counter]:
    """Per optimizer step, the multiset of indices read by all data-parallel ranks together."""
    per_rank = []
    for rank in range(plan.data_parallel_size):
        sampler = DataParallelBatchSampler(num_samples, plan, rank=rank, seed=rank_seed(seed, rank))
        sampler.set_epoch(epoch)
        per_rank.append(rank_steps(sampler))
    steps = len(per_rank[0])
    assert all(len(r) == steps for r in per_rank)
    unions = []
    for step in range(steps):
        union: Counter = Counter()
        for chunks in per_rank:
            for chunk in chunks[step]:
                union.update(chunk)
        unions.append(union)
    return unions


def reference_steps(num_samples: int, global_batch: int, seed: int, epoch: int = 0) -> list[Counter]:
    """What one process reads per step: consecutive global batches of the epoch's permutation."""
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    steps = num_samples // global_batch
    return [Counter(order[s * global_batch : (s + 1) * global_batch]) for s in range(steps)]


# --------------------------------------------------------------------------- BatchPlan


@pytest.mark.parametrize("global_batch, per_device", [(None, None), (32, 8)])
def test_exactly_one_of_global_and_per_device(global_batch, per_device):
    with pytest.raises(ConfigError) as err:
        BatchPlan.resolve(global_batch_size=global_batch, per_device_batch_size=per_device, data_parallel_size=2)
    message = str(err.value)
    assert "data.global_batch_size" in message and "data.per_device_batch_size" in message
    assert f"global_batch_size={global_batch}" in message and f"per_device_batch_size={per_device}" in message


@pytest.mark.parametrize("global_batch, dp, acc", [(32, 1, 1), (32, 2, 1), (32, 2, 2), (48, 3, 4), (64, 8, 8), (7, 7, 1)])
def test_global_mode_keeps_the_global_batch(global_batch, dp, acc):
    plan = plan_for(global_batch, dp, acc)
    assert plan.global_batch_size == global_batch
    assert plan.micro_batch_size * dp * acc == global_batch
    assert (plan.data_parallel_size, plan.accumulate) == (dp, acc)


@pytest.mark.parametrize("global_batch, dp, acc", [(30, 4, 1), (32, 3, 1), (32, 2, 3), (2, 4, 1), (100, 8, 2)])
def test_indivisible_global_batch_names_the_numbers_and_suggests_multiples(global_batch, dp, acc):
    per_step = dp * acc
    with pytest.raises(ConfigError) as err:
        plan_for(global_batch, dp, acc)
    message = str(err.value)
    assert f"data.global_batch_size={global_batch}" in message
    assert str(dp) in message and str(acc) in message and str(per_step) in message
    suggestion = re.search(r"e\.g\. (\d+) or (\d+)", message)
    assert suggestion, message
    low, high = (int(x) for x in suggestion.groups())
    # Both suggestions must actually work, and bracket the requested size where possible.
    for value in (low, high):
        assert value > 0 and value % per_step == 0
        assert plan_for(value, dp, acc).global_batch_size == value
    assert low < high and high - low == per_step
    if global_batch > per_step:
        assert low < global_batch < high


@pytest.mark.parametrize("per_device", [1, 4])
def test_per_device_mode_grows_the_global_batch(per_device):
    for dp, acc in [(1, 1), (2, 1), (4, 1), (2, 3), (16, 2)]:
        plan = BatchPlan.resolve(global_batch_size=None, per_device_batch_size=per_device, data_parallel_size=dp, accumulate=acc)
        assert plan.micro_batch_size == per_device
        assert plan.global_batch_size == per_device * dp * acc


@pytest.mark.parametrize(
    "kwargs, names",
    [
        (dict(global_batch_size=0, per_device_batch_size=None), "data.global_batch_size"),
        (dict(global_batch_size=-8, per_device_batch_size=None), "data.global_batch_size"),
        (dict(global_batch_size=None, per_device_batch_size=0), "data.per_device_batch_size"),
        (dict(global_batch_size=8.0, per_device_batch_size=None), "data.global_batch_size"),
        (dict(global_batch_size=8, per_device_batch_size=None, accumulate=0), "trainer.accumulate_grad_batches"),
    ],
)
def test_invalid_sizes_are_config_errors(kwargs, names):
    with pytest.raises(ConfigError) as err:
        BatchPlan.resolve(data_parallel_size=2, **kwargs)
    assert names in str(err.value)


# --------------------------------------------------------------------------- sampler: the exactness contract

NUM_SAMPLES = 197  # not a multiple of any global batch below: the remainder must be dropped


@pytest.mark.parametrize("dp, acc", [(1, 1), (2, 1), (4, 1), (1, 4), (2, 2), (4, 2), (8, 3)])
@pytest.mark.parametrize("epoch", [0, 3])
def test_union_over_ranks_and_chunks_equals_the_single_process_batch(dp, acc, epoch):
    global_batch = 48  # divisible by every dp × acc above
    plan = plan_for(global_batch, dp, acc)
    unions = step_unions(NUM_SAMPLES, plan, seed=7, epoch=epoch)
    single = step_unions(NUM_SAMPLES, plan_for(global_batch, 1, 1), seed=7, epoch=epoch)
    reference = reference_steps(NUM_SAMPLES, global_batch, seed=7, epoch=epoch)
    assert len(unions) == len(reference) == NUM_SAMPLES // global_batch
    assert unions == reference == single
    # Every index at most once per step (a multiset equal to a set of the global batch size).
    assert all(max(u.values()) == 1 and sum(u.values()) == global_batch for u in unions)


def test_negative_control_per_rank_seeds_break_the_union():
    """Shuffling each rank with its own seed (what a per-rank sampler does) must fail the comparison."""
    plan = plan_for(48, 4, 2)
    broken = step_unions(NUM_SAMPLES, plan, seed=7, rank_seed=lambda seed, rank: seed + rank)
    assert broken != reference_steps(NUM_SAMPLES, 48, seed=7)


def test_each_micro_batch_has_the_micro_size_and_ranks_are_disjoint():
    plan = plan_for(48, 4, 3)
    per_rank = [set() for _ in range(plan.data_parallel_size)]
    for rank in range(plan.data_parallel_size):
        for batch in DataParallelBatchSampler(NUM_SAMPLES, plan, rank=rank, seed=1):
            assert len(batch) == plan.micro_batch_size
            assert per_rank[rank].isdisjoint(batch)
            per_rank[rank].update(batch)
    for a in range(len(per_rank)):
        for b in range(a + 1, len(per_rank)):
            assert per_rank[a].isdisjoint(per_rank[b])


def test_ranks_differing_only_in_tp_pp_read_the_same_batches():
    dims = ParallelDims.from_degrees(16, dp=2, sharding=2, tp=2, pp=2)
    plan = plan_for(32, dims.data_parallel_size, 2)
    batches_by_rank = {
        rank: list(DataParallelBatchSampler(NUM_SAMPLES, plan, rank=dims.data_parallel_rank(rank), seed=3))
        for rank in range(dims.world_size)
    }
    for rank in range(dims.world_size):
        mine = dims.coordinates(rank)
        for other in range(dims.world_size):
            theirs = dims.coordinates(other)
            same_data_coords = all(mine[a] == theirs[a] for a in mine if a not in (TP, PP))
            assert (batches_by_rank[rank] == batches_by_rank[other]) == same_data_coords


# --------------------------------------------------------------------------- sampler: order, length, epochs


def test_same_seed_same_order_and_epochs_differ():
    plan = plan_for(16, 2, 1)
    first = DataParallelBatchSampler(NUM_SAMPLES, plan, rank=1, seed=5)
    again = DataParallelBatchSampler(NUM_SAMPLES, plan, rank=1, seed=5)
    assert list(first) == list(again)
    assert list(first) == list(first)  # iterating twice in one epoch repeats the order
    epoch0 = list(first)
    first.set_epoch(1)
    epoch1 = list(first)
    assert epoch1 != epoch0
    again.set_epoch(1)
    assert list(again) == epoch1
    other_seed = DataParallelBatchSampler(NUM_SAMPLES, plan, rank=1, seed=6)
    assert list(other_seed) != epoch0


@pytest.mark.parametrize("num_samples, global_batch, dp, acc", [(197, 48, 4, 2), (96, 48, 2, 1), (47, 48, 1, 1), (1000, 24, 3, 4)])
def test_len_counts_micro_batches_of_complete_steps(num_samples, global_batch, dp, acc):
    plan = plan_for(global_batch, dp, acc)
    for rank in range(dp):
        sampler = DataParallelBatchSampler(num_samples, plan, rank=rank, seed=0)
        batches = list(sampler)
        assert len(sampler) == len(batches) == (num_samples // global_batch) * acc


def test_validation_order_is_sequential_and_drops_the_incomplete_batch():
    num_samples, dp = 50, 2
    plan = BatchPlan(global_batch_size=12, micro_batch_size=6, data_parallel_size=dp, accumulate=1)
    per_rank = [list(DataParallelBatchSampler(num_samples, plan, rank=r, seed=9, shuffle=False)) for r in range(dp)]
    # Interleave back into the global stream: step s = rank 0's micro-batch, then rank 1's.
    stream = [i for step in zip(*per_rank) for batch in step for i in batch]
    complete = num_samples // 12 * 12
    assert stream == list(range(complete))
    # Epoch and seed do not matter without shuffling.
    sampler = DataParallelBatchSampler(num_samples, plan, rank=1, seed=123, shuffle=False)
    sampler.set_epoch(4)
    assert list(sampler) == per_rank[1]


def test_incomplete_last_global_batch_is_dropped_when_shuffling():
    plan = plan_for(48, 4, 2)
    unions = step_unions(NUM_SAMPLES, plan, seed=2)
    read = set().union(*unions)
    order = torch.randperm(NUM_SAMPLES, generator=torch.Generator().manual_seed(2)).tolist()
    complete = NUM_SAMPLES // 48 * 48
    assert read == set(order[:complete])
    assert read.isdisjoint(order[complete:])


def test_rank_outside_the_data_parallel_group_is_rejected():
    plan = plan_for(16, 2, 1)
    for rank in (-1, 2):
        with pytest.raises(ValueError):
            DataParallelBatchSampler(64, plan, rank=rank)


# --------------------------------------------------------------------------- through Lightning's fit loop


@pytest.fixture(scope="module")
def fit_batches(tmp_path_factory):
    """Fit two epochs of a tiny run and record the inputs of every training batch, per epoch."""
    import lightning.pytorch as pl

    from parallelkit.data.synthetic import SyntheticDataModule
    from parallelkit.models.mlp import MLP
    from parallelkit.models.module import TrainModule
    from parallelkit.strategies import SingleStrategy

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dm = SyntheticDataModule(num_samples=24, in_features=3, out_features=2, global_batch_size=6, seed=11)
    dm.configure(data_parallel_size=1, accumulate=1)
    seen: dict[int, list[torch.Tensor]] = {}

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.setdefault(trainer.current_epoch, []).append(batch[0].detach().clone())

    trainer = pl.Trainer(
        strategy=SingleStrategy(),
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[Record()],
        default_root_dir=tmp_path_factory.mktemp("fit"),
    )
    module = TrainModule(MLP(in_features=3, out_features=2, hidden=[4]), functools.partial(torch.optim.SGD, lr=0.0))
    try:
        trainer.fit(module, datamodule=dm)
    finally:
        torch.set_num_threads(threads)
    return dm, seen


def expected_epoch_inputs(dm, epoch: int) -> list[torch.Tensor]:
    order = torch.randperm(len(dm.train_set), generator=torch.Generator().manual_seed(dm.seed + epoch)).tolist()
    g = dm.plan.global_batch_size
    inputs = dm.train_set.tensors[0]
    return [inputs[order[s * g : (s + 1) * g]] for s in range(len(dm.train_set) // g)]


def test_fit_loop_reads_the_seeded_order_in_epoch_0(fit_batches):
    dm, seen = fit_batches
    expected = expected_epoch_inputs(dm, 0)
    assert len(seen[0]) == len(expected)
    for got, want in zip(seen[0], expected):
        assert torch.equal(got, want)


def test_fit_loop_reshuffles_in_epoch_1(fit_batches):
    """Lightning calls set_epoch on ``loader.batch_sampler.sampler`` only: epoch 1 must use seed + 1."""
    dm, seen = fit_batches
    expected = expected_epoch_inputs(dm, 1)
    assert len(seen[1]) == len(expected)
    for got, want in zip(seen[1], expected):
        assert torch.equal(got, want)
