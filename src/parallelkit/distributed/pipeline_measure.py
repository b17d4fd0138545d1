"""How a pipeline rank measures itself: compute spans and the bubble, in-flight micro-batches, the bytes of
activations autograd keeps, and (``trace=True``) every wait on a send/receive for the timeline picture.

:func:`instrument_stage` wraps one ``torch.distributed.pipelining`` stage object's compute and send/receive
op getters (instance attributes: nothing global changes); :func:`time_the_loss` counts the last stage's loss,
which the schedules compute outside the stage's forward, as its compute; :func:`traced_waits` times the
schedules' waits while a traced step runs; :func:`label_actions_only_under_a_profiler` keeps torch's per-action
profiler labels from costing time when no profiler records.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

def _memory_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that owns the memory: a DTensor's (tensor parallel inside a stage) is its local shard, and a
    functional collective's result not yet waited on (``AsyncCollectiveTensor``, storage-less) wraps it."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    memory = getattr(tensor, "_local_tensor", tensor)
    return memory.elem if isinstance(memory, AsyncCollectiveTensor) else memory


class SavedActivationMeter:
    """Bytes of tensors autograd keeps for backward (activations), live and peak, parameters excluded.

    A region of memory is counted once however many saved tensors view it (keyed by address and size:
    a micro-batch is a view into the whole batch and counts its own bytes, not the batch's); it is
    released when autograd drops the last reference (after that micro-batch's backward).
    """

    def __init__(self, params: list[torch.Tensor]) -> None:
        self._param_storages = {_memory_of(p).untyped_storage().data_ptr() for p in params}
        self._refs: dict[tuple[int, int], list[int]] = {}
        self.live = 0
        self.peak = 0

    def pack(self, tensor: torch.Tensor) -> Any:
        memory = _memory_of(tensor)  # what to key on; the saved object stays the tensor itself
        if memory.untyped_storage().data_ptr() in self._param_storages or memory.data_ptr() == 0:
            return tensor
        key = (memory.data_ptr(), memory.numel() * memory.element_size())
        entry = self._refs.get(key)
        if entry is None:
            entry = self._refs[key] = [0, key[1]]
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        return _Saved(tensor, key, self)

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def release(self, key: tuple[int, int]) -> None:
        entry = self._refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[key]

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Saved:
    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor: torch.Tensor, key: tuple[int, int], meter: SavedActivationMeter) -> None:
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter.release(self.key)


@dataclass
class PipelineStats:
    """What a rank measured: compute spans, in-flight micro-batches, activation bytes, bubble.

    Per step, ``step_active`` is the time from this rank's first compute to its last: on the rank that
    runs the first stage this is the pipeline's whole fill-compute-drain makespan (it starts first and
    finishes last). Time before a step's first compute (waiting for the other ranks to leave the
    previous optimizer step) is not pipeline bubble and is not counted; ``step_walls`` keeps it.
    """

    trace: bool = False
    step_walls: list[float] = field(default_factory=list)  # seconds inside each schedule step
    step_active: list[float] = field(default_factory=list)  # seconds from the first compute to the last
    step_busy: list[float] = field(default_factory=list)  # seconds of compute in each step
    inflight: dict[int, int] = field(default_factory=dict)  # stage → micro-batches holding activations now
    peak_inflight: dict[int, int] = field(default_factory=dict)
    events: list[list[dict[str, Any]]] = field(default_factory=list)  # per traced step (trace=True)
    _busy: float = 0.0
    _first: float | None = None
    _last: float = 0.0
    _step_start: float = 0.0
    _in_step: bool = False  # training steps only: evaluation forwards are not part of the schedule's timeline

    def compute(self, kind: str, stage: int, mb: int, start: float, end: float) -> None:
        if not self._in_step:
            return
        self._busy += end - start
        self._first = start if self._first is None else self._first
        self._last = end
        if self.trace:
            self.events[-1].append({"kind": kind, "stage": stage, "mb": mb, "start": start, "end": end})

    def wait(self, label: str, start: float, end: float) -> None:
        if self.trace and self._in_step:
            self.events[-1].append({"kind": "wait", "label": label, "start": start, "end": end})

    def begin_step(self) -> None:
        self._busy, self._first, self._last = 0.0, None, 0.0
        if self.trace:
            self.events.append([])
        self._in_step = True
        self._step_start = time.perf_counter()

    def end_step(self) -> None:
        self._in_step = False
        self.step_walls.append(time.perf_counter() - self._step_start)
        self.step_active.append(0.0 if self._first is None else self._last - self._first)
        self.step_busy.append(self._busy)

    def add_inflight(self, stage: int, delta: int) -> None:
        now = self.inflight.get(stage, 0) + delta
        self.inflight[stage] = now
        self.peak_inflight[stage] = max(self.peak_inflight.get(stage, 0), now)

    def bubble_fraction(self, spans: list[float] | None = None, skip_first: int = 1) -> float | None:
        """Share of the pipeline's step time this rank did not compute, over the steps after the first.

        ``spans``: each step's pipeline time, the longest ``step_active`` of its ranks
        (:func:`pipeline_spans`). A rank's own active time is not the pipeline's: the last stage starts
        late and finishes early, so its own clock would hide most of its bubble.
        """
        spans = self.step_active if spans is None else spans
        first = skip_first if len(spans) > skip_first else 0
        wall = sum(spans[first:])
        return None if wall <= 0 else 1.0 - sum(self.step_busy[first:]) / wall


def pipeline_spans(active_by_rank: list[list[float]]) -> list[float]:
    """Each step's pipeline time: the longest first-to-last-compute time of any pipeline rank."""
    return [max(step) for step in zip(*active_by_rank)]


def instrument_stage(stage: Any, stats: PipelineStats, meter: SavedActivationMeter) -> None:
    """Wrap this stage object's compute and send methods (instance attributes: nothing global changes)."""
    index = stage.stage_index
    clock = time.perf_counter
    forward, backward, backward_weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

    def forward_one_chunk(mb: int, *args: Any, **kwargs: Any) -> Any:
        start = clock()
        with meter.hooks():
            out = forward(mb, *args, **kwargs)
        stats.compute("F", index, mb, start, clock())
        if stage.has_backward:
            stats.add_inflight(index, 1)
        return out

    def backward_one_chunk(mb: int, *args: Any, full_backward: bool = True, **kwargs: Any) -> Any:
        start = clock()
        out = backward(mb, *args, full_backward=full_backward, **kwargs)
        stats.compute("B" if full_backward else "I", index, mb, start, clock())
        if full_backward and stage.has_backward:
            stats.add_inflight(index, -1)
        return out

    def backward_weight_one_chunk(mb: int, *args: Any, **kwargs: Any) -> Any:
        start = clock()
        out = backward_weight(mb, *args, **kwargs)
        stats.compute("W", index, mb, start, clock())
        if stage.has_backward:
            stats.add_inflight(index, -1)  # the micro-batch's saved state is gone only after W
        return out

    stage.forward_one_chunk = forward_one_chunk
    stage.backward_one_chunk = backward_one_chunk
    stage.backward_weight_one_chunk = backward_weight_one_chunk
    if stats.trace:  # names for the timeline's waits
        for name in ("get_fwd_send_ops", "get_bwd_send_ops", "get_fwd_recv_ops", "get_bwd_recv_ops"):
            setattr(stage, name, _labelled_ops(getattr(stage, name), f"{name[4:]}[s{index}]"))


def time_the_loss(schedule: Any, stats: PipelineStats) -> None:
    """The last stage's loss is its compute too (the schedules run it outside ``forward_one_chunk``): kind ``L``."""
    compute_loss = schedule._maybe_compute_loss

    def maybe_compute_loss(stage: Any, output: Any, target_mbs: Any, mb_index: int, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = compute_loss(stage, output, target_mbs, mb_index, *args, **kwargs)
        if stage.is_last and target_mbs is not None:
            stats.compute("L", stage.stage_index, mb_index, start, time.perf_counter())
        return out

    schedule._maybe_compute_loss = maybe_compute_loss


_OP_LABELS: dict[int, str] = {}


def _labelled_ops(get_ops: Callable[[int], list], label: str) -> Callable:
    def wrapper(mb: int) -> list:
        ops = get_ops(mb)
        for op in ops:
            _OP_LABELS[id(op)] = f"{label.replace('_ops', '')} mb{mb}"
        return ops

    return wrapper


@contextlib.contextmanager
def traced_waits(stats: PipelineStats) -> Iterator[None]:
    """Time every wait on a send/recv while a traced step runs (the schedules call these module helpers)."""
    from torch.distributed.pipelining import schedules

    batch_p2p, wait_batch_p2p = schedules._batch_p2p, schedules._wait_batch_p2p
    labels: dict[int, str] = {}

    def traced_batch(ops: list, *args: Any, **kwargs: Any) -> list:
        works = batch_p2p(ops, *args, **kwargs)
        labels[id(works)] = " + ".join(_OP_LABELS.pop(id(op), "p2p") for op in ops)
        return works

    def traced_wait(works: list) -> None:
        start = time.perf_counter()
        wait_batch_p2p(works)
        if works:
            stats.wait(labels.pop(id(works), "p2p"), start, time.perf_counter())

    schedules._batch_p2p, schedules._wait_batch_p2p = traced_batch, traced_wait
    try:
        yield
    finally:
        schedules._batch_p2p, schedules._wait_batch_p2p = batch_p2p, wait_batch_p2p
        _OP_LABELS.clear()


def label_actions_only_under_a_profiler() -> None:
    """torch's schedules wrap every action (compute, send, receive) in ``record_function``: two dispatcher
    operators and a ``RecordFunction`` object each, ~40 µs per action right after an idle wait, when no profiler
    records anything. Measured on the bench's interleaved 1F1B (P=2, M=4, 46 actions per rank and step): 1.7 ms of
    a 700 ms step, 2.2 points of the bubble's error. The labels are kept whenever a profiler runs
    (``torch.profiler.profile`` or the autograd profiler); process-wide and idempotent."""
    from torch.distributed.pipelining import schedules

    if getattr(schedules.record_function, "only_under_a_profiler", False):
        return
    label = schedules.record_function

    def record_function(name: str, args: str | None = None) -> Any:
        return label(name, args) if torch.autograd._profiler_enabled() else contextlib.nullcontext()

    record_function.only_under_a_profiler = True  # type: ignore[attr-defined]
    schedules.record_function = record_function
