"""ZeRO stages 1 and 2: each rank keeps the optimizer state (and, in stage 2, the gradients) of 1/n of the model.

The parameters of each optimizer group are packed into flat buckets (parameters become views into them,
so nothing is copied twice). Bucket ``k`` is padded to a multiple of the sharding-group size ``n`` and
rank ``r`` owns its ``r``-th slice. The optimizer itself is the user's torch optimizer, re-pointed at the
owned slices: its update rule is element-wise (SGD, Adam, AdamW, ...), so stepping slices is exactly
stepping whole tensors. One step:

1. backward — stage 1 accumulates full gradients into a flat gradient bucket (``param.grad`` are views of
   it); stage 2 reduce-scatters each bucket as soon as its gradients are complete (on gloo while backward
   goes on), adds the owned slice to a persistent shard-sized buffer and frees the full gradients (so full
   gradients never exist for the whole model at once);
2. reduce — stage 1 reduce-scatters the flat buckets; with grouped sharding (``replicate_group``) the
   owned slices are then all-reduced across the replicas; the sum is divided by the number of ranks;
3. step — the optimizer updates the owned slices (on the host with ``offload=True``);
4. all-gather — every rank gets the updated parameters.

Traffic per step: reduce-scatter + all-gather = 2(n−1)/n of the parameter bytes, the same as DDP's ring
all-reduce (the ZeRO paper's claim for stages 1-2), measured with :mod:`parallelkit.distributed.collectives`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from parallelkit.distributed.collectives import all_gather, all_reduce, reduce_scatter, start_reduce_scatter
from parallelkit.distributed.comm_stats import CommStats


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    offsets: list[int]
    flat_param: torch.Tensor  # padded; the parameters are views into it
    own: slice  # this rank's slice of the flat bucket
    shard_param: torch.Tensor  # what the optimizer steps: a view of flat_param[own], or its host copy
    flat_grad: torch.Tensor | None = None  # stage 1 only: full gradients, param.grad are views into it
    shard_grad: torch.Tensor | None = None  # the reduced gradient of the owned slice
    ready: int = 0  # stage 2: gradients completed in the current backward
    names: list[str] = field(default_factory=list)

    def grad_view(self, i: int) -> torch.Tensor:
        p, o = self.params[i], self.offsets[i]
        return self.flat_grad[o : o + p.numel()].view_as(p)


def _has_stepped(state: dict[str, Any]) -> bool:
    step = state.get("step", 0)
    return float(step) > 0


def _shard_state(bucket: _Bucket, states: list[dict[str, Any]]) -> dict[str, Any]:
    """One bucket's initial optimizer state on its shard: each per-parameter tensor flattened into the bucket's
    layout and sliced to the owned part (the padding zero, as the padded gradient is); other entries as the first
    parameter has them."""
    shard: dict[str, Any] = {}
    for key, first in states[0].items():
        if isinstance(first, torch.Tensor) and first.shape == bucket.params[0].shape:
            flat = torch.zeros(bucket.flat_param.numel(), dtype=first.dtype, device=first.device)
            for p, o, state in zip(bucket.params, bucket.offsets, states):
                flat[o : o + p.numel()].copy_(state[key].reshape(-1))
            shard[key] = flat[bucket.own].to(bucket.shard_param.device, copy=True)
        else:
            shard[key] = first.clone() if isinstance(first, torch.Tensor) else first
    return shard


class ZeroOptimizer:
    """Shard ``optimizer``'s state (stage 1) and the gradients (stage 2) over ``shard_group``.

    Args:
        optimizer: an optimizer over full (unsharded) parameters, before its first step.
        stage: 1 or 2.
        shard_group: the ranks that split the state (the ``sharding`` mesh axis).
        replicate_group: ranks holding the same shard (the ``dp`` axis of grouped sharding), or None.
        param_names: ``{param: name}`` for checkpoints in the per-parameter (unsharded) layout.
        offload: keep the owned parameter slices, their gradients and the optimizer state on the host and
            step there (ZeRO-Offload); on a CPU-only machine host and device are the same memory, but the
            copies run.
        bucket_mb: bucket size in MiB (communication fusion).
        overlap: stage 2 on gloo: each bucket's reduce-scatter runs while backward goes on; off only to show
            what that changes (every reduce-scatter then holds backward until it is done).

    Example::

        zero = ZeroOptimizer(optimizer, stage=2, shard_group=mesh.get_group("sharding"), ...)
        loss.backward(); zero.reduce_gradients(); optimizer.step(); zero.all_gather_params()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        stage: int,
        shard_group: Any,
        replicate_group: Any = None,
        param_names: dict[torch.nn.Parameter, str] | None = None,
        offload: bool = False,
        bucket_mb: float = 25.0,
        comm_stats: CommStats | None = None,
        overlap: bool = True,
    ) -> None:
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer handles stages 1 and 2, got {stage}")
        if any(_has_stepped(state) for state in optimizer.state.values()):
            raise ValueError("ZeroOptimizer must wrap an optimizer before its first step")
        # State an optimizer builds when it is constructed (Adagrad's accumulators) is laid out on the shards
        # below, as the parameters are.
        initial_state = {p: optimizer.state.pop(p) for p in list(optimizer.state)}
        self.optimizer = optimizer
        self.stage = stage
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.offload = offload
        self.overlap = overlap
        self.comm_stats = comm_stats
        self.n = dist.get_world_size(shard_group)
        self.rank = dist.get_rank(shard_group)
        self.replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        names = param_names or {}
        self.buckets: list[list[_Bucket]] = []  # per optimizer param group
        for group in optimizer.param_groups:
            buckets = [self._make_bucket(chunk, names) for chunk in _chunks(group["params"], bucket_mb * 2**20)]
            group["params"] = [b.shard_param for b in buckets]
            self.buckets.append(buckets)
            for bucket in buckets:
                if bucket.params[0] in initial_state:
                    optimizer.state[bucket.shard_param] = _shard_state(bucket, [initial_state[p] for p in bucket.params])
        self._all = [b for buckets in self.buckets for b in buckets]
        # Stage 2: buckets are reduced in a fixed order (last first, as backward completes them), the same on
        # every rank. ``_next`` is the next bucket to reduce; -1 = no backward in progress. On gloo a bucket's
        # reduce-scatter runs while backward goes on (on gloo's thread); it is finished — the received chunks
        # summed — when the next bucket's starts or before the optimizer step: one in flight.
        self._next = -1
        self._pending: tuple[_Bucket, Any, torch.Tensor] | None = None
        if stage == 2:
            for index, bucket in enumerate(self._all):
                for param in bucket.params:
                    param.register_post_accumulate_grad_hook(lambda _p, i=index: self._on_grad_ready(i))

    # ---------------------------------------------------------------- layout
    def _make_bucket(self, params: list[torch.nn.Parameter], names: dict) -> _Bucket:
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        padded = math.ceil(total / self.n) * self.n
        ref = params[0]
        flat = torch.zeros(padded, dtype=ref.dtype, device=ref.device)
        for p, o in zip(params, offsets):
            flat[o : o + p.numel()].copy_(p.detach().reshape(-1))
            p.data = flat[o : o + p.numel()].view_as(p)
        size = padded // self.n
        own = slice(self.rank * size, (self.rank + 1) * size)
        shard_param = flat[own].detach().to("cpu", copy=True) if self.offload else flat[own]
        bucket = _Bucket(params, offsets, flat, own, shard_param, names=[names.get(p, "") for p in params])
        if self.stage == 1:
            bucket.flat_grad = torch.zeros_like(flat)
            bucket.shard_grad = bucket.flat_grad[own]
            for i, p in enumerate(params):
                p.grad = bucket.grad_view(i)
        else:
            bucket.shard_grad = torch.zeros(size, dtype=ref.dtype, device=ref.device)
        return bucket

    # ---------------------------------------------------------------- gradients
    def _on_grad_ready(self, index: int) -> None:
        if self._next < 0:  # the first gradient of a new backward
            self._next = len(self._all) - 1
        self._all[index].ready += 1
        while self._next >= 0 and self._all[self._next].ready == len(self._all[self._next].params):
            self._reduce_bucket_stage2(self._all[self._next])
            self._next -= 1

    @torch.no_grad()
    def _reduce_bucket_stage2(self, bucket: _Bucket) -> None:
        full = torch.zeros_like(bucket.flat_param)
        for p, o in zip(bucket.params, bucket.offsets):
            if p.grad is not None:
                full[o : o + p.numel()].copy_(p.grad.reshape(-1))
            p.grad = None  # the point of stage 2: full gradients do not outlive their bucket's reduction
        bucket.ready = 0
        reduced = torch.empty_like(bucket.shard_grad)
        self._finish_pending()
        if self.overlap and self.n > 1 and dist.get_backend(self.shard_group) != "nccl":
            self._pending = (bucket, start_reduce_scatter(reduced, full, self.shard_group, self.comm_stats), reduced)
            return
        reduce_scatter(reduced, full, self.shard_group, self.comm_stats)
        self._add_reduced(bucket, reduced)

    def _finish_pending(self) -> None:
        if self._pending is not None:
            bucket, started, reduced = self._pending
            self._pending = None
            started.wait()
            self._add_reduced(bucket, reduced)

    def _add_reduced(self, bucket: _Bucket, reduced: torch.Tensor) -> None:
        if self.replicate_group is not None:
            all_reduce(reduced, self.replicate_group, self.comm_stats)
        bucket.shard_grad.add_(reduced)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """After the last backward of a step: average the owned gradient slices and hand them to the optimizer."""
        if self.stage == 2:  # buckets left incomplete by the last backward (parameters that got no gradient)
            while self._next >= 0:
                self._reduce_bucket_stage2(self._all[self._next])
                self._next -= 1
            self._finish_pending()
        for bucket in self._all:
            if self.stage == 1:
                self._keep_grad_views(bucket)
                reduce_scatter(bucket.shard_grad, bucket.flat_grad, self.shard_group, self.comm_stats)
                if self.replicate_group is not None:
                    all_reduce(bucket.shard_grad, self.replicate_group, self.comm_stats)
            bucket.shard_grad.div_(self.n * self.replicas)
            grad = bucket.shard_grad.to("cpu", copy=True) if self.offload else bucket.shard_grad
            bucket.shard_param.grad = grad

    def _keep_grad_views(self, bucket: _Bucket) -> None:
        # Something (e.g. ``module.zero_grad()``) may have replaced a view with a fresh tensor: fold it back.
        for i, p in enumerate(bucket.params):
            view = bucket.grad_view(i)
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view

    @torch.no_grad()
    def all_gather_params(self) -> None:
        """After the optimizer step: every rank gets every updated slice; gradients start from zero."""
        for bucket in self._all:
            if self.offload:
                bucket.flat_param[bucket.own].copy_(bucket.shard_param)
            all_gather(bucket.flat_param, bucket.flat_param[bucket.own].clone(), self.shard_group, self.comm_stats)
            bucket.shard_grad.zero_()  # stage 1: a view of flat_grad's slice; the rest is zeroed below
            if bucket.flat_grad is not None:
                bucket.flat_grad.zero_()
            bucket.shard_param.grad = None

    # ---------------------------------------------------------------- accounting
    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank keeps: flat parameters (+ host slices), gradient buffers, optimizer state."""
        params = sum(_nbytes(b.flat_param) + (_nbytes(b.shard_param) if self.offload else 0) for b in self._all)
        grads = sum(_nbytes(b.flat_grad) if b.flat_grad is not None else _nbytes(b.shard_grad) for b in self._all)
        grads += sum(_nbytes(p.grad) for b in self._all for p in b.params if self.stage == 2 and p.grad is not None)
        state = sum(_nbytes(v) for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
        return {"params": params, "grads": grads, "optimizer": state}

    # ---------------------------------------------------------------- checkpoints (unsharded per-parameter layout)
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, Any]:
        """The optimizer state as an unsharded optimizer over named parameters would have it (collective)."""
        state: dict[str, dict[str, Any]] = {}
        groups = []
        for group, buckets in zip(self.optimizer.param_groups, self.buckets):
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": [n for b in buckets for n in b.names]})
            for bucket in buckets:
                per_key = self.optimizer.state.get(bucket.shard_param, {})
                for key, value in per_key.items():
                    if not isinstance(value, torch.Tensor) or value.dim() == 0:  # e.g. Adam's step: same everywhere
                        for name in bucket.names:
                            state.setdefault(name, {})[key] = value.clone() if isinstance(value, torch.Tensor) else value
                        continue
                    full = torch.empty(bucket.flat_param.numel(), dtype=value.dtype, device=bucket.flat_param.device)
                    all_gather(full, value.to(full.device), self.shard_group)  # not training traffic: not counted
                    for p, name, o in zip(bucket.params, bucket.names, bucket.offsets):
                        state.setdefault(name, {})[key] = full[o : o + p.numel()].view_as(p).cpu().clone()
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_full_state_dict(self, full: dict[str, Any]) -> None:
        """Inverse of :meth:`full_state_dict`: keep this rank's slice of every per-parameter state tensor. Called after
        the module's parameters were loaded: with ``offload`` the host copies of the owned slices (what the optimizer
        steps) are taken from them again, or the next step would start from the parameters of construction."""
        if self.offload:
            for bucket in self._all:
                bucket.shard_param.copy_(bucket.flat_param[bucket.own])
        for group, saved, buckets in zip(self.optimizer.param_groups, full["param_groups"], self.buckets):
            group.update({k: v for k, v in saved.items() if k != "params"})
            for bucket in buckets:
                names = [n for n in bucket.names if n in full["state"]]
                if not names:
                    continue
                per_key: dict[str, Any] = {}
                for key, value in full["state"][names[0]].items():
                    if not isinstance(value, torch.Tensor) or value.dim() == 0:
                        per_key[key] = value.clone() if isinstance(value, torch.Tensor) else value
                        continue
                    flat = torch.zeros(bucket.flat_param.numel(), dtype=value.dtype)
                    for p, name, o in zip(bucket.params, bucket.names, bucket.offsets):
                        flat[o : o + p.numel()] = full["state"][name][key].reshape(-1).cpu()
                    per_key[key] = flat[bucket.own].to(bucket.shard_param.device).clone()
                self.optimizer.state[bucket.shard_param] = per_key


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _chunks(params: list[torch.nn.Parameter], limit: float) -> list[list[torch.nn.Parameter]]:
    """Consecutive parameters of one dtype, about ``limit`` bytes each (a parameter is never split)."""
    chunks: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        if not p.requires_grad:
            continue
        if not chunks or size + _nbytes(p) > limit or p.dtype != chunks[-1][0].dtype:
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += _nbytes(p)
    return chunks
