"""DiLoCo and Streaming DiLoCo: replicas train alone for H steps, then an outer optimizer applies their mean delta.

DiLoCo (Douillard et al., arXiv:2311.08105): every replica runs ``inner_steps`` (H) steps of the run's own
optimizer on its own data, sending nothing. Then the *outer gradient* ``anchor - local`` (how far the replica
moved since the last outer step) is averaged over the replicas and applied to the anchor (the global
parameters) by an outer SGD with Nesterov momentum; every replica restarts from the new anchor. One
all-reduce of the parameters per H steps: DDP's bytes ÷ H.

Streaming DiLoCo (Douillard et al., arXiv:2501.18512) adds three things, each an option here:

- ``fragments`` (F): the parameters are cut into F contiguous fragments of about equal size; fragment f's
  outer step comes every H steps like the whole model's, but the fragments are staggered by H/F steps, so
  the link carries one fragment at a time instead of a burst of the whole model every H steps;
- ``overlap_steps`` (τ): a fragment's all-reduce is started after its step and awaited only τ inner steps
  later, so it travels while the replica computes (gloo's worker thread sends it). The τ local steps taken
  meanwhile are merged: ``param = mix · local + (1 - mix) · anchor`` (the paper's α; torchft's
  ``fragment_update_alpha``). With τ = 0 the replica takes the anchor as it is;
- ``outer_dtype`` bf16/fp16: the outer gradients travel in half precision (half the bytes); ``int8``: in
  int8 with one fp32 scale per 256 elements, all-gathered and averaged in fp32 by every rank
  (:mod:`parallelkit.distributed.diloco_quantize`: a quarter of fp32's bytes on 2 ranks, ``W / 8`` of them on W).
  The anchor and the outer momentum stay fp32.

The schedule is a function of the global optimizer step only (fragment f syncs after step s when
``(s + 1) % H == (f + 1) · H / F % H``), so a resumed run needs no counters to find its place. At most one
fragment is in flight (τ < H / F), so the extra memory beyond the anchors and the outer momentum is one
fragment's outer gradient in ``outer_dtype`` (int8: every rank's packed copy, W · (n + 4⌈n / 256⌉) bytes),
and, during its outer step, that gradient in fp32. Every fragment's anchor is held all the time (each
fragment's anchor is needed from its outer step until its next, H steps later, and the fragments' periods
overlap): one fp32 copy of the model, and one more for the outer momentum. :meth:`DiLoCo.memory_bytes`
reports these from the tensors held (``numel · element_size``), the in-flight part as its peak over the run.

Why not torchft's ``DiLoCo`` (torchft 0.2.0 ``local_sgd.py``, read before writing this): it needs its
fault-tolerance ``Manager`` (a quorum per outer step, ``should_commit``, a lighthouse or a manager store),
all-reduces on the Manager's own reconfigurable process group instead of the strategy's data-parallel group,
checkpoints through ``Manager.register_state_dict_fn`` rather than Lightning's, and quantizes outer
gradients with Triton kernels (GPU only). The algorithm and its option names follow torchft's, so a later
torchft integration (per-step fault tolerance) can swap the collective for ``Manager.allreduce``.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist

from parallelkit.distributed.comm_counting import counting
from parallelkit.distributed.comm_stats import CommStats
from parallelkit.distributed.diloco_quantize import finish_int8_mean, mean_of_gathered, start_int8_mean

#: the outer exchange's kind in ``CommStats`` (an all-reduce; with ``outer_dtype=int8`` an all-gather)
OUTER_ALLREDUCE = "diloco_outer_allreduce"
OUTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}


def _nbytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct tensors among ``tensors`` (``numel · element_size``; one storage counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.numel() * t.element_size()
    return total


def split_fragments(params: list[torch.Tensor], fragments: int) -> list[list[int]]:
    """Indices of ``params`` cut into ``fragments`` contiguous runs of about equal element counts."""
    if fragments > len(params):
        raise ValueError(f"cannot cut {len(params)} parameter tensors into {fragments} fragments")
    total = sum(p.numel() for p in params) or 1
    out: list[list[int]] = [[] for _ in range(fragments)]
    seen, f = 0, 0
    for i, p in enumerate(params):
        want = int((seen + p.numel() / 2) * fragments / total)  # where this tensor's middle falls
        # contiguous (never skip a fragment) and no fragment left empty by the tensors that remain
        f = 0 if i == 0 else min(max(want, f, fragments - (len(params) - i)), f + 1, fragments - 1)
        out[f].append(i)
        seen += p.numel()
    assert all(out), out
    return out


class DiLoCo:
    """Drives DiLoCo's outer steps for ``params`` over ``group`` (model-agnostic; the inner optimizer is the caller's).

    Call :meth:`after_step` after every inner optimizer step with its 0-based global step; gradients must
    not be all-reduced (a comm hook that sends nothing). Replicas must start identical (DDP broadcasts).

    Args:
        params: the replicated parameters.
        group: the data-parallel process group.
        stats: where the outer all-reduces are counted (kind :data:`OUTER_ALLREDUCE`).
        inner_steps: H, inner steps between two outer steps of a fragment.
        outer_lr, outer_momentum, nesterov: the outer SGD.
        fragments: F (Streaming DiLoCo); must divide H.
        overlap_steps: τ, inner steps a fragment's all-reduce overlaps; < H / F.
        mix: weight of the local parameters when an overlapped fragment is merged (only with τ > 0).
        outer_dtype: ``fp32``, ``bf16``, ``fp16`` or ``int8``: the precision the outer gradients travel in.

    Example::

        ddp = apply_ddp(model, process_group=group, comm_hook=local_sgd_hook, comm_state=state)  # sync_grads=False
        diloco = DiLoCo(ddp.parameters(), group, stats, inner_steps=8, outer_lr=0.7, outer_momentum=0.9)
        for step, batch in enumerate(batches):
            opt.zero_grad(); loss(ddp(batch)).backward(); opt.step(); diloco.after_step(step)
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], group: Any, stats: CommStats | None = None, *,
                 inner_steps: int, outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                 fragments: int = 1, overlap_steps: int = 0, mix: float = 0.5, outer_dtype: str = "fp32") -> None:
        self.params = [p for p in params if p.requires_grad]
        if inner_steps % fragments or overlap_steps >= inner_steps // fragments:
            raise ValueError(f"need fragments | inner_steps and overlap_steps < inner_steps / fragments; "
                             f"got H={inner_steps}, F={fragments}, τ={overlap_steps}")
        self.group, self.stats = group, stats
        self.inner_steps, self.overlap_steps, self.mix = inner_steps, overlap_steps, float(mix)
        self.dtype = OUTER_DTYPES[outer_dtype]
        self.quantized = outer_dtype == "int8"
        self.fragments = split_fragments(self.params, fragments)
        # fp32 anchors whatever the parameters' dtype: the outer step accumulates many small deltas
        self.anchors = [p.detach().float().clone() for p in self.params]
        self.outer = torch.optim.SGD(self.anchors, lr=outer_lr, momentum=outer_momentum,
                                     nesterov=nesterov and outer_momentum > 0)
        self.pending: dict[str, Any] | None = None  # the fragment whose all-reduce is in flight
        self.outer_steps: list[tuple[int, int]] = []  # (step after which it was applied, fragment)
        self.ended_at: int | None = None  # the step after which ``force`` left one model on every rank
        self.peak_in_flight = 0  # bytes: the most the in-flight exchange held
        self.peak_bytes = 0  # bytes: the most this object held (anchors, momentum, exchange, fp32 outer gradient)

    # ------------------------------------------------------------------ schedule
    def fragment_starting_after(self, step: int) -> int | None:
        """The fragment whose outer all-reduce starts after inner step ``step`` (``None``: none)."""
        n = len(self.fragments)
        stride = self.inner_steps // n
        phase = (step + 1) % self.inner_steps
        for f in range(n):
            if phase == ((f + 1) * stride) % self.inner_steps:
                return f
        return None

    def after_step(self, step: int, force: bool = False) -> bool:
        """After inner step ``step``: complete the in-flight fragment if its τ steps are over, start the next
        one if due. ``force`` (the last step) then ends with one model on every rank (:meth:`end_with_one_model`).
        Returns whether anything was applied."""
        applied = False
        if self.pending is not None and step >= self.pending["start"] + self.overlap_steps:
            self._complete(step)
            applied = True
        f = self.fragment_starting_after(step)
        if f is not None:
            self._start(f, step)
            if self.overlap_steps == 0:
                self._complete(step, merge=False)
                applied = True
        if force:
            self.end_with_one_model(step)
            applied = True
        return applied

    @torch.no_grad()
    def end_with_one_model(self, step: int) -> None:
        """One model on every rank after step ``step`` (the end of a run): the in-flight fragment completes, and every
        fragment updated at this step takes its anchor (no local part kept); every other fragment is averaged over the
        replicas (its anchor becomes that average) — not an extra outer step, whose momentum would push a
        half-finished period as far as a whole one. The run's own state before this (what a continuation needs) is
        the caller's to keep."""
        if self.pending is not None:
            self._complete(step, merge=False)
        done = {frag for s, frag in self.outer_steps if s == step}
        for k in done:
            for i in self.fragments[k]:
                self.params[i].copy_(self.anchors[i].to(self.params[i].dtype))
        for k, idx in enumerate(self.fragments):
            if k not in done:
                self._average(idx)  # fragment by fragment: one fragment's fp32 copy at a time, as an outer step
        self.ended_at = step

    @torch.no_grad()
    def _average(self, indices: list[int]) -> None:
        flat = torch.cat([self.params[i].detach().float().reshape(-1) for i in indices])
        flat.div_(dist.get_world_size(self.group))
        self._note(flat)
        with counting(self.stats, OUTER_ALLREDUCE):
            dist.all_reduce(flat, group=self.group)
        offset = 0
        for i in indices:
            n = self.anchors[i].numel()
            self.anchors[i].copy_(flat[offset : offset + n].view_as(self.anchors[i]))
            self.params[i].copy_(self.anchors[i].to(self.params[i].dtype))
            offset += n

    # ------------------------------------------------------------------ the outer step
    @torch.no_grad()
    def _start(self, f: int, step: int) -> None:
        idx = self.fragments[f]
        flat = torch.cat([(self.anchors[i] - self.params[i].detach().float()).reshape(-1) for i in idx])
        if self.quantized:
            # all-gathered int8 + scales, averaged in fp32 by every rank alike: nothing sums in int8
            with counting(self.stats, OUTER_ALLREDUCE):
                exchange = start_int8_mean(flat, self.group)
            self.pending = {"fragment": f, "start": step, **exchange}
        else:
            # divided before the sum: a half-precision sum of W outer gradients must not overflow
            flat = flat.div_(dist.get_world_size(self.group)).to(self.dtype)
            with counting(self.stats, OUTER_ALLREDUCE):
                work = dist.all_reduce(flat, group=self.group, async_op=True)
            self.pending = {"fragment": f, "start": step, "flat": flat, "work": work}
        self._note()

    @torch.no_grad()
    def _complete(self, step: int, merge: bool = True) -> None:
        self.finish_pending()
        pending, self.pending = self.pending, None
        f = pending["fragment"]
        if "gathered" in pending:  # int8: every rank's packed outer gradient, averaged in rank order
            flat = mean_of_gathered(pending["gathered"], pending["numel"])
        else:
            flat = pending["flat"].float()
        idx = self.fragments[f]
        offset = 0
        for i in idx:
            n = self.anchors[i].numel()
            self.anchors[i].grad = flat[offset : offset + n].view_as(self.anchors[i])
            offset += n
        self.outer.step()
        self._note(*pending.values(), flat)  # the outer step's moment: the exchange, its fp32 mean, the momentum
        for i in idx:
            self.anchors[i].grad = None
            param = self.params[i]
            if merge and self.overlap_steps > 0:
                # the τ inner steps taken while the fragment travelled are kept, weighted by ``mix``
                param.copy_(torch.lerp(self.anchors[i], param.detach().float(), self.mix).to(param.dtype))
            else:
                param.copy_(self.anchors[i].to(param.dtype))
        self.outer_steps.append((step, f))

    def finish_pending(self) -> None:
        """Wait for the in-flight exchange (a checkpoint stores its result, not a handle)."""
        if self.pending is None:
            return
        if "gathered" in self.pending:
            finish_int8_mean(self.pending)
        elif self.pending["work"] is not None:
            self.pending["work"].wait()
            self.pending["work"] = None

    # ------------------------------------------------------------------ memory and checkpoints
    def _momentum(self) -> list[torch.Tensor]:
        return [s["momentum_buffer"] for s in self.outer.state.values() if s.get("momentum_buffer") is not None]

    def _note(self, *extra: Any) -> None:
        """Update the peaks from the tensors held now: anchors, momentum, the exchange in flight, and ``extra``."""
        in_flight = _nbytes((self.pending or {}).values())
        self.peak_in_flight = max(self.peak_in_flight, in_flight)
        held = _nbytes([*self.anchors, *self._momentum(), *(self.pending or {}).values(), *extra])
        self.peak_bytes = max(self.peak_bytes, held)

    def memory_bytes(self) -> dict[str, int]:
        """Extra bytes per rank, from the tensors held (``numel · element_size``): the fp32 anchors (every
        fragment's) and outer momentum now; ``in_flight``: the most an exchange in flight held (fp32/bf16/fp16:
        the fragment's outer gradient; int8: the packed send buffer and every rank's gathered copy); ``peak``: the
        most held at once (an outer step: the above, plus the fragment's averaged outer gradient in fp32).
        PyTorch's own temporaries inside an operation (the outer SGD's, a concatenation's) are not in it."""
        return {"anchors": _nbytes(self.anchors), "outer_momentum": _nbytes(self._momentum()),
                "in_flight": self.peak_in_flight, "peak": self.peak_bytes}

    def state_dict(self) -> dict[str, Any]:
        """Anchors, outer optimizer, the in-flight fragment's averaged outer gradient (identical on every rank;
        int8: every rank's packed buffer, which every rank averages alike)."""
        self.finish_pending()
        pending = None
        if self.pending is not None:
            kept = ("gathered", "numel") if "gathered" in self.pending else ("flat",)
            pending = {k: self.pending[k] for k in ("fragment", "start")} | {
                k: self.pending[k].clone() if isinstance(self.pending[k], torch.Tensor) else self.pending[k] for k in kept}
        return {"anchors": [a.detach().clone() for a in self.anchors], "outer": self.outer.state_dict(),
                "pending": pending, "outer_steps": list(self.outer_steps),
                "layout": {"inner_steps": self.inner_steps, "fragments": len(self.fragments),
                           "overlap_steps": self.overlap_steps}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = {"inner_steps": self.inner_steps, "fragments": len(self.fragments), "overlap_steps": self.overlap_steps}
        if state["layout"] != mine:
            raise ValueError(f"the checkpoint's DiLoCo schedule {state['layout']} differs from this run's {mine}")
        with torch.no_grad():
            for anchor, saved in zip(self.anchors, state["anchors"], strict=True):
                anchor.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        pending = state["pending"]
        self.pending = None if pending is None else {**pending, "work": None}
        self.outer_steps = [tuple(s) for s in state["outer_steps"]]

    @torch.no_grad()
    def swap_in_anchors(self) -> list[torch.Tensor]:
        """Put the global parameters in the model (validation); returns the local ones for :meth:`swap_back`."""
        local = [p.detach().clone() for p in self.params]
        for p, a in zip(self.params, self.anchors):
            p.copy_(a.to(p.dtype))
        return local

    @torch.no_grad()
    def swap_back(self, local: list[torch.Tensor]) -> None:
        for p, saved in zip(self.params, local):
            p.copy_(saved)
