"""ZeRO stage 2 on gloo: a bucket's gradient reduce-scatter runs while the rest of backward computes.

Two ranks, two buckets (one per linear layer). Backward completes the second layer's bucket first; then a block
computes for a fixed time (real matrix products) before the first layer's gradients arrive. Rank 1 reaches the
second layer's gradients a little later than rank 0, so rank 0's reduce-scatter of that bucket stays in flight
until rank 1 joins it. Rank 0 records when the collective completed (gloo's work future) and when the block
computed: with the overlap the collective completes while the block computes; without (the negative control)
rank 0 waits for it before the block starts. Parameters after the step equal one process's either way.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.distributed.overlap_trace import burn, traced
from tests.distributed.harness import run_ranks

WIDTH, ROWS = 64, 8
COMPUTE_S, SKEW_S = 0.04, 0.01


class _Compute(torch.autograd.Function):
    """Identity whose backward computes for a fixed time, logging when."""

    @staticmethod
    def forward(ctx, x, seconds, log):
        ctx.seconds, ctx.log = seconds, log
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        start = time.perf_counter()
        burn(ctx.seconds)
        if ctx.log is not None:
            ctx.log.append((start, time.perf_counter()))
        return grad, None, None


class Net(nn.Module):
    def __init__(self, skew_s: float, log: list | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.skew_s, self.log = skew_s, log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _Compute.apply(self.first(x), COMPUTE_S, self.log)  # between the two buckets' gradients
        return _Compute.apply(self.second(x), self.skew_s, None)  # rank 1 reaches the second bucket later


def _data(rank: int) -> torch.Tensor:
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(20 + rank))


def _step(rank: int, world: int, overlap: bool) -> dict:
    from parallelkit.distributed.zero_optimizer import ZeroOptimizer

    log: list = []
    model = Net(SKEW_S if rank == 1 else 0.0, log)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    layer_mb = sum(p.numel() * p.element_size() for p in model.first.parameters()) / 2**20
    zero = ZeroOptimizer(optimizer, stage=2, shard_group=dist.group.WORLD, bucket_mb=layer_mb, overlap=overlap)
    assert len(zero._all) == 2  # one bucket per layer

    calls: list = []
    all_to_all = dist.all_to_all_single
    dist.all_to_all_single = traced(all_to_all, calls)
    try:
        dist.barrier()
        model(_data(rank)).square().mean().backward()
        zero.reduce_gradients()
        optimizer.step()
        zero.all_gather_params()
    finally:
        dist.all_to_all_single = all_to_all
    return {"calls": calls, "compute": log[0], "params": [p.detach().clone() for p in model.parameters()]}


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero_overlap")
    return {overlap: run_ranks(_step, 2, tmp, overlap) for overlap in (True, False)}


def _second_bucket_in_flight_while_computing(result: dict) -> bool:
    second = result["calls"][0]  # the first reduce-scatter of backward: the second layer's bucket
    start, end = result["compute"]
    return second["issued"] < start < second["done"] < end


def test_reduce_scatter_runs_while_backward_computes(steps):
    assert _second_bucket_in_flight_while_computing(steps[True][0]), steps[True][0]


def test_negative_control_without_overlap_backward_waits_for_it(steps):
    assert not _second_bucket_in_flight_while_computing(steps[False][0]), steps[False][0]


def test_parameters_match_one_process(steps):
    model = Net(0.0, None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    torch.cat([model(_data(r)) for r in range(2)]).square().mean().backward()
    optimizer.step()
    for overlap in (True, False):
        for result in steps[overlap]:
            for got, want in zip(result["params"], model.parameters()):
                torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
