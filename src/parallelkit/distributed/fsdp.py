"""ZeRO stage 3 on FSDP2 (``fully_shard``): parameters, gradients and optimizer state all sharded.

Each sharding unit (by default every repeated block, then the root; the policies are in
:mod:`parallelkit.distributed.blocks`) all-gathers its parameters before it runs, forward and backward, and
reduce-scatters its gradients after backward. With ``prefetch`` (the default) the next unit's all-gather runs
while the current unit computes and, on gloo, each reduce-scatter while the next unit's backward runs: on the
CPU FSDP2 has no streams to overlap with, so every collective would otherwise hold the one computing thread. parallelkit plugs
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
from parallelkit.distributed.collectives import StartedReduceScatter, all_gather_single, reduce_scatter, start_reduce_scatter
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


class _ReduceScatterOverlap:
    """Gradient reduce-scatters that run while backward goes on (gloo; on NCCL FSDP2's stream does this).

    FSDP2 calls its reduce-scatter synchronously on the CPU: each unit's backward would wait for its unit's
    collective before the next unit's backward starts. Here a unit's reduce-scatter is started on gloo's thread
    and finished (the received chunks summed into the unit's gradient shard) when the next unit's starts, and the
    last one at the end of backward (an autograd final callback): one reduce-scatter in flight, so memory holds
    at most one unit's reduce buffers more than the synchronous form. Only where FSDP2 merely views the output
    as the sharded gradients (reads nothing before the end of backward); otherwise synchronous (:meth:`can_start`).
    """

    def __init__(self) -> None:
        self._pending: StartedReduceScatter | None = None
        self._graph_task = -1

    @staticmethod
    def can_start(output: torch.Tensor, group: Any, params: list[torch.Tensor]) -> bool:
        return (
            dist.get_backend(group) != "nccl"
            and torch._C._current_graph_task_id() != -1  # inside backward: the final callback can finish it
            # FSDP2 reads the output at once to add it to an existing gradient (accumulation) or to cast it
            and all(p.grad is None and p.dtype == output.dtype for p in params)
        )

    def start(self, output: torch.Tensor, input: torch.Tensor, group: Any, average: bool, stats: CommStats | None) -> None:
        self.finish()
        self._pending = start_reduce_scatter(output, input, group, stats, average=average)
        task = torch._C._current_graph_task_id()
        if task != self._graph_task:  # once per backward
            self._graph_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def finish(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()


class _CountedReduceScatter(ReduceScatter):
    def __init__(self, stats: CommStats | None, overlap: _ReduceScatterOverlap | None, params: list[torch.Tensor]) -> None:
        self.stats, self.overlap, self.params = stats, overlap, params

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False) -> Any:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise NotImplementedError(f"parallelkit's reduce-scatter handles SUM and AVG, FSDP2 asked for {op}")
        if self.overlap is not None and self.overlap.can_start(output_tensor, group, self.params):
            self.overlap.start(output_tensor, input_tensor, group, op == dist.ReduceOp.AVG, self.stats)
            return None
        reduce_scatter(output_tensor, input_tensor, group, self.stats)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(dist.get_world_size(group))
        return None  # FSDP2 needs no work handle: done, or finished by the overlap before anything reads it


def _unit_params(module: FSDPModule) -> list[torch.Tensor]:
    """The sharded parameters of ``module``'s own unit (not those of units inside it)."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    return [fsdp_param.sharded_param for group in groups for fsdp_param in group.fsdp_params]


def _reshard_without_backward(root: FSDPModule, args: Any, output: Any) -> None:
    """The root keeps its gathered parameters for the backward that follows its forward; after a forward without
    gradients (validation, prediction) none follows, so it frees them now instead of holding them to the next
    training step."""
    if not torch.is_grad_enabled():
        root.reshard()


def apply_prefetch(units: Sequence[FSDPModule]) -> None:
    """Gather the next unit's parameters while the current one computes, forward and backward.

    ``units`` in the order their forwards begin. Each unit's forward starts the next unit's all-gather
    (FSDP2's explicit forward prefetch); backward starts the previous unit's (FSDP2's default backward
    prefetch, in reverse forward order). The all-gathers are issued asynchronously: on gloo they run on its own
    thread while this one computes, on NCCL on FSDP2's all-gather stream. One unit is gathered ahead at most.
    """
    for unit, following in zip(units, units[1:]):
        unit.set_modules_to_forward_prefetch([following])
    for unit in units:
        unit._set_unshard_async_op(True)


def apply_fsdp(
    model: torch.nn.Module,
    mesh: Any,
    *,
    units: Sequence[torch.nn.Module] | None = None,
    reshard_after_forward: bool = True,
    prefetch: bool = True,
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
            backward. The root unit keeps them (FSDP2's own default for the root): its parameters (embeddings,
            head) are gathered through the whole forward anyway and the backward needs them at once.
        prefetch: overlap communication with compute: the next unit's all-gather runs while the current one
            computes (:func:`apply_prefetch`), and on gloo a unit's gradient reduce-scatter while the next
            unit's backward runs. Off: every collective runs when its unit needs it.
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
        # None: FSDP2's root default (kept gathered from forward into backward); False stays False.
        fully_shard(model, **{**kwargs, "reshard_after_forward": None if reshard_after_forward else False})
        if reshard_after_forward:
            model.register_forward_hook(_reshard_without_backward)
    replicas = mesh.size(0) if mesh.ndim == 2 else 1
    replicate_group = mesh.get_group(0) if replicas > 1 else None
    # Under HSDP FSDP2 all-reduces each reduced shard across the replicas right after its reduce-scatter.
    overlap = _ReduceScatterOverlap() if prefetch and replicas == 1 and not offload_params else None
    fsdp_units = [module for module in model.modules() if isinstance(module, FSDPModule)]  # pre-order: forward order
    for module in fsdp_units:
        # parallelkit's collectives: counted, and on gloo a reduce-scatter that sends what it should.
        module.set_custom_all_gather(_CountedAllGather(comm_stats))
        module.set_custom_reduce_scatter(_CountedReduceScatter(comm_stats, overlap, _unit_params(module)))
        if replicas > 1 and comm_stats is not None:
            replica_all_reduce = _ReplicaAllReduce(comm_stats, replicate_group)
            module.register_forward_pre_hook(replica_all_reduce.forward_started)
            module.set_all_reduce_hook(replica_all_reduce.all_reduced)
    if prefetch:
        apply_prefetch(fsdp_units)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any module of ``model`` is already an FSDP2 unit (e.g. sharded by its own ``configure_model``)."""
    return any(isinstance(module, FSDPModule) for module in model.modules())
