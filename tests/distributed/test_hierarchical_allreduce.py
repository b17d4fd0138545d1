"""Hierarchical all-reduce on 4 real gloo ranks in 2 simulated nodes of 2.

Every rank trains on its own quarter of each global batch. The hierarchical hook must give the same
averaged gradients as a flat all-reduce (and as one process on the whole batch) within fp32 round-off
(the summation order differs), identical on every rank, while only the two leaders send across groups;
what is counted per rank is what its process wrote (``/proc/self/io`` ``wchar``).
Negative control: a hook that skips the broadcast back into the node leaves non-leaders with partial
sums, which the comparison catches.
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations at run time.

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from parallelkit.callbacks.run_summary import os_bytes_written
from parallelkit.distributed.comm_hooks import GRAD_ALLREDUCE
from parallelkit.distributed.comm_stats import CommStats
from parallelkit.distributed.data_parallel import apply_ddp
from parallelkit.distributed.hierarchical_allreduce import (
    INTER, INTRA, HierarchicalState, build_hierarchical_state, hierarchical_allreduce_hook,
)
from parallelkit.distributed.comm_hooks import counts_own_traffic
from parallelkit.models.mlp import MLP

from .harness import run_ranks

WORLD_SIZE = 4
LOCAL_SIZE = 2
IN_FEATURES, OUT_FEATURES, HIDDEN = 16, 8, [32, 32]
LOCAL_BATCH = 4
STEPS = 3
LR = 0.05
INIT_SEED, DATA_SEED = 1000, 7
RTOL, ATOL = 1e-5, 1e-6


@counts_own_traffic
def _no_broadcast_hook(state: HierarchicalState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Broken on purpose: reduces into the leader and across leaders, but never broadcasts back."""
    buffer = bucket.buffer()
    dist.reduce(buffer, dst=state.leader, group=state.local_group)
    if state.leader_group is not None:
        dist.all_reduce(buffer, group=state.leader_group)
    buffer.div_(state.world_size)
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


VARIANTS = {"flat": None, "hierarchical": hierarchical_allreduce_hook, "no_broadcast": _no_broadcast_hook}


def _global_batches():
    gen = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(STEPS, WORLD_SIZE * LOCAL_BATCH, IN_FEATURES, generator=gen)
    y = torch.randn(STEPS, WORLD_SIZE * LOCAL_BATCH, OUT_FEATURES, generator=gen)
    return x, y


def _model(seed):
    torch.manual_seed(seed)
    return MLP(in_features=IN_FEATURES, out_features=OUT_FEATURES, hidden=HIDDEN)


def _train(rank, world_size, local_size):
    x, y = _global_batches()
    rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    out = {}
    for name, hook in VARIANTS.items():
        model = _model(INIT_SEED + rank)
        stats = CommStats()
        if hook is None:
            ddp = apply_ddp(model, process_group=dist.group.WORLD, comm_stats=stats)
        else:
            state = build_hierarchical_state(local_size, dist.group.WORLD, stats)
            ddp = apply_ddp(model, process_group=dist.group.WORLD, comm_hook=hook, comm_state=state)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)
        rec = {"init": {n: p.detach().clone() for n, p in model.named_parameters()}, "grads": [], "params": [],
               "intra": [], "inter": [], "flat": [], "written": []}
        for step in range(STEPS):
            before = (stats.bytes(INTRA), stats.bytes(INTER), stats.bytes(GRAD_ALLREDUCE))
            optimizer.zero_grad(set_to_none=True)
            written = os_bytes_written()
            MLP.loss(ddp(x[step, rows]), y[step, rows]).backward()
            rec["written"].append(os_bytes_written() - written)
            rec["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
            optimizer.step()
            rec["params"].append({n: p.detach().clone() for n, p in model.named_parameters()})
            rec["intra"].append(stats.bytes(INTRA) - before[0])
            rec["inter"].append(stats.bytes(INTER) - before[1])
            rec["flat"].append(stats.bytes(GRAD_ALLREDUCE) - before[2])
        out[name] = rec
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    per_rank = run_ranks(_train, WORLD_SIZE, tmp_path_factory.mktemp("hier"), LOCAL_SIZE)
    return {name: [per_rank[r][name] for r in range(WORLD_SIZE)] for name in VARIANTS}


def _reference_grads(init):
    x, y = _global_batches()
    model = _model(0)
    model.load_state_dict(init)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for step in range(STEPS):
        optimizer.zero_grad()
        MLP.loss(model(x[step]), y[step]).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
    return grads


def _assert_equal_to(results, expected, steps=STEPS):
    for rank, rec in enumerate(results):
        for step in range(steps):
            assert_close(rec["grads"][step], expected[step], rtol=RTOL, atol=ATOL, msg=lambda m: f"rank {rank} step {step}: {m}")


def test_hierarchical_equals_flat_allreduce_and_single_process(runs):
    hier, flat = runs["hierarchical"], runs["flat"]
    _assert_equal_to(hier, flat[0]["grads"])
    _assert_equal_to(hier, _reference_grads(hier[0]["init"]))
    for rank in range(1, WORLD_SIZE):  # the leader's division is broadcast: identical bits everywhere
        assert all(torch.equal(hier[rank]["params"][-1][n], hier[0]["params"][-1][n]) for n in hier[0]["params"][-1])


def test_each_rank_trains_on_different_data():
    x, _ = _global_batches()
    quarters = x[0].split(LOCAL_BATCH)
    assert all((quarters[0] - q).abs().max() > 0.1 for q in quarters[1:])


def _assert_counted_is_written(rank, counted, written):
    """Exact, but for DDP's own one-time broadcast of its rebuilt bucket order in step 1 (not parallelkit's)."""
    assert counted[:1] + counted[2:] == written[:1] + written[2:], (rank, counted, written)
    assert 0 <= written[1] - counted[1] < 512, (rank, counted, written)


def test_only_leaders_send_across_groups(runs):
    hier, flat = runs["hierarchical"], runs["flat"]
    bucket = sum(p.numel() * 4 for p in hier[0]["init"].values())
    headers = 48 * 48  # gloo's 48-byte message headers: a few dozen per step at most (36 in a 4-rank ring all-reduce)
    for rank, rec in enumerate(hier):
        _assert_counted_is_written(rank, [a + b for a, b in zip(rec["intra"], rec["inter"])], rec["written"])
        leader = rank % LOCAL_SIZE == 0
        # 2 leaders: a ring all-reduce of S over 2 ranks sends S; non-leaders send nothing across groups
        assert all((bucket <= b <= bucket + headers) if leader else b == 0 for b in rec["inter"]), (rank, rec["inter"])
        # Inside the node (gloo, 2 ranks): the reduce is a ring reduce-scatter (half the bucket each way) and the
        # non-leader's half going to the leader; the broadcast back is the leader's whole bucket once.
        intra = 1.5 * bucket if leader else bucket
        assert all(intra <= b <= intra + headers for b in rec["intra"]), (rank, rec["intra"])
        assert rec["flat"] == [0] * STEPS
    # the flat ring all-reduce over 4 ranks sends 2·3/4·S from every rank, half of its links across groups
    for rank, rec in enumerate(flat):
        _assert_counted_is_written(rank, rec["flat"], rec["written"])
        assert all(2 * 3 * bucket // 4 <= b <= 2 * 3 * bucket // 4 + headers for b in rec["flat"]), (rank, rec["flat"], bucket)
    inter_total = sum(sum(rec["inter"]) for rec in hier)
    assert 2 * bucket * STEPS <= inter_total <= 2 * (bucket + headers) * STEPS


def test_negative_control_missing_broadcast_is_caught(runs):
    broken = runs["no_broadcast"]
    # At the first step the leaders are right (from then on every replica has drifted) ...
    _assert_equal_to([broken[0], broken[2]], runs["flat"][0]["grads"], steps=1)
    for rank in (1, 3):  # ... the others hold their own gradient, never averaged
        with pytest.raises(AssertionError):
            _assert_equal_to([broken[rank]], runs["flat"][0]["grads"], steps=1)
