"""ZeRO stage 3 on FSDP2 (``fully_shard``): parameters, gradients and optimizer state all sharded.

Each sharding unit (by default every repeated block, then the root; the policies are in
:mod:`parallelkit.distributed.blocks`) all-gathers its parameters right before it runs, forward and
backward, and reduce-scatters its gradients after backward. parallelkit plugs
its own collectives into FSDP2 (``set_custom_reduce_scatter`` / ``set_custom_all_gather``) so that the
traffic is counted, and so that on gloo the reduce-scatter is the bandwidth-optimal all-to-all of
:mod:`parallelkit.distributed.collectives` instead of gloo's all-reduce-and-slice. With a 2-D mesh
``(dp, sharding)`` this is HSDP (grouped sharding): shard inside a group, all-reduce across groups.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from parallelkit.distributed.blocks import repeated_blocks
from parallelkit.distributed.collectives import all_gather_single, reduce_scatter
from parallelkit.distributed.comm_counting import counting, start_counting, stop_counting
from parallelkit.distributed.comm_stats import CommStats


class _CountedAllGather(AllGather):
    def __init__(self, stats: CommStats | None) -> None:
        self.stats = stats

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False) -> Any:
        with counting(self.stats, "param_all_gather"):
            return all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class _ReplicaAllReduce:
    """Under HSDP, FSDP2 all-reduces each unit's reduced shard across the replicas itself. This claims those
    all-reduces (the only collectives on the replicas' group) from the unit's forward until FSDP2's all-reduce
    hook, which runs right after the all-reduce of the unit's backward."""

    def __init__(self, stats: CommStats, replicate_group: Any) -> None:
        self.stats, self.replicate_group = stats, replicate_group
        self._claim: Any = None

    def forward_started(self, module: Any, args: Any) -> None:
        self.all_reduced(None)  # a claim left open by a forward without backward (validation)
        self._claim = start_counting(self.stats, "grad_all_reduce", group=self.replicate_group)

    def all_reduced(self, grad: torch.Tensor | None) -> None:
        if self._claim is not None:
            stop_counting(self._claim)
            self._claim = None


class _CountedReduceScatter(ReduceScatter):
    def __init__(self, stats: CommStats | None) -> None:
        self.stats = stats

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False) -> Any:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise NotImplementedError(f"parallelkit's reduce-scatter handles SUM and AVG, FSDP2 asked for {op}")
        reduce_scatter(output_tensor, input_tensor, group, self.stats)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(dist.get_world_size(group))
        return None  # synchronous: FSDP2 then needs no work handle


def apply_fsdp(
    model: torch.nn.Module,
    mesh: Any,
    *,
    units: Sequence[torch.nn.Module] | None = None,
    reshard_after_forward: bool = True,
    offload_params: bool = False,
    ignored_params: set[torch.nn.Parameter] | None = None,
    comm_stats: CommStats | None = None,
) -> torch.nn.Module:
    """Shard ``model`` in place with FSDP2 over ``mesh`` (1-D: sharding; 2-D ``(dp, sharding)``: HSDP).

    Args:
        units: the sub-modules that become sharding units of their own, children before parents
            (:func:`~parallelkit.distributed.blocks.select_units`), so only one unit's full parameters exist
            at a time; ``None``: the model's repeated blocks; ``[]``: the whole model is one unit. The model
            itself is always the root unit, holding whatever no unit holds. A module that is already sharded
            (by a LightningModule's own ``configure_model``) is kept as it is.
        reshard_after_forward: free the gathered parameters after forward (ZeRO-3) and gather again for
            backward.
        offload_params: keep the parameter shards, their gradients and the optimizer state in host memory
            (the optimizer then steps on the host).
        ignored_params: parameters FSDP2 leaves alone (whole, not sharded, gradients not reduced): an
            expert-parallel rank's experts, which the caller averages over the ranks holding the same ones.
    """
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload_params else OffloadPolicy()
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward, "offload_policy": offload, "ignored_params": ignored_params}
    for unit in repeated_blocks(model) if units is None else units:
        if not isinstance(unit, FSDPModule):
            fully_shard(unit, **kwargs)
    if not isinstance(model, FSDPModule):
        fully_shard(model, **kwargs)
    replicas = mesh.size(0) if mesh.ndim == 2 else 1
    replicate_group = mesh.get_group(0) if replicas > 1 else None
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        # parallelkit's collectives: counted, and on gloo a reduce-scatter that sends what it should.
        module.set_custom_all_gather(_CountedAllGather(comm_stats))
        module.set_custom_reduce_scatter(_CountedReduceScatter(comm_stats))
        if replicas > 1 and comm_stats is not None:
            replica_all_reduce = _ReplicaAllReduce(comm_stats, replicate_group)
            module.register_forward_pre_hook(replica_all_reduce.forward_started)
            module.set_all_reduce_hook(replica_all_reduce.all_reduced)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any module of ``model`` is already an FSDP2 unit (e.g. sharded by its own ``configure_model``)."""
    return any(isinstance(module, FSDPModule) for module in model.modules())
