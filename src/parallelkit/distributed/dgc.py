"""Deep Gradient Compression (Lin et al., ICLR 2018) as a DDP comm hook.

Each rank sends only the largest-magnitude entries of its *accumulated* gradient, as (index, value) pairs;
the rest stays in a local residual and is sent once it has grown large enough. Top-k sets differ between
ranks, so they cannot be summed by an all-reduce: every rank all-gathers the pairs of all ranks and
scatter-adds them (the all-gather payload is fixed per tensor, ``k = ceil(numel × (1 − sparsity))``, so it
works on gloo, which cannot gather unequal sizes).

The paper's four corrections, each switchable:

- **momentum correction**: the momentum is applied *before* compression, on each rank
  (``u ← m·u + g``; ``v ← v + u``), and the optimizer then steps without momentum; otherwise the residual
  accumulates raw gradients (``v ← v + g``) and stale gradients miss their momentum.
- **local gradient clipping**: each tensor's local gradient is clipped to ``clip_norm / √N`` (N ranks)
  before it is accumulated, so the sum over ranks stays within ``clip_norm`` (per tensor, as PaddlePaddle's
  ``dgc_clip_by_norm`` does: a bucket hook never sees the whole model at once).
- **momentum factor masking**: the momentum of the coordinates just sent is zeroed, so a stale momentum
  does not keep pushing them.
- **warm-up**: the sparsity is ramped through a list (e.g. 75 % → 93.75 % → 98.4 % → 99.6 % → 99.9 %)
  over ``rampup_steps`` steps after ``rampup_begin_step``, as in PaddlePaddle Fleet's ``dgc_configs``.

Before ``rampup_begin_step`` (and for tensors below ``dense_min_numel`` elements) the hook averages densely
— with momentum correction it averages the local momenta, which equals momentum SGD exactly because
momentum is linear. Top-k is exact (``torch.topk``); the paper samples to estimate the threshold, a GPU
speed trick. Collectives are blocking inside the hook (no overlap with the rest of backward).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at run time.

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from parallelkit.distributed.collectives import all_gather_single
from parallelkit.distributed.comm_counting import counting
from parallelkit.distributed.comm_hooks import counts_own_traffic
from parallelkit.distributed.comm_stats import CommStats, collective_bytes

DGC_SPARSE = "dgc_sparse_allgather"
DGC_DENSE = "dgc_dense_allreduce"
DEFAULT_SPARSITY = (0.75, 0.9375, 0.984375, 0.996, 0.999)


def _all_gather(output: torch.Tensor, tensor: torch.Tensor, group: Any) -> None:
    all_gather_single(output, tensor, group=group)


class DGCState:
    """What :func:`dgc_hook` keeps between steps: the schedule, the per-tensor residuals, the counters.

    Args:
        process_group: the data-parallel group.
        sparsity: the warm-up list; the last value is the steady-state sparsity.
        rampup_begin_step: steps before it are dense (plain averaging).
        rampup_steps: steps over which the list is walked (equal shares); 0 = the last value at once.
        warmup: walk the list (``False``: the last value from ``rampup_begin_step`` on).
        momentum: momentum for momentum correction (0 = off: the residual accumulates raw gradients).
        momentum_masking: zero the momentum of sent coordinates (needs ``momentum > 0``).
        clip_norm: local clipping threshold before accumulation, scaled by ``1/√N`` (None = off).
        dense_min_numel: tensors with fewer elements are always averaged densely.
        stats: where collectives are counted.
        keep_sent: remember the last (index, value) pairs sent per tensor (for tests and inspection).
    """

    def __init__(
        self,
        process_group: Any,
        *,
        sparsity: Sequence[float] = DEFAULT_SPARSITY,
        rampup_begin_step: int = 0,
        rampup_steps: int = 0,
        warmup: bool = True,
        momentum: float = 0.0,
        momentum_masking: bool = True,
        clip_norm: Optional[float] = None,
        dense_min_numel: int = 0,
        stats: Optional[CommStats] = None,
        keep_sent: bool = False,
    ) -> None:
        if momentum_masking and momentum <= 0:
            raise ValueError("momentum_masking needs momentum correction (momentum > 0)")
        self.process_group = process_group
        self.sparsity = tuple(float(s) for s in sparsity)
        self.rampup_begin_step = int(rampup_begin_step)
        self.rampup_steps = int(rampup_steps)
        self.warmup = bool(warmup)
        self.momentum = float(momentum)
        self.momentum_masking = bool(momentum_masking)
        self.clip_norm = clip_norm
        self.dense_min_numel = int(dense_min_numel)
        self.stats = stats
        self.keep_sent = keep_sent
        self.step = 0
        self.velocity: Dict[torch.Tensor, torch.Tensor] = {}  # v: accumulated, not yet sent
        self.momentum_buffer: Dict[torch.Tensor, torch.Tensor] = {}  # u
        self.last_sent: Dict[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = {}
        # Per step (reset by begin_step): bytes this rank sent, and what a dense all-reduce would have sent
        # (both as the backend writes them, framing included).
        self.step_sent_bytes = 0.0
        self.step_dense_bytes = 0.0

    def begin_step(self, step: int) -> None:
        """Called before the backward of optimizer step ``step`` (0-based): picks the sparsity."""
        if step != self.step:
            self.step_sent_bytes = 0.0
            self.step_dense_bytes = 0.0
        self.step = int(step)

    def sparsity_at(self, step: int) -> float:
        """0 before ``rampup_begin_step``; then the warm-up list in equal shares of ``rampup_steps``."""
        if step < self.rampup_begin_step:
            return 0.0
        if not self.warmup or self.rampup_steps <= 0:
            return self.sparsity[-1]
        index = (step - self.rampup_begin_step) * len(self.sparsity) // self.rampup_steps
        return self.sparsity[min(index, len(self.sparsity) - 1)]

    def is_compressing(self, step: Optional[int] = None) -> bool:
        return self.sparsity_at(self.step if step is None else step) > 0


def topk_count(numel: int, sparsity: float) -> int:
    """How many entries a tensor of ``numel`` sends at ``sparsity`` (at least one)."""
    return max(1, math.ceil(numel * (1.0 - sparsity) - 1e-9))


def _record(state: DGCState, tensor: torch.Tensor, op: str) -> None:
    """This step's bytes, for the compression ratio (the collective itself is counted where it is issued)."""
    state.step_sent_bytes += collective_bytes(tensor, op, state.process_group)


@torch.no_grad()
@counts_own_traffic
def dgc_hook(state: DGCState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's gradients over the group, sending only the top-k of each accumulated tensor."""
    buffer = bucket.buffer()
    world = dist.get_world_size(state.process_group)
    params = bucket.parameters()
    sparsity = state.sparsity_at(state.step)
    compressing = sparsity > 0
    state.step_dense_bytes += collective_bytes(buffer, "all_reduce", state.process_group)  # what dense DDP would send

    offsets, offset = [], 0
    for param in params:
        offsets.append(offset)
        offset += param.numel()
    if offset != buffer.numel():  # the flat layout this hook relies on
        raise RuntimeError(f"DGC: bucket of {buffer.numel()} elements holds parameters of {offset} elements")

    dense_spans: List[Tuple[int, torch.Tensor]] = []
    sparse_index: List[torch.Tensor] = []
    sparse_value: List[torch.Tensor] = []
    for param, start in zip(params, offsets):
        grad = buffer[start : start + param.numel()]
        if compressing and state.clip_norm is not None:
            limit = state.clip_norm / math.sqrt(world)
            norm = torch.linalg.vector_norm(grad)
            if norm > limit:
                grad = grad * (limit / (norm + 1e-6))
        if state.momentum > 0:
            u = state.momentum_buffer.get(param)
            u = grad.clone() if u is None else u.mul_(state.momentum).add_(grad)
            state.momentum_buffer[param] = u
            update = u
        else:
            update = grad
        if not compressing or param.numel() < state.dense_min_numel:
            dense_spans.append((start, update.clone()))
            continue
        v = state.velocity.get(param)
        v = update.clone() if v is None else v.add_(update)
        state.velocity[param] = v
        k = topk_count(v.numel(), sparsity)
        index = torch.topk(v.abs(), k, sorted=False).indices
        value = v[index]  # a copy: v[index] = 0 below leaves it intact
        v[index] = 0  # sent + kept = accumulated, exactly (no arithmetic on either side)
        if state.momentum_masking:
            state.momentum_buffer[param][index] = 0
        if state.keep_sent:
            state.last_sent[param] = (index.clone(), value.clone())
        sparse_index.append(index.to(torch.int32) + start)
        sparse_value.append(value)

    result = torch.zeros_like(buffer)
    if sparse_index:
        index = torch.cat(sparse_index)
        value = torch.cat(sparse_value)
        all_index = index.new_empty(world * index.numel())
        all_value = value.new_empty(world * value.numel())
        _record(state, index, "all_gather")
        _record(state, value, "all_gather")
        with counting(state.stats, DGC_SPARSE):
            _all_gather(all_index, index, state.process_group)
            _all_gather(all_value, value, state.process_group)
        result.index_add_(0, all_index.long(), all_value)  # coordinates several ranks sent are summed
    if dense_spans:
        flat = torch.cat([t for _, t in dense_spans])
        _record(state, flat, "all_reduce")
        with counting(state.stats, DGC_DENSE):
            dist.all_reduce(flat, group=state.process_group)
        pos = 0
        for start, tensor in dense_spans:
            result[start : start + tensor.numel()] = flat[pos : pos + tensor.numel()]
            pos += tensor.numel()
    result.div_(world)
    buffer.copy_(result)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def build_dgc(process_group: Any, **options: Any) -> Tuple[Any, DGCState]:
    """The hook and its state, for :func:`~parallelkit.distributed.data_parallel.apply_ddp`.

    Example::

        hook, state = build_dgc(group, sparsity=[0.999], momentum=0.9, stats=stats)
        ddp = apply_ddp(model, process_group=group, comm_hook=hook, comm_state=state)
        state.begin_step(step)          # before each backward
    """
    return dgc_hook, DGCState(process_group, **options)
