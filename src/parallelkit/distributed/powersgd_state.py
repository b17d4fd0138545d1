"""torch's PowerSGD hook state, per parameter: saved in checkpoints and put back whatever DDP's bucket layout.

``PowerSGDState`` keeps its error feedback (``error_dict``) and warm-start factors (``q_memory_dict``) per *bucket
index*, as flat tensors in the bucket's layout. That layout is not stable: DDP builds its buckets in reverse
parameter order, then rebuilds them once, after the first step, in the order the gradients became ready. A fresh
run never notices (PowerSGD starts after ``start_powerSGD_iter`` > 1 steps); a resumed run does, since its first
step may compress already, under the first layout, and its second under the rebuilt one. So the state is stored
per parameter name (:func:`powersgd_state_by_param`), and :class:`PowerSGDLayout` lays it out again for each
bucket the hook is handed, the first time it sees a bucket, and whenever DDP changes the layout of a bucket that
has state (:func:`~parallelkit.distributed.comm_hooks.compression_hook` calls it before torch's hook).

The Q layout follows ``powerSGD_hook``: the bucket's matrices worth compressing (``_should_compress``), grouped by
shape in first-appearance order, each a contiguous block of ``cols × rank`` values (batched or not). The P memory
is not saved: the hook recomputes P from Q before it reads it.
"""

from typing import Any, Dict, List, Tuple

import numpy as np
import torch

RNG_NAME = "MT19937"
COUNTERS = ("iter", "total_numel_before_compression", "total_numel_after_compression", "next_stats_report")


def _q_blocks(params: List[torch.Tensor], state: Any) -> Tuple[Dict[int, Tuple[int, int]], int, int]:
    """``{position in bucket: (q offset, q size)}`` of the compressed matrices, and the P and Q memory sizes."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    groups: Dict[Tuple[int, int], List[Tuple[int, int, int]]] = {}
    for i, param in enumerate(params):
        n = param.shape[0] if param.dim() else 1
        m = param.numel() // max(n, 1)
        rank = min(n, m, state.matrix_approximation_rank)
        if _should_compress(n, m, rank, state.min_compression_rate)[0]:
            groups.setdefault((n, m), []).append((i, m * rank, n * rank))
    blocks, q_offset, p_size = {}, 0, 0
    for members in groups.values():  # insertion order = the hook's shape_to_tensors order
        for i, q_size, ps in members:
            blocks[i] = (q_offset, q_size)
            q_offset += q_size
            p_size += ps
    return blocks, p_size, q_offset


def _bucket_by_param(state: Any, index: int, params: List[torch.Tensor], error: Dict, q: Dict) -> None:
    """Split bucket ``index``'s flat error and Q memory (laid out for ``params``) into the per-parameter dicts."""
    if index in state.error_dict:
        flat, offset = state.error_dict[index], 0
        for param in params:
            error[param] = flat[offset : offset + param.numel()].clone()
            offset += param.numel()
    if index in state.q_memory_dict:
        blocks, _, _ = _q_blocks(params, state)
        for i, (offset, size) in blocks.items():
            q[params[i]] = state.q_memory_dict[index][offset : offset + size].clone()


class PowerSGDLayout:
    """Keeps ``PowerSGDState``'s per-bucket tensors in step with DDP's bucket layout (see the module docstring)."""

    def __init__(self) -> None:
        self.buckets: Dict[int, List[torch.Tensor]] = {}  # bucket index -> its parameters, as last laid out
        self.where: Dict[torch.Tensor, Tuple[int, int]] = {}  # parameter -> (bucket index, position) in that layout
        self.pending_error: Dict[torch.Tensor, torch.Tensor] = {}  # parameter -> its slice, not laid out yet
        self.pending_q: Dict[torch.Tensor, torch.Tensor] = {}

    def before_hook(self, state: Any, bucket: Any) -> None:
        """Called with every bucket before torch's hook: lay the state out for this bucket's parameters."""
        index, params = bucket.index(), bucket.parameters()
        known = self.buckets.get(index)
        moved = any(self.where.get(p, (index, i)) != (index, i) for i, p in enumerate(params))
        if moved or (known is not None and len(known) != len(params)):
            self._to_pending(state)  # DDP rebuilt its buckets: every bucket's state goes back to per parameter
        if index not in self.buckets and (self.pending_error or self.pending_q):
            self._lay_out(state, index, params)
        self.buckets[index] = params
        self.where.update({p: (index, i) for i, p in enumerate(params)})

    def _to_pending(self, state: Any) -> None:
        for index, params in self.buckets.items():
            _bucket_by_param(state, index, params, self.pending_error, self.pending_q)
        state.error_dict.clear()
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
        self.buckets.clear()
        self.where.clear()

    def _lay_out(self, state: Any, index: int, params: List[torch.Tensor]) -> None:
        if all(p in self.pending_error for p in params):
            state.error_dict[index] = torch.cat([self.pending_error.pop(p).reshape(-1) for p in params])
        blocks, p_size, q_size = _q_blocks(params, state)
        if blocks and all(params[i] in self.pending_q for i in blocks):
            q = torch.empty(q_size, dtype=params[0].dtype)
            for i, (offset, size) in blocks.items():
                q[offset : offset + size] = self.pending_q.pop(params[i])
            state.q_memory_dict[index] = q
            state.p_memory_dict[index] = torch.empty(p_size, dtype=params[0].dtype)  # overwritten before it is read

    # ---------------------------------------------------------------- checkpoints
    def state_by_param(self, state: Any, names: Dict[torch.Tensor, str]) -> Dict[str, Any]:
        """This rank's PowerSGD state, per parameter name (tensors, ints and floats only)."""
        error, q = {names[p]: t.clone() for p, t in self.pending_error.items()}, {names[p]: t.clone() for p, t in self.pending_q.items()}
        by_param_error: Dict = {}
        by_param_q: Dict = {}
        for index, params in self.buckets.items():
            _bucket_by_param(state, index, params, by_param_error, by_param_q)
        error.update({names[p]: t for p, t in by_param_error.items()})
        q.update({names[p]: t for p, t in by_param_q.items()})
        _, keys, pos, has_gauss, gauss = state.rng.get_state()
        return {"error": error, "q": q, **{c: getattr(state, c) for c in COUNTERS},
                "rng": {"keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                        "has_gauss": int(has_gauss), "gauss": float(gauss)}}

    def load_by_param(self, state: Any, saved: Dict[str, Any], params: Dict[str, torch.Tensor], keep_error: bool = True) -> None:
        """Put ``saved`` (from :meth:`state_by_param`) back; laid out bucket by bucket as the hook meets them.
        ``keep_error=False``: the error feedback (this replica's own) restarts from zero, the rest is kept."""
        state.error_dict.clear()
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
        self.buckets.clear()
        self.where.clear()
        self.pending_error = {params[n]: t.clone() for n, t in saved["error"].items()} if keep_error else {}
        self.pending_q = {params[n]: t.clone() for n, t in saved["q"].items()}
        for c in COUNTERS:
            setattr(state, c, saved[c])
        rng = saved["rng"]
        state.rng.set_state((RNG_NAME, rng["keys"].numpy().astype(np.uint32), rng["pos"], rng["has_gauss"], rng["gauss"]))

