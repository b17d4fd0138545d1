"""Pipeline parallelism: consecutive stages on consecutive ranks, micro-batches through a schedule.

:func:`apply_pp` turns this rank's stage modules (cut by the model's ``parallelize.py``) into
``torch.distributed.pipelining`` stages and a schedule (GPipe, 1F1B, interleaved 1F1B, zero bubble), and
instruments them: every forward/backward is timed (the measured bubble is the share of a step's wall
time a rank does not compute), the micro-batches whose activations a stage holds are counted, the bytes
saved for backward are metered, and every activation/gradient a rank sends or receives is counted in
``comm_stats`` (kind ``pp_p2p``: the schedule's sends and receives, claimed at the collective boundary by
:func:`~parallelkit.distributed.comm_counting.counting`; other collectives inside a stage, e.g. tensor
parallel's, keep their own kinds).
With ``trace=True`` the start/end of every compute and of every wait on a send/recv is recorded for the
timeline picture (:mod:`parallelkit.tools.pipeline_timeline`).

The schedule runs forward and backward itself; the caller gets the mean micro-batch loss on the last
stage (gradients are divided by the micro-batch count, so they are those of the whole batch's mean loss).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from parallelkit.distributed.comm_counting import counting
from parallelkit.distributed.comm_stats import CommStats
from parallelkit.errors import ConfigError

PP_P2P = "pp_p2p"


@dataclass(frozen=True)
class ScheduleSpec:
    """How a schedule name maps onto ``torch.distributed.pipelining``."""

    class_name: str
    multi_stage: bool  # several (virtual) stages per rank
    placement: str  # "loop": stage s on rank s % P; "v": V-shape (rank r holds r and 2P-1-r)
    needs_m_ge_p: bool


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec("ScheduleGPipe", False, "loop", False),
    "1f1b": ScheduleSpec("Schedule1F1B", False, "loop", True),
    "interleaved_1f1b": ScheduleSpec("ScheduleInterleaved1F1B", True, "loop", False),
    "zero_bubble": ScheduleSpec("ScheduleInterleavedZeroBubble", True, "loop", False),
    "zbv": ScheduleSpec("ScheduleZBVZeroBubble", True, "v", True),
}


# ---------------------------------------------------------------------------------------- validation
def default_virtual_stages(schedule: str) -> int:
    return 2 if SCHEDULES.get(schedule, SCHEDULES["gpipe"]).multi_stage else 1


def check_pipeline_config(pp: int, microbatches: int, schedule: str, virtual_stages: int) -> None:
    """Reject schedule settings that cannot work, naming the numbers (before any process starts)."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"strategy.schedule={schedule!r} is not a pipeline schedule. Use one of {', '.join(SCHEDULES)}.")
    for name, value in (("strategy.microbatches", microbatches), ("strategy.virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} should be an int greater than 0. Got {value!r}.")
    spec = SCHEDULES[schedule]
    if not spec.multi_stage and virtual_stages != 1:
        raise ConfigError(
            f"strategy.schedule={schedule} runs one stage per rank, but strategy.virtual_stages={virtual_stages}. "
            "Use strategy.schedule=interleaved_1f1b or zero_bubble for virtual stages, or virtual_stages=1."
        )
    if schedule == "zbv" and virtual_stages != 2:
        raise ConfigError(f"strategy.schedule=zbv runs exactly 2 stages per rank (a V), but strategy.virtual_stages={virtual_stages}.")
    stages = pp * virtual_stages
    if spec.needs_m_ge_p and microbatches < stages:
        raise ConfigError(
            f"strategy.schedule={schedule} needs at least as many micro-batches as pipeline stages: "
            f"strategy.microbatches={microbatches} < {stages} stages (pp={pp} × virtual_stages={virtual_stages}). "
            f"Use strategy.microbatches>={stages}, or strategy.schedule=gpipe."
        )
    if spec.multi_stage and spec.placement == "loop":
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ConfigError(
                f"strategy.schedule={schedule} runs micro-batches in rounds of pp={pp}: strategy.microbatches="
                f"{microbatches} must be a multiple of the {rounds} rounds (e.g. {rounds * pp} or a multiple of {pp})."
            )


def check_microbatch_split(batch_size: int, microbatches: int, what: str = "the per-rank batch") -> None:
    """A batch must cut into equal micro-batches, or the mean over micro-batch means is not the batch mean."""
    if batch_size % microbatches:
        raise ConfigError(
            f"{what} of {batch_size} samples cannot be split into strategy.microbatches={microbatches} equal "
            f"micro-batches. Use a micro-batch count that divides {batch_size}, or a batch that is a multiple of "
            f"{microbatches} (data.global_batch_size = dp × accumulate × a multiple of {microbatches})."
        )


def stage_blocks(num_blocks: int, num_stages: int, split: list[int] | None = None) -> list[range]:
    """Blocks of every stage: balanced (the first stages get one more when uneven), or cut at ``split``.

    ``split`` lists the first block of stages 1..S-1 (torch's "split points"): ``[3]`` for 2 stages of a
    4-block model gives blocks 0-2 and 3.
    """
    if num_stages > num_blocks:
        raise ConfigError(
            f"The pipeline has {num_stages} stages but the model has only {num_blocks} blocks to distribute; every "
            f"stage needs at least one. Use strategy.pp × strategy.virtual_stages <= {num_blocks}, or a deeper model."
        )
    if split is None:
        base, extra = divmod(num_blocks, num_stages)
        starts = [s * base + min(s, extra) for s in range(num_stages)] + [num_blocks]
    else:
        split = [int(v) for v in split]
        if len(split) != num_stages - 1 or any(b <= a for a, b in zip([0, *split], [*split, num_blocks])):
            raise ConfigError(
                f"strategy.split={split} must list the first block of stages 1..{num_stages - 1}: {num_stages - 1} "
                f"strictly increasing block indices between 1 and {num_blocks - 1} (the model has {num_blocks} blocks), "
                f"e.g. {[round(num_blocks * s / num_stages) for s in range(1, num_stages)]}."
            )
        starts = [0, *split, num_blocks]
    return [range(a, b) for a, b in zip(starts[:-1], starts[1:])]


def stage_ids_for_rank(pp_rank: int, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """The (virtual) stages rank ``pp_rank`` of the pipeline runs, in order."""
    if SCHEDULES[schedule].placement == "v":  # 0 → P-1 down, then P-1 → 0 back: rank r holds r and 2P-1-r
        return sorted(s for s in range(pp * virtual_stages) if (s if (s // pp) % 2 == 0 else pp - 1 - s % pp) % pp == pp_rank)
    return [pp_rank + v * pp for v in range(virtual_stages)]


# ---------------------------------------------------------------------------------------- measurement
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


def _instrument_stage(stage: Any, stats: PipelineStats, meter: SavedActivationMeter) -> None:
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


_OP_LABELS: dict[int, str] = {}


def _labelled_ops(get_ops: Callable[[int], list], label: str) -> Callable:
    def wrapper(mb: int) -> list:
        ops = get_ops(mb)
        for op in ops:
            _OP_LABELS[id(op)] = f"{label.replace('_ops', '')} mb{mb}"
        return ops

    return wrapper


@contextlib.contextmanager
def _traced_waits(stats: PipelineStats) -> Iterator[None]:
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


def _is_activation(tensor: Any) -> bool:
    return tensor is not None and (tensor.is_floating_point() or tensor.is_complex())


# ---------------------------------------------------------------------------------------- the pipeline
@dataclass
class PipelineParallel:
    """This rank's part of a pipeline: its stages, the schedule, and what it measured.

    Example::

        pipe = apply_pp(stages, stage_ids, num_stages=4, group=mesh.get_group("pp"), microbatches=8,
                        schedule="1f1b", loss_fn=model.loss, device=torch.device("cpu"))
        loss = pipe.train_step(inputs, targets)   # the batch's mean loss on the last stage, else None
    """

    schedule: Any
    stages: list[Any]
    stage_ids: list[int]
    num_stages: int
    microbatches: int
    schedule_name: str
    stats: PipelineStats
    meter: SavedActivationMeter
    comm_stats: CommStats | None = None

    def _counted(self) -> Any:
        # A receive writes too: on gloo the receiver announces it is ready (a 48-byte message). The stages'
        # tensor metadata (torch's shape inference: pickled objects, byte and integer tensors, at the first
        # step and again after each validation pass) is not a step's traffic: claimed, not counted.
        return counting(self.comm_stats, PP_P2P, ops=("send", "recv"), count_if=_is_activation)

    @property
    def holds_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stage_ids

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of every micro-batch; gradients accumulate into the stages' ``.grad``."""
        losses: list[torch.Tensor] = []
        self.stats.begin_step()
        try:
            with _traced_waits(self.stats) if self.stats.trace else contextlib.nullcontext(), self._counted():
                self.schedule.step(*self._args(inputs), target=targets if self.holds_last_stage else None, losses=losses, return_outputs=False)
        finally:
            self.stats.end_step()
        return torch.stack([loss.detach() for loss in losses]).mean() if self.holds_last_stage else None

    @torch.no_grad()
    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward only (the schedule's eval path); the mean loss on the last stage, else None."""
        losses: list[torch.Tensor] = []
        with self._counted():
            self.schedule.eval(*self._args(inputs), target=targets if self.holds_last_stage else None, losses=losses)
        return torch.stack(losses).mean() if self.holds_last_stage else None

    def _args(self, inputs: torch.Tensor) -> tuple:
        return (inputs,) if self.holds_first_stage else ()


def apply_pp(
    stage_modules: list[nn.Module],
    stage_ids: list[int],
    num_stages: int,
    group: Any,
    *,
    microbatches: int,
    schedule: str,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
    comm_stats: CommStats | None = None,
    trace: bool = False,
    scale_grads: bool = True,
) -> PipelineParallel:
    """Wrap this rank's stage modules in ``PipelineStage`` objects and build the schedule.

    Args:
        stage_modules: one module per local stage (from the model's ``pipeline_stages`` plan).
        stage_ids: their global stage indices (:func:`stage_ids_for_rank`).
        num_stages: stages in the whole pipeline (``pp × virtual_stages``).
        group: the pipeline process group (the ``pp`` mesh axis).
        microbatches: micro-batches per step; ``loss_fn`` must return the mean over a micro-batch.
        schedule: a key of :data:`SCHEDULES`.
        loss_fn: ``(outputs, targets) -> loss`` on the last stage.
        comm_stats: counts activations and gradients this rank sends (kind ``pp_p2p``).
        trace: keep the start/end of every compute and send/recv wait, per step.
        scale_grads: divide gradients by ``microbatches`` (mean loss); off only to test that it matters.
    """
    from torch.distributed import pipelining

    spec = SCHEDULES[schedule]
    pp = dist.get_world_size(group)
    check_pipeline_config(pp, microbatches, schedule, num_stages // pp)
    stages = [pipelining.PipelineStage(m, s, num_stages, device, group=group) for m, s in zip(stage_modules, stage_ids)]
    params = [p for m in stage_modules for p in m.parameters()]
    stats, meter = PipelineStats(trace=trace), SavedActivationMeter(params)
    for stage in stages:
        _instrument_stage(stage, stats, meter)
    schedule_cls = getattr(pipelining, spec.class_name)
    built = schedule_cls(stages if spec.multi_stage else stages[0], microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    return PipelineParallel(built, stages, list(stage_ids), num_stages, microbatches, schedule, stats, meter, comm_stats)


def theoretical_bubble(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """(P−1)/(V·M+P−1): idle share of a fill-drain pipeline with equal per-stage costs."""
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)
