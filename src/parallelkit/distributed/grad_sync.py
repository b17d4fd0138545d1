"""Gradient averaging over a process group, bucketed, for modules that are not wrapped in DDP.

DDP cannot wrap a module whose parameters are DTensors (tensor parallel), split into pipeline stages, or
partly expert-parallel. Those strategies still need plain data parallelism on their remaining ranks:
after the last backward of an optimizer step, each gradient (its local shard, for a DTensor) is averaged
over the data-parallel group. Gradients are packed into flat buckets so a step costs a few collectives,
not one per parameter (communication fusion). It runs once per optimizer step, so gradient accumulation
needs nothing special.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.distributed as dist

from parallelkit.distributed.comm_counting import counting
from parallelkit.distributed.comm_stats import CommStats

GRAD_ALLREDUCE = "grad_allreduce"
DEFAULT_BUCKET_MB = 25.0


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The storage this rank holds: a DTensor's local shard, else the tensor itself."""
    return tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor


@dataclass
class GradAllReduce:
    """Average the gradients of ``params`` over ``group`` in flat buckets of about ``bucket_mb`` MiB.

    Example::

        sync = apply_grad_allreduce(model.parameters(), mesh.get_group("dp"), comm_stats=stats)
        loss.backward()
        sync.sync()        # before optimizer.step()
    """

    params: list[torch.nn.Parameter]
    group: Any
    comm_stats: CommStats | None = None
    bucket_mb: float = DEFAULT_BUCKET_MB
    kind: str = GRAD_ALLREDUCE
    _size: int = field(init=False)

    def __post_init__(self) -> None:
        self._size = dist.get_world_size(self.group) if self.params else 1

    @torch.no_grad()
    def sync(self) -> None:
        if self._size == 1:
            return
        for bucket in self._buckets():
            grads = []
            for param in bucket:
                if param.grad is None:  # unused this step on this rank: contributes zeros, like DDP
                    param.grad = torch.zeros_like(param)
                grads.append(local_tensor(param.grad))
            flat = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1).clone()
            with counting(self.comm_stats, self.kind):
                dist.all_reduce(flat, group=self.group)
            flat.div_(self._size)
            offset = 0
            for grad in grads:
                grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                offset += grad.numel()

    def _buckets(self) -> Iterable[list[torch.nn.Parameter]]:
        # Buckets must hold the same parameters in the same order on every rank of the group, and a
        # bucket has one dtype; parameters are registered in the same order everywhere.
        limit = self.bucket_mb * 2**20
        bucket: list[torch.nn.Parameter] = []
        nbytes = 0
        for param in self.params:
            local = local_tensor(param)
            if bucket and (nbytes + local.numel() * local.element_size() > limit or local.dtype != local_tensor(bucket[0]).dtype):
                yield bucket
                bucket, nbytes = [], 0
            bucket.append(param)
            nbytes += local.numel() * local.element_size()
        if bucket:
            yield bucket


def apply_grad_allreduce(
    params: Iterable[torch.nn.Parameter],
    group: Any,
    *,
    comm_stats: CommStats | None = None,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    kind: str = GRAD_ALLREDUCE,
) -> GradAllReduce:
    """Prepare bucketed gradient averaging of ``params`` over ``group``; call ``.sync()`` after backward."""
    return GradAllReduce([p for p in params if p.requires_grad], group, comm_stats, bucket_mb, kind)
