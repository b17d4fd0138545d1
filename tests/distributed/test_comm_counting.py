"""The counting layer at the collective boundary (``comm_counting``) sees collectives that no parallelkit code
issues: torch DDP's C++ reducer (its own all-reduce, no parallelkit hook), FSDP2's all-gathers and
reduce-scatters (no custom collectives), functional collectives and DTensor's implicit redistribution, and a
collective on inference tensors — each counted as what the rank's process wrote (``/proc/self/io``), byte
for byte, and as the known formula (``wire_bytes``). The training results match one process on the whole
batch, so the collectives counted are the ones that did the work.

Negative controls: a collective outside any ``counting`` block, or inside ``uncounted()``, or one the
innermost claim does not take (``ops``), is not counted, though it was written.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from parallelkit.callbacks.run_summary import os_bytes_written
from parallelkit.distributed.comm_counting import counting, uncounted
from parallelkit.distributed.comm_stats import CommStats, collective_bytes

from .harness import run_ranks

WORLD = 2
BATCH, IN, OUT = 8, 16, 4  # global batch; each rank trains on its BATCH / WORLD rows


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 32), nn.Tanh(), nn.Linear(32, OUT))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, OUT, generator=gen)


def _measured(stats: CommStats, run) -> tuple[int, int, int]:
    """(bytes counted, collectives counted, bytes written) by this rank while ``run`` runs, between barriers."""
    dist.barrier()
    before = stats.bytes(), stats.calls(), os_bytes_written()
    run()
    after = stats.bytes(), stats.calls(), os_bytes_written()
    dist.barrier()
    return after[0] - before[0], after[1] - before[1], after[2] - before[2]


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone() for p in model.parameters()]


def _third_party(rank: int, world: int) -> dict:
    warnings.simplefilter("ignore")  # a warning printed inside a window is a write that is no traffic
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    x, y = _batch()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)  # different data on every rank
    out: dict = {}

    # torch DDP with its own C++ all-reduce: counted in backward; its start-up broadcasts are outside the block.
    stats = CommStats()
    ddp = nn.parallel.DistributedDataParallel(_model())
    bucket_bytes = sum(p.numel() * p.element_size() for p in ddp.parameters())
    loss = nn.functional.mse_loss(ddp(x[rows]), y[rows])
    out["ddp"] = _measured(stats, lambda: _in(stats, "ddp", loss.backward))
    out["ddp_formula"] = collective_bytes(bucket_bytes, "all_reduce", None, element_size=4)
    out["ddp_kinds"] = set(stats.totals()["by_kind"])
    out["ddp_grads"] = _grads(ddp.module)

    # FSDP2 with torch's own collectives (gloo reduce-scatter: an all-reduce and a slice), one step.
    mesh = init_device_mesh("cpu", (world,))
    sharded = _model()
    for layer in (sharded[0], sharded[2], sharded):
        fully_shard(layer, mesh=mesh)
    stats = CommStats()

    def fsdp_step() -> None:
        with counting(stats, "fsdp.{op}"):
            nn.functional.mse_loss(sharded(x[rows]), y[rows]).backward()

    out["fsdp"] = _measured(stats, fsdp_step)
    out["fsdp_kinds"] = set(stats.totals()["by_kind"])
    out["fsdp_grads"] = _grads(sharded)

    # A functional collective, DTensor's implicit all-reduce (a sum over a sharded dimension), inference tensors.
    stats = CommStats()
    local = torch.arange(6.0) + 10 * rank
    summed: list = []
    with counting(stats, "warm-up"):  # first calls print deprecation notes: not inside a measured window
        funcol.all_reduce(local, "sum", dist.group.WORLD).wait()
    stats.reset()
    out["functional"] = _measured(stats, lambda: _in(stats, "f", lambda: summed.append(funcol.all_reduce(local, "sum", dist.group.WORLD).wait())))
    out["functional_sum"] = summed[0]
    out["functional_formula"] = collective_bytes(local, "all_reduce", None)
    sharded_rows = DTensor.from_local(local.reshape(1, 6), mesh, [Shard(0)])
    total: list = []
    out["dtensor"] = _measured(stats, lambda: _in(stats, "d", lambda: total.append(sharded_rows.sum().full_tensor())))
    out["dtensor_sum"] = total[0]

    def inference() -> None:
        with torch.inference_mode():
            flag = torch.ones(1)
            with counting(stats, "inference"):
                dist.all_reduce(flag)

    out["inference"] = _measured(stats, inference)

    # Negative controls: outside any block, hidden by uncounted(), not taken by the innermost claim.
    stats = CommStats()
    probe = torch.ones(1000)
    out["outside"] = _measured(stats, lambda: dist.all_reduce(probe))
    out["hidden"] = _measured(stats, lambda: _in(stats, "x", lambda: _hidden(probe)))
    out["not_claimed"] = _measured(stats, lambda: _in_ops(stats, lambda: dist.all_reduce(probe)))
    with counting(stats, "outer"), counting(stats, "inner"):
        dist.all_reduce(probe)
    out["nested_kinds"] = set(stats.totals()["by_kind"])
    return out


def _in(stats: CommStats, kind: str, run) -> None:
    with counting(stats, kind):
        run()


def _hidden(probe: torch.Tensor) -> None:
    with uncounted():
        dist.all_reduce(probe)


def _in_ops(stats: CommStats, run) -> None:
    with counting(stats, "p2p", ops=("send", "recv")):  # an all-reduce is not its to count
        run()


def _reference() -> dict:
    x, y = _batch()
    model = _model()
    nn.functional.mse_loss(model(x), y).backward()  # mean over the global batch = mean of the shards' means
    return {"grads": [p.grad for p in model.parameters()]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_third_party, WORLD, tmp_path_factory.mktemp("counting"))


@pytest.fixture(scope="module")
def reference():
    return _reference()


def test_ddp_reducer_counted_as_written_and_as_the_formula(results, reference):
    for rank, r in enumerate(results):
        counted, calls, written = r["ddp"]
        assert counted == written == r["ddp_formula"] > 0, (rank, r["ddp"], r["ddp_formula"])
        assert calls == 1 and r["ddp_kinds"] == {"ddp"}  # one bucket, one all-reduce
        for got, want in zip(r["ddp_grads"], reference["grads"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fsdp2_own_collectives_counted_as_written(results, reference):
    for rank, r in enumerate(results):
        counted, _, written = r["fsdp"]
        assert counted == written > 0, (rank, r["fsdp"])
        assert {"fsdp.all_gather", "fsdp.reduce_scatter"} <= r["fsdp_kinds"], r["fsdp_kinds"]
        for got, want in zip(r["fsdp_grads"], reference["grads"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_functional_dtensor_and_inference_collectives_counted_as_written(results):
    expected = sum(torch.arange(6.0) + 10 * rank for rank in range(WORLD))  # the one-process sum
    for rank, r in enumerate(results):
        counted, calls, written = r["functional"]
        assert counted == written == r["functional_formula"] and calls == 1, (rank, r["functional"])
        torch.testing.assert_close(r["functional_sum"], expected)
        counted, calls, written = r["dtensor"]
        assert counted == written > 0 and calls == 1, (rank, r["dtensor"])
        torch.testing.assert_close(r["dtensor_sum"], expected.sum())
        counted, calls, written = r["inference"]
        assert counted == written > 0 and calls == 1, (rank, r["inference"])


def test_negative_control_unclaimed_collectives_are_written_but_not_counted(results):
    for rank, r in enumerate(results):
        for case in ("outside", "hidden", "not_claimed"):
            counted, calls, written = r[case]
            assert counted == calls == 0 and written > 0, (rank, case, r[case])
        assert r["nested_kinds"] == {"inner"}  # the innermost claim counts, once
