"""ZeRO stages 1-2 and the all-to-all reduce-scatter on real gloo ranks, against one process in the same test.

Each rank trains a copy of a small MLP on its own rows of every global batch; the reference trains the same
initial model on the whole batch with the same AdamW in the test process. After every step the ranks'
parameters must equal the reference's, the optimizer state each rank keeps must be 1/N of the reference's
(and, gathered back into the per-parameter layout, equal to it), and the counted traffic must be a
reduce-scatter plus an all-gather of the parameters. A variant that skips the all-gather is the
negative control.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallelkit.distributed.collectives import reduce_scatter
from parallelkit.callbacks.run_summary import os_bytes_written
from parallelkit.distributed.comm_stats import CommStats
from parallelkit.distributed.zero_optimizer import ZeroOptimizer
from tests.distributed.harness import run_ranks

STEPS = 3
BATCH, FEATURES = 8, 6


def _model() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randn(STEPS, BATCH, FEATURES, generator=g), torch.randn(STEPS, BATCH, 3, generator=g)


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _train_zero(rank: int, world_size: int, stage: int, skip_all_gather: bool, bucket_mb: float) -> dict:
    model = _model()
    names = {p: n for n, p in model.named_parameters()}
    optimizer = _optimizer(model.parameters())
    stats = CommStats()
    zero = ZeroOptimizer(optimizer, stage=stage, shard_group=dist.group.WORLD, param_names=names, bucket_mb=bucket_mb, comm_stats=stats)
    x, y = _data()
    rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)  # this rank's rows only
    params, sent, written = [], [], []
    for step in range(STEPS):
        before, before_written = stats.bytes(), os_bytes_written()
        optimizer.zero_grad(set_to_none=True)
        # Mean over this rank's rows; the ranks' average is the mean over the global batch.
        torch.nn.functional.mse_loss(model(x[step, rows]), y[step, rows]).backward()
        zero.reduce_gradients()
        optimizer.step()
        if not skip_all_gather:
            zero.all_gather_params()
        sent.append(stats.bytes() - before)
        written.append(os_bytes_written() - before_written)
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"params": params, "sent": sent, "written": written, "state_bytes": zero.state_bytes(), "full_state": zero.full_state_dict()}


def _reference() -> tuple[list[dict], torch.optim.Optimizer, torch.nn.Module]:
    model = _model()
    optimizer = _optimizer(model.parameters())
    x, y = _data()
    params = []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x[step]), y[step]).backward()
        optimizer.step()
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return params, optimizer, model


@pytest.mark.parametrize("stage,bucket_mb", [(1, 25.0), (2, 25.0), (2, 0.0002)], ids=["stage1", "stage2", "stage2-small-buckets"])
def test_zero_optimizer_matches_one_process(stage, bucket_mb, tmp_path):
    world = 2
    results = run_ranks(_train_zero, world, tmp_path, stage, False, bucket_mb)
    reference, ref_optimizer, ref_model = _reference()
    numel = sum(p.numel() for p in ref_model.parameters())
    for rank, result in enumerate(results):
        for step in range(STEPS):
            for name, value in reference[step].items():
                torch.testing.assert_close(result["params"][step][name], value, rtol=1e-6, atol=1e-7, msg=f"rank {rank} step {step} {name}")
        # Traffic: what was counted is what the process wrote, byte for byte; that is reduce-scatter (n−1)/n of
        # the padded buckets + all-gather (n−1) shards = 2(n−1)/n × 4 bytes × Ψ, plus gloo's message headers.
        assert result["sent"] == result["written"], (result["sent"], result["written"])
        padded_slack = 4 * world * 8  # at most n−1 padding elements per bucket, few buckets
        headers = 48 * 3 * 3 * (world - 1) * 16  # 3 headers per message; 3(n−1) messages per bucket; ≤ 16 buckets
        theory = 2 * (world - 1) / world * 4 * numel
        assert all(theory - padded_slack <= w <= theory + padded_slack + headers for w in result["written"]), result["written"]
        # Each rank keeps 1/n of AdamW's two moments (plus one step counter per bucket).
        adam = 2 * 4 * numel
        assert adam / world <= result["state_bytes"]["optimizer"] <= adam / world + 4 * 64
        # Gathered back, the state is the one-process optimizer's, parameter by parameter.
        ref_state = ref_optimizer.state_dict()["state"]
        for index, (name, _) in enumerate(ref_model.named_parameters()):
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(result["full_state"]["state"][name][key], ref_state[index][key], rtol=1e-6, atol=1e-8)


def test_zero_without_all_gather_diverges(tmp_path):
    """Negative control: if updated slices are not gathered, each rank keeps stale halves and the check fails."""
    results = run_ranks(_train_zero, 2, tmp_path, 1, True, 25.0)
    reference, _, _ = _reference()
    last = reference[-1]
    for result in results:
        diff = max((result["params"][-1][n] - v).abs().max().item() for n, v in last.items())
        assert diff > 1e-3


def _reduce_scatter(rank: int, world_size: int) -> dict:
    inputs = [torch.arange(12, dtype=torch.float32) * (r + 1) + r for r in range(world_size)]  # rank r's input
    out = torch.empty(12 // world_size)
    stats = CommStats()
    full = inputs[rank].clone()
    dist.barrier()
    before = os_bytes_written()
    reduce_scatter(out, full, dist.group.WORLD, stats)
    written = os_bytes_written() - before
    expected = torch.stack(inputs).sum(0).view(world_size, -1)[rank]
    return {"out": out, "expected": expected, "sent": stats.bytes(), "written": written}


@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_reduce_scatter_sums_and_sends_n_minus_1_over_n(world, tmp_path):
    for rank, result in enumerate(run_ranks(_reduce_scatter, world, tmp_path)):
        torch.testing.assert_close(result["out"], result["expected"], rtol=0, atol=0)
        assert result["sent"] == result["written"], rank
        # one chunk of 12/world floats to each peer, one message each way per peer (gloo: 3 headers of 48 bytes)
        assert result["written"] - (world - 1) * 3 * 48 == (world - 1) * 12 // world * 4, rank
