"""Where a training step's time goes, from ``torch.profiler`` on rank 0 (bench only, for issue 23's ZeRO-3 analysis).

:class:`StepProfile` is a Lightning callback: it profiles (CPU activity, main thread) optimizer steps
``start`` .. ``start + steps - 1`` of rank 0 and sorts every op's *self* time into a category, by the op itself
or by its nearest labelled ancestor (FSDP2 labels its work with ``record_function("FSDP::...")``):

- ``all-gather wait`` / ``reduce-scatter wait`` / ``all-reduce``: the time inside the Python collective calls
  (``torch.distributed.all_gather_single``, ``all_to_all_single``, ... — wrapped in ``record_function("comm::...")``
  while profiling, wherever a module holds them by name). On CPU/gloo FSDP2 calls them synchronously, so this is
  the time spent waiting for the peer and the wire. DDP's all-reduce is launched and waited for inside its C++
  reducer: for ``strategy=ddp`` that wait falls in ``compute``; with ``Fsdp2Tuning(async_unshard=True)`` the
  all-gather wait moves into FSDP's ``work.wait()`` (``FSDP::all_gather_copy_out``, counted as FSDP host);
- ``FSDP copies``: copy-in / copy-out / chunk / cat / sum / zero-fill ops inside an ``FSDP::`` region;
- ``FSDP host (Python, DTensor, hooks)``: the rest of the self time of ``FSDP::`` regions — Python between ops;
- ``compute``: every other op;
- ``outside ops (loop, Python)``: wall time of the profiled steps not inside any op (Lightning's loop, hooks).

and into a phase, by its nearest label: ``forward`` (the strategy's ``training_step``, labelled while profiling),
``backward`` (the strategy's ``backward``), ``optimizer`` (``Optimizer.step#...`` outside those two: the AdamW
update, on DTensor shards for stage 3, DTensor dispatch included), ``zero_grad``, ``other``.

Writes ``out/step_profile_rank0.json`` (ms per step per kind and phase, shares of the profiled wall time, the 25
largest labels by self time) and prints the kind × phase table. The profiler adds a few µs per op: shares, not
absolute times, are the point.

    python train.py strategy=zero strategy.stage=3 trainer.devices=2 trainer.max_steps=30 ... \\
        '+callbacks={prof:{_target_:bench.step_profile.StepProfile,out:/tmp/prof,start:10,steps:20}}'

:class:`Fsdp2Tuning` (same file) changes a ``strategy=zero stage=3`` model's FSDP2 settings at the start of
training, to measure what a setting would save before the strategy offers it: ``root_reshard`` (``False``: the
root unit keeps its parameters from forward to backward, FSDP2's own default for the root), ``async_unshard``
(all-gathers issued asynchronously), ``forward_prefetch`` / ``backward_prefetch`` (explicit: block i+1 in forward,
block i-1 in backward).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

COPY_OPS = ("copy", "cat", "split", "chunk", "sum", "zero", "fill", "div", "view", "empty", "as_strided", "narrow", "resize", "set_")
KINDS = ("compute", "all-gather wait", "reduce-scatter wait", "all-reduce", "FSDP copies", "FSDP host (Python, DTensor, hooks)")
OUTSIDE = "outside ops (loop, Python)"
COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_to_all_single", "reduce_scatter_single",
               "reduce_scatter_tensor", "all_reduce", "broadcast")


def wrap_collectives() -> list[tuple[Any, str, Any]]:
    """Wrap torch.distributed's collectives in ``record_function("comm::NAME")`` in every module of torch.distributed
    and parallelkit that holds them by name; return what to restore."""
    import sys

    import torch.distributed as dist
    from torch.profiler import record_function

    def wrapped(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            with record_function(f"comm::{name}"):
                return fn(*args, **kwargs)
        return call

    originals = {id(getattr(dist, n)): (n, getattr(dist, n)) for n in COLLECTIVES if hasattr(dist, n)}
    replacements = {key: wrapped(n, fn) for key, (n, fn) in originals.items()}
    undo = []
    for mod_name, module in list(sys.modules.items()):
        if module is None or not mod_name.startswith(("torch.distributed", "parallelkit")):
            continue
        for attr, value in list(vars(module).items()):
            if id(value) in replacements and value is originals[id(value)][1]:
                undo.append((module, attr, value))
                setattr(module, attr, replacements[id(value)])
    return undo


def _collective(name: str) -> str | None:
    n = name.lower()
    if not n.startswith("comm::"):
        return None
    if "allgather" in n or "all_gather" in n:
        return "all-gather wait"
    if "alltoall" in n or "all_to_all" in n or "reduce_scatter" in n:
        return "reduce-scatter wait"
    if "allreduce" in n or "all_reduce" in n:
        return "all-reduce"
    return "all-reduce" if "barrier" not in n else None


PHASES = ("forward", "backward", "optimizer", "zero_grad", "other")


def categorize(event: Any) -> tuple[str, str]:
    """(phase, kind) of one op's self time: the phase from the nearest ``step::``/``Optimizer.`` label above it, the
    kind from the op itself (a collective), or its nearest ``FSDP::`` label (copy or host), else compute."""
    kind = None
    phase = None
    node = event
    while node is not None and phase is None:
        name = node.name
        if kind is None:
            kind = _collective(name)  # the op itself, or a collective call it runs inside (c10d's own op)
        if kind is None and name.startswith("FSDP::"):
            copy = event is not node and event.name.startswith("aten::") and any(k in event.name for k in COPY_OPS)
            kind = "FSDP copies" if copy else "FSDP host (Python, DTensor, hooks)"
        if name == "step::forward":
            phase = "forward"
        elif name == "step::backward":
            phase = "backward"
        elif name.startswith("Optimizer.step"):
            phase = "optimizer"
        elif name.startswith("Optimizer.zero_grad"):
            phase = "zero_grad"
        node = node.cpu_parent
    return phase or "other", kind or "compute"


def _labelled(label: str, fn: Any) -> Any:
    from torch.profiler import record_function

    def call(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return fn(*args, **kwargs)
    return call


class StepProfile(Callback):
    """Profile rank 0's optimizer steps ``start`` .. ``start + steps - 1`` and write the categories.

    Args:
        out: directory for ``step_profile_rank0.json``.
        start: first profiled optimizer step (0-based; later steps leave warm-up out).
        steps: number of profiled steps.
    """

    def __init__(self, out: str, start: int = 10, steps: int = 20) -> None:
        if start < 0 or steps < 1:
            raise ValueError(f"StepProfile needs start >= 0 and steps >= 1. Got start={start}, steps={steps}.")
        self.out, self.start, self.steps = Path(out), start, steps
        self._prof: Any = None
        self._t0 = 0.0
        self._done = False
        self._undo: list[tuple[Any, str, Any]] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_rank != 0 or self._prof is not None or self._done or trainer.global_step != self.start:
            return
        import torch.profiler as tp

        self._undo = wrap_collectives()
        # Lightning runs forward and backward inside the optimizer's step (closure): label them to tell them apart.
        strategy = trainer.strategy
        for attr, label in (("training_step", "step::forward"), ("backward", "step::backward")):
            self._undo.append((strategy, attr, None))
            setattr(strategy, attr, _labelled(label, getattr(strategy, attr)))
        self._prof = tp.profile(activities=[tp.ProfilerActivity.CPU])
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._prof is None or trainer.global_step < self.start + self.steps:
            return
        wall = time.perf_counter() - self._t0
        self._prof.__exit__(None, None, None)
        for module, attr, value in reversed(self._undo):
            if value is None:
                delattr(module, attr)  # an instance attribute shadowing the class's method
            else:
                setattr(module, attr, value)
        self._write(self._prof, wall)
        self._prof, self._done = None, True

    def _write(self, prof: Any, wall: float) -> None:
        import threading

        events = [e for e in prof.events() if e.device_type.name == "CPU"]
        main = threading.get_native_id()
        threads = {e.thread for e in events}
        on_main = [e for e in events if e.thread == main] if main in threads else events
        cells: dict[tuple[str, str], float] = defaultdict(float)
        by_label: dict[str, float] = defaultdict(float)
        cell_labels: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
        for e in on_main:
            cell = categorize(e)
            cells[cell] += e.self_cpu_time_total / 1e3 / self.steps  # ms per step
            by_label[e.name] += e.self_cpu_time_total / 1e3 / self.steps
            cell_labels[cell][e.name] += e.self_cpu_time_total / 1e3 / self.steps
        step_ms = wall * 1e3 / self.steps
        top_level = sum(e.cpu_time_total for e in on_main if e.cpu_parent is None) / 1e3 / self.steps
        by_kind = {k: sum(v for (_, kind), v in cells.items() if kind == k) for k in KINDS}
        by_kind[OUTSIDE] = max(0.0, step_ms - top_level)
        by_phase = {p: sum(v for (phase, _), v in cells.items() if phase == p) for p in PHASES}
        result = {
            "steps": self.steps, "start": self.start, "wall_ms_per_step": step_ms,
            "ms_per_step_by_kind": by_kind, "share_by_kind": {k: v / step_ms for k, v in by_kind.items()},
            "ms_per_step_by_phase": by_phase,
            "ms_per_step_by_phase_and_kind": {f"{p} / {k}": v for (p, k), v in sorted(cells.items(), key=lambda kv: -kv[1])},
            "top_labels_self_ms_per_step": dict(sorted(by_label.items(), key=lambda kv: -kv[1])[:25]),
            "top_labels_by_phase_and_kind": {f"{p} / {k}": dict(sorted(v.items(), key=lambda kv: -kv[1])[:6]) for (p, k), v in cell_labels.items()},
        }
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "step_profile_rank0.json").write_text(json.dumps(result, indent=1))
        print(f"step profile, rank 0, {self.steps} steps, {step_ms:.1f} ms/step", flush=True)
        header = f"  {'':38s}" + "".join(f"{p:>11s}" for p in PHASES) + f"{'total':>11s}{'share':>8s}"
        print(header, flush=True)
        for k in KINDS:
            row = "".join(f"{cells.get((p, k), 0.0):11.2f}" for p in PHASES)
            print(f"  {k:38s}{row}{by_kind[k]:11.2f}{by_kind[k] / step_ms:8.1%}", flush=True)
        print(f"  {OUTSIDE:38s}{'':55s}{by_kind[OUTSIDE]:11.2f}{by_kind[OUTSIDE] / step_ms:8.1%}", flush=True)


class Fsdp2Tuning(Callback):
    """Change the FSDP2 settings of a stage-3 model at the start of training (an experiment, not a feature).

    Args:
        root_reshard: ``False`` keeps the root unit gathered from forward to backward (FSDP2's root default).
        async_unshard: issue all-gathers with ``async_op=True`` (gloo runs them on its own thread).
        forward_prefetch: each block prefetches the next block's all-gather in forward.
        backward_prefetch: each block prefetches the previous block's all-gather in backward (explicit).
    """

    def __init__(self, root_reshard: bool | None = None, async_unshard: bool = False, forward_prefetch: bool = False,
                 backward_prefetch: bool = False) -> None:
        self.root_reshard, self.async_unshard = root_reshard, async_unshard
        self.forward_prefetch, self.backward_prefetch = forward_prefetch, backward_prefetch

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        from torch.distributed.fsdp import FSDPModule

        model = getattr(pl_module, "parallel_model", pl_module)
        if not isinstance(model, FSDPModule):
            raise TypeError("Fsdp2Tuning needs strategy=zero strategy.stage=3 (the model is not an FSDP2 root).")
        blocks = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
        if self.root_reshard is not None:
            model.set_reshard_after_forward(self.root_reshard, recurse=False)
        if self.async_unshard:
            model._set_unshard_async_op(True)
        if self.forward_prefetch and blocks:
            model.set_modules_to_forward_prefetch([blocks[0]])
        if self.backward_prefetch and blocks:
            model.set_modules_to_backward_prefetch([blocks[-1]])
        for i, block in enumerate(blocks):
            if self.forward_prefetch and i + 1 < len(blocks):
                block.set_modules_to_forward_prefetch([blocks[i + 1]])
            if self.backward_prefetch and i > 0:
                block.set_modules_to_backward_prefetch([blocks[i - 1]])
