"""The asynchronous save's stager on 2 real gloo ranks: DTensors staged as their local shards and wrapped again.

:func:`parallelkit.distributed.async_checkpoint.local_shard_stager` copies each DTensor's local shard through
torch's cached staging buffers and wraps the copy in a DTensor of the same spec (mesh, placements, global shape),
instead of torch's generic deep copy of the spec and mesh per tensor. Checked against torch's own
``DefaultStager`` and against the full tensors built in the test: the staged copy holds each rank's own shard,
shares no memory with the live state (a later in-place update does not reach it), reuses its buffers at the
next save, and written with DCP and read back whole it is the full tensor. Negative control: "staging" that
does not copy carries the in-place update into what would be written.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .harness import run_ranks

ROWS, COLS = 6, 5


def _full(seed: int) -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed))


def _tree(mesh) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    weight = distribute_tensor(_full(1), mesh, [Shard(0)])  # rank r holds rows 3r..3r+2: different data per rank
    moment = distribute_tensor(_full(2), mesh, [Shard(1)])  # uneven: columns 0-2 and 3-4
    bias = distribute_tensor(_full(3)[0], mesh, [Replicate()])
    return {
        "state_dict": OrderedDict(weight=weight, bias=bias),
        "optimizer_0": {"state": {"weight": {"exp_avg": moment, "step": torch.tensor(4.0)}},
                        "param_groups": [{"lr": 0.1, "params": ["weight"]}]},
        "loss_history": [2.5, 2.25],
    }


def _stage_job(rank: int, world: int, ckpt_dir: str, copies: bool) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    from parallelkit.distributed.async_checkpoint import local_shard_stager

    mesh = init_device_mesh("cpu", (world,))
    live = _tree(mesh)
    options = StagingOptions(False, False, False, False)
    stager = local_shard_stager(options) if copies else type("NoCopy", (), {"stage": staticmethod(lambda tree: tree)})()
    staged = stager.stage(live)
    torch_staged = DefaultStager(options).stage(live)  # torch's generic path: the reference
    pairs = [(staged["state_dict"]["weight"], torch_staged["state_dict"]["weight"], live["state_dict"]["weight"]),
             (staged["state_dict"]["bias"], torch_staged["state_dict"]["bias"], live["state_dict"]["bias"]),
             (staged["optimizer_0"]["state"]["weight"]["exp_avg"], torch_staged["optimizer_0"]["state"]["weight"]["exp_avg"],
              live["optimizer_0"]["state"]["weight"]["exp_avg"])]
    out = {
        "dtensors": all(isinstance(s, DTensor) for s, _, _ in pairs),
        "same_spec": all(s.placements == t.placements and s.shape == t.shape and s.device_mesh == t.device_mesh for s, t, _ in pairs),
        "locals": [s.to_local().clone() for s, _, _ in pairs],
        "torch_locals": [t.to_local().clone() for _, t, _ in pairs],
        "shares_memory": any(s.to_local().untyped_storage().data_ptr() == v.to_local().untyped_storage().data_ptr() for s, _, v in pairs),
        "rest": (type(staged["state_dict"]).__name__, staged["optimizer_0"]["param_groups"], staged["loss_history"],
                 staged["optimizer_0"]["state"]["weight"]["step"].item()),
    }
    for _, _, v in pairs:  # the next training step updates the live state in place
        v.to_local().add_(100.0)
    out["after_update"] = [s.to_local().clone() for s, _, _ in pairs]
    if copies:
        # What the writer does with the copy (before the next save, which reuses its buffers): DCP writes it; read
        # back whole (Replicate), it is the full tensor as it was at staging time.
        dcp.save({"state_dict": staged["state_dict"]}, checkpoint_id=ckpt_dir)
        target = {"state_dict": {"weight": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Replicate()]),
                                 "bias": distribute_tensor(torch.zeros(COLS), mesh, [Replicate()])}}
        dcp.load(target, checkpoint_id=ckpt_dir)
        out["read_back"] = [target["state_dict"]["weight"].to_local().clone(), target["state_dict"]["bias"].to_local().clone()]
        pointers = [s.to_local().data_ptr() for s, _, _ in pairs]
        again = stager.stage(live)
        trio = [again["state_dict"]["weight"], again["state_dict"]["bias"], again["optimizer_0"]["state"]["weight"]["exp_avg"]]
        out["reused_buffers"] = [t.to_local().data_ptr() for t in trio] == pointers
        out["again"] = [t.to_local().clone() for t in trio]
    return out


def _expected_locals(rank: int) -> list[torch.Tensor]:
    return [_full(1)[3 * rank:3 * rank + 3], _full(3)[0], _full(2)[:, 3 * rank:3 * rank + 3]]


def test_dtensors_are_staged_as_their_own_shards_and_written_whole(tmp_path):
    results = run_ranks(_stage_job, 2, tmp_path, str(tmp_path / "ckpt"), True)
    for rank, r in enumerate(results):
        assert r["dtensors"] and r["same_spec"], rank
        for got, ref, want in zip(r["locals"], r["torch_locals"], _expected_locals(rank)):
            assert torch.equal(got, ref) and torch.equal(got, want), rank
        assert not r["shares_memory"], rank
        assert r["rest"] == ("OrderedDict", [{"lr": 0.1, "params": ["weight"]}], [2.5, 2.25], 4.0), rank
        for staged, want in zip(r["after_update"], _expected_locals(rank)):
            assert torch.equal(staged, want), rank  # the live update did not reach the staged copy
        assert r["reused_buffers"], rank
        for got, want in zip(r["again"], _expected_locals(rank)):
            assert torch.equal(got, want + 100.0), rank  # the second save stages the updated state
        torch.testing.assert_close(r["read_back"][0], _full(1), rtol=0, atol=0)
        torch.testing.assert_close(r["read_back"][1], _full(3)[0], rtol=0, atol=0)


def test_negative_control_staging_without_a_copy_carries_the_update_into_the_save(tmp_path):
    results = run_ranks(_stage_job, 2, tmp_path, str(tmp_path / "ckpt"), False)
    for rank, r in enumerate(results):
        assert r["shares_memory"], rank
        assert all(torch.equal(got, want + 100.0) for got, want in zip(r["after_update"], _expected_locals(rank))), rank
