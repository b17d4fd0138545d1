"""use_foreach_for_dtensors: which parameter groups step multi-tensor, and that the step is the same arithmetic.

On 2 gloo ranks: an AdamW over FSDP2-sharded parameters (all DTensors of one mesh) is switched to ``foreach``; a
group that set ``foreach`` itself, a group mixing DTensors and plain tensors, and a group of DTensors on two
different meshes are left as they are. Five steps with ``foreach`` give bit-identical parameters to five steps
with the per-tensor loop, and both equal the single-process reference (each rank feeds different data).
"""

from __future__ import annotations

import torch
from torch import nn

from tests.distributed.harness import run_ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _data(rank: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(10 + rank))


def _train(sharded: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    for _ in range(5):
        optimizer.zero_grad()
        sharded(_data(rank)).square().mean().backward()
        optimizer.step()


def _groups_and_steps(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    from parallelkit.distributed.dtensor_step import use_foreach_for_dtensors

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for foreach in (True, False):
        model = _model()
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
        changed = use_foreach_for_dtensors([optimizer]) if foreach else 0
        results[foreach] = {"changed": changed, "flag": optimizer.param_groups[0]["foreach"]}
        _train(model, optimizer, rank)
        results[foreach]["params"] = [p.full_tensor() for p in model.parameters()]

    # groups left alone
    other_mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("a", "b"))
    d1 = nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Replicate()]))
    d2 = nn.Parameter(distribute_tensor(torch.ones(4), other_mesh, [Replicate(), Replicate()]))
    plain = nn.Parameter(torch.ones(4))
    explicit = torch.optim.AdamW([d1], foreach=False)
    mixed = torch.optim.AdamW([d1, plain])
    two_meshes = torch.optim.AdamW([d1, d2])
    results["untouched"] = use_foreach_for_dtensors([explicit, mixed, two_meshes])
    results["flags"] = [o.param_groups[0]["foreach"] for o in (explicit, mixed, two_meshes)]
    return results


def test_foreach_for_one_mesh_of_dtensors_only_and_the_same_step(tmp_path):
    results = run_ranks(_groups_and_steps, 2, tmp_path)
    reference = _model()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    for _ in range(5):
        optimizer.zero_grad()
        torch.cat([reference(_data(r)) for r in range(2)]).square().mean().backward()
        optimizer.step()
    for r in results:
        assert r[True]["changed"] == 1 and r[True]["flag"] is True
        assert r[False]["flag"] is None  # negative control: torch's default on the CPU is the per-tensor loop
        assert r["untouched"] == 0 and r["flags"] == [False, None, None]
        for fast, loop, want in zip(r[True]["params"], r[False]["params"], reference.parameters()):
            assert torch.equal(fast, loop)
            torch.testing.assert_close(fast, want.detach(), rtol=1e-5, atol=1e-6)
