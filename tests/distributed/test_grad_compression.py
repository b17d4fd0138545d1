"""torch's PowerSGD and parallelkit's fp16 hook behind ``build_compression_hook``, on 2 real gloo ranks.

PowerSGD's traffic is counted by standing in for ``torch.distributed`` inside torch's modules; the count
must equal what each rank's process wrote during the step (``/proc/self/io`` ``wchar``), and carry what the
algorithm sends, worked out here from the layer shapes: before ``start_powerSGD_iter`` the whole bucket;
after it, P (n×r) and Q (m×r) of every compressed matrix plus the uncompressed tensors (three all-reduces),
each all-reduce with gloo's fixed message headers on top.
The result must approximate the true mean gradient (rank 1 of a small MLP: loosely), and fp16 must halve
the bytes of a dense all-reduce. The negative control: the same count for an uncompressed layout differs.
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations at run time.

import pytest
import torch
import torch.distributed as dist

from parallelkit.callbacks.run_summary import os_bytes_written
from parallelkit.distributed.comm_hooks import GRAD_ALLREDUCE, POWERSGD_ALLREDUCE, build_compression_hook
from parallelkit.distributed.comm_stats import CommStats
from parallelkit.distributed.data_parallel import apply_ddp
from parallelkit.models.mlp import MLP

from .harness import run_ranks

WORLD_SIZE = 2
IN_FEATURES, OUT_FEATURES, HIDDEN = 16, 8, [32, 32]
LOCAL_BATCH = 8
STEPS = 4
START_ITER = 2
RANK = 1


def _train(rank, world_size):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS, world_size * LOCAL_BATCH, IN_FEATURES, generator=gen)
    y = torch.randn(STEPS, world_size * LOCAL_BATCH, OUT_FEATURES, generator=gen)
    rows = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    out = {}
    for method in ("powersgd", "fp16"):
        torch.manual_seed(1000 + rank)
        model = MLP(in_features=IN_FEATURES, out_features=OUT_FEATURES, hidden=HIDDEN)
        stats = CommStats()
        options = dict(matrix_approximation_rank=RANK, start_powerSGD_iter=START_ITER) if method == "powersgd" else {}
        hook, state = build_compression_hook(method, dist.group.WORLD, stats, **options)
        ddp = apply_ddp(model, process_group=dist.group.WORLD, comm_hook=hook, comm_state=state)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        rec = {"bytes": [], "written": [], "grads": [], "local": [], "shapes": {n: tuple(p.shape) for n, p in model.named_parameters()}}
        for step in range(STEPS):
            before = stats.bytes(POWERSGD_ALLREDUCE) + stats.bytes(GRAD_ALLREDUCE)
            optimizer.zero_grad(set_to_none=True)
            written = os_bytes_written()
            MLP.loss(ddp(x[step, rows]), y[step, rows]).backward()
            rec["written"].append(os_bytes_written() - written)
            rec["bytes"].append(stats.bytes(POWERSGD_ALLREDUCE) + stats.bytes(GRAD_ALLREDUCE) - before)
            rec["grads"].append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
            # the exact mean gradient at the same weights, for comparison
            exact = torch.cat([g.reshape(-1) for g in torch.autograd.grad(MLP.loss(model(x[step, rows]), y[step, rows]), list(model.parameters()))])
            all_exact = [torch.empty_like(exact) for _ in range(world_size)]
            dist.all_gather(all_exact, exact)
            rec["local"].append(torch.stack(all_exact).mean(0))
            optimizer.step()
        rec["dense_bytes"] = state.dense_bytes
        out[method] = rec
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    per_rank = run_ranks(_train, WORLD_SIZE, tmp_path_factory.mktemp("compression"))
    return {method: [r[method] for r in per_rank] for method in ("powersgd", "fp16")}


def _powersgd_bytes(shapes, compress=True):
    """Bytes one rank sends per compressed step (2 ranks: a ring all-reduce sends its payload once)."""
    floats = 0
    for shape in shapes.values():
        if len(shape) == 2 and compress and (shape[0] + shape[1]) * RANK * 2 < shape[0] * shape[1]:
            floats += (shape[0] + shape[1]) * RANK  # P and Q
        else:
            floats += int(torch.Size(shape).numel())
    return 4 * floats


# gloo, 2 ranks: a ring all-reduce is 4 messages each way, 3 headers of 48 bytes per message.
HEADERS = 12 * 48


def _assert_counted_is_written(rec):
    """Exact, but for DDP's own one-time broadcast of its rebuilt bucket order in step 1 (not parallelkit's)."""
    bytes_, written = rec["bytes"], rec["written"]
    assert bytes_[:1] + bytes_[2:] == written[:1] + written[2:], (bytes_, written)
    assert 0 < written[1] - bytes_[1] < 512, (bytes_, written)


def test_powersgd_traffic_is_counted_exactly(runs):
    for rec in runs["powersgd"]:
        _assert_counted_is_written(rec)
        shapes = rec["shapes"]
        full = 4 * sum(int(torch.Size(s).numel()) for s in shapes.values())
        assert rec["bytes"][:START_ITER] == [full + HEADERS] * START_ITER  # plain all-reduce first
        # then three all-reduces: the uncompressed tensors, the Ps, the Qs
        assert rec["bytes"][START_ITER:] == [_powersgd_bytes(shapes) + 3 * HEADERS] * (STEPS - START_ITER)
        assert _powersgd_bytes(shapes) * 5 < full  # a real cut of the payload (on this 7 KiB model the headers weigh)
        assert rec["dense_bytes"] == (full + HEADERS) * STEPS
        # negative control: the uncompressed layout's count is not what was measured
        assert rec["bytes"][-1] != _powersgd_bytes(shapes, compress=False) + 3 * HEADERS


def test_powersgd_result_approximates_the_mean_gradient(runs):
    for rec in runs["powersgd"]:
        for step in range(STEPS):
            exact, got = rec["local"][step], rec["grads"][step]
            if step < START_ITER:
                torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-6)
            else:  # rank-1 approximation: correlated with the truth, not equal to it
                cosine = torch.nn.functional.cosine_similarity(got, exact, dim=0)
                assert 0.3 < cosine < 0.9999, cosine
    assert torch.equal(runs["powersgd"][0]["grads"][-1], runs["powersgd"][1]["grads"][-1])  # replicas apply the same update


def test_fp16_halves_the_bytes(runs):
    for rec in runs["fp16"]:
        _assert_counted_is_written(rec)
        full = 4 * sum(int(torch.Size(s).numel()) for s in rec["shapes"].values())
        assert rec["bytes"] == [full // 2 + HEADERS] * STEPS  # half the payload, the same headers
        assert rec["dense_bytes"] == (full + HEADERS) * STEPS
        for step in range(STEPS):
            torch.testing.assert_close(rec["grads"][step], rec["local"][step], rtol=2e-3, atol=1e-5)
