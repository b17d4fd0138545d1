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
timeline picture (:mod:`parallelkit.tools.pipeline_timeline`); the measuring is
:mod:`~parallelkit.distributed.pipeline_measure`'s. Each step's receives are posted ahead, so that hand-offs
arrive while a stage computes (:mod:`~parallelkit.distributed.pipeline_recv_ahead`). A hand-off may be a DTensor
(tensor parallel with sequence parallel: the sequence shard with its layout); only its local shard travels,
and the stages find its mesh among their own (:func:`dtensor_mesh_lookup`).

The schedule runs forward and backward itself; the caller gets the mean micro-batch loss on the last
stage (gradients are divided by the micro-batch count, so they are those of the whole batch's mean loss).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from parallelkit.distributed.comm_counting import counting
from parallelkit.distributed.comm_stats import CommStats
from parallelkit.distributed.pipeline_measure import (  # noqa: F401 (PipelineStats, pipeline_spans: part of this module's API)
    PipelineStats,
    SavedActivationMeter,
    instrument_stage,
    label_actions_only_under_a_profiler,
    pipeline_spans,
    time_the_loss,
    traced_waits,
)
from parallelkit.distributed.pipeline_recv_ahead import RecvAhead
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


def _is_activation(tensor: Any) -> bool:
    return tensor is not None and (tensor.is_floating_point() or tensor.is_complex())


def dtensor_mesh_lookup(stage_modules: list[nn.Module]) -> Callable[[tuple[str, ...], Any], Any]:
    """The ``get_mesh`` callback of this rank's ``PipelineStage`` s: the device mesh a received DTensor lives on.

    A hand-off may be a DTensor (sequence parallel: the sequence shard, with its layout, see
    :func:`~parallelkit.distributed.tensor_parallel.sequence_parallel_blocks`). ``torch.distributed.pipelining``
    sends its local shard and, once, its metadata, which names the mesh by dimension names and layout only; the
    receiver must map that back to its own mesh object (else: "Mesh not found in cache"). Those are the meshes
    its stages' DTensor parameters live on (tensor parallel's; FSDP2's 2-D ones) or a sub-mesh of their root.
    """
    candidates: list[Any] = []
    for module in stage_modules:
        for param in module.parameters():
            mesh = getattr(param, "device_mesh", None)
            if mesh is None:
                continue
            for found in (mesh, mesh._get_root_mesh()):
                if all(found is not c for c in candidates):
                    candidates.append(found)

    def get_mesh(dim_names: tuple[str, ...], layout: Any) -> Any:
        names = tuple(dim_names)
        for mesh in candidates:
            own = tuple(mesh.mesh_dim_names or ())
            if own == names and mesh._layout == layout:
                return mesh
            if names and set(names) <= set(own):
                try:
                    sub = mesh[names[0] if len(names) == 1 else names]
                except (KeyError, RuntimeError, ValueError):
                    continue
                if sub._layout == layout:
                    return sub
        return None  # pipelining names the mesh it could not find

    return get_mesh


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
    recv_ahead: RecvAhead | None
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
        if self.recv_ahead is not None:
            self.recv_ahead.begin_step()
        try:
            with traced_waits(self.stats) if self.stats.trace else contextlib.nullcontext(), self._counted():
                self.schedule.step(*self._args(inputs), target=targets if self.holds_last_stage else None, losses=losses, return_outputs=False)
        finally:
            self.stats.end_step()
        if self.recv_ahead is not None:
            self.recv_ahead.end_step()
        return torch.stack([loss.detach() for loss in losses]).mean() if self.holds_last_stage else None

    @torch.no_grad()
    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward only (the schedule's eval path); the mean loss on the last stage, else None."""
        losses: list[torch.Tensor] = []
        if self.recv_ahead is not None:
            self.recv_ahead.begin_step()
        with self._counted():
            self.schedule.eval(*self._args(inputs), target=targets if self.holds_last_stage else None, losses=losses)
        if self.recv_ahead is not None:
            self.recv_ahead.end_step()
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
    recv_ahead: bool = True,
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
        recv_ahead: post each step's receives ahead (:mod:`~parallelkit.distributed.pipeline_recv_ahead`); off
            only to test that it matters.
    """
    from torch.distributed import pipelining

    spec = SCHEDULES[schedule]
    pp = dist.get_world_size(group)
    check_pipeline_config(pp, microbatches, schedule, num_stages // pp)
    get_mesh = dtensor_mesh_lookup(stage_modules)
    stages = [pipelining.PipelineStage(m, s, num_stages, device, group=group, get_mesh=get_mesh)
              for m, s in zip(stage_modules, stage_ids)]
    params = [p for m in stage_modules for p in m.parameters()]
    stats, meter = PipelineStats(trace=trace), SavedActivationMeter(params)
    label_actions_only_under_a_profiler()
    ahead = RecvAhead(stages, microbatches, stats.wait) if recv_ahead else None  # tags the hand-offs, posts receives early
    for stage in stages:
        instrument_stage(stage, stats, meter)
        if ahead is not None:
            ahead.wait_before_compute(stage)  # outermost: waiting for a hand-off is not compute
    schedule_cls = getattr(pipelining, spec.class_name)
    built = schedule_cls(stages if spec.multi_stage else stages[0], microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    time_the_loss(built, stats)
    return PipelineParallel(built, stages, list(stage_ids), num_stages, microbatches, schedule, stats, meter, ahead, comm_stats)


def theoretical_bubble(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """(P−1)/(V·M+P−1): idle share of a fill-drain pipeline with equal per-stage costs."""
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)
