"""Dynamic loss scaling on 2 real gloo ranks: an overflow on one rank makes every rank skip the step.

Each rank trains its own rows of the same model with an averaged gradient (a hand-made all-reduce, like
DDP). At chosen steps rank 1 alone gets an inf in one gradient. Both ranks must skip exactly those steps
(parameters untouched), and the scale must follow Paddle's rule: halve after ``decr_every_n_nan_or_inf``
overflows in a row, double after ``incr_every_n_steps`` good steps in a row. The negative control checks
the overflow on each rank alone: then the ranks disagree and their parameters drift apart.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallelkit.distributed.comm_stats import CommStats
from parallelkit.distributed.loss_scaling import DynamicLossScaler
from parallelkit.errors import ConfigError
from tests.distributed.harness import run_ranks

STEPS = 10
INF_STEPS = {2, 3, 7}  # rank 1 overflows here


def _train(rank: int, world_size: int, shared_check: bool) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    own_groups = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    stats = CommStats()
    scaler = DynamicLossScaler(
        init_loss_scaling=1024.0, incr_every_n_steps=3, decr_every_n_nan_or_inf=2,
        group=None if shared_check else own_groups[rank], comm_stats=stats,
    )
    x = torch.randn(STEPS, 8, 4, generator=torch.Generator().manual_seed(1))
    rows = slice(rank * 4, rank * 4 + 4)
    record = {"scale": [], "skipped": [], "changed": []}
    for step in range(STEPS):
        optimizer.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        (model(x[step, rows]).pow(2).mean() * scaler.scale).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)
        if rank == 1 and step in INF_STEPS:
            model.weight.grad[0, 0] = float("inf")
        record["scale"].append(scaler.scale)
        finite = scaler.unscale_and_check(model.parameters())
        if finite:
            optimizer.step()
        scaler.update()
        record["skipped"].append(not finite)
        record["changed"].append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
    record["weight"] = model.weight.detach().clone()
    record["check_bytes"] = stats.bytes("amp_found_inf")
    return record


def test_overflow_on_one_rank_skips_the_step_everywhere_and_drives_the_scale(tmp_path):
    results = run_ranks(_train, 2, tmp_path, True)
    for rank, r in enumerate(results):
        assert r["skipped"] == [s in INF_STEPS for s in range(STEPS)], rank
        assert r["changed"] == [s not in INF_STEPS for s in range(STEPS)], rank  # skipped steps leave parameters alone
        # Steps 0,1 good; 2,3 overflow → halve once (after 2 in a row); 4,5,6 good → double; 7 overflows (one only: no
        # halving yet); 8,9 good. The scale is the one used by each step's backward.
        assert r["scale"] == [1024, 1024, 1024, 1024, 512, 512, 512, 1024, 1024, 1024], rank
        assert r["check_bytes"] > 0  # the overflow flag really was all-reduced
    torch.testing.assert_close(results[0]["weight"], results[1]["weight"], rtol=0, atol=0)


def test_overflow_checked_per_rank_lets_the_ranks_diverge(tmp_path):
    """Negative control: each rank checks only its own gradients, so rank 0 steps where rank 1 skips."""
    results = run_ranks(_train, 2, tmp_path, False)
    assert results[0]["skipped"] == [False] * STEPS
    assert results[1]["skipped"] == [s in INF_STEPS for s in range(STEPS)]
    assert not torch.equal(results[0]["weight"], results[1]["weight"])


@pytest.mark.parametrize("knob,value", [("decr_ratio", 1.5), ("incr_ratio", 0.5), ("incr_every_n_steps", 0), ("init_loss_scaling", 0.5)])
def test_bad_scaling_knobs_are_errors(knob, value):
    with pytest.raises(ConfigError, match=knob):
        DynamicLossScaler(**{knob: value})
