"""One candidate layout: its :class:`ParallelDims`, the ZeRO stage, how the per-rank batch is cut, the pipeline schedule.

The degrees live in one place, the layout's ``dims`` (:class:`~parallelkit.distributed.parallel_dims.ParallelDims`,
which validates them for every strategy); the layout adds only what is not a degree. ``layout.tp`` and the like read
``dims``.

And the pipeline geometry every estimate shares: which layers, which (virtual) stages and how many
micro-batches in flight each pipeline rank has. Stage placement follows parallelkit's pipeline
(:mod:`parallelkit.distributed.pipeline_parallel`): stage ``s`` on rank ``s % pp`` (``zbv``: a V, rank ``r``
holds ``r`` and ``2·pp − 1 − r``); blocks are split evenly, the first stages taking one more when uneven. With
``embedding_and_loss_as_layers`` the embedding and the output layer + loss each take one layer's place in the split
(the first and the last stage one block fewer: Megatron-LM's ``--account-for-embedding-in-pipeline-split`` and
``--account-for-loss-in-pipeline-split``; Llama 3, arXiv:2407.21783, §3.3.2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from parallelkit.distributed.parallel_dims import CP, DP, EP, PP, SHARDING, TP, ParallelDims

AXES = (DP, SHARDING, CP, TP, PP, EP)
CP_MODES = ("ring", "ulysses")  # strategy.cp_mode (parallelkit.distributed.context_parallel.CP_MODES, without torch)
MULTI_STAGE = ("interleaved_1f1b", "zero_bubble", "zbv")
SCHEDULES = ("gpipe", "1f1b", *MULTI_STAGE)


@dataclass(frozen=True)
class Layout:
    """One candidate: its degrees (``dims``) and everything else that decides its memory and time.

    Args:
        dims: the degrees ``dp × sharding × cp × tp × pp`` (``ep`` spreads experts over ``ep`` data-parallel ranks)
            and the mesh order, validated by :class:`ParallelDims` — the only carrier of degrees.
        zero_stage: what ``sharding`` shards (1 optimizer state, 2 + gradients, 3 + parameters; hybrid4d's FSDP2 is 3).
        micro_batch: sequences per micro-batch.
        microbatches: micro-batches per pipeline pass (``pp > 1``).
        accumulate: micro-steps per optimizer step without a pipeline (gradient accumulation).
        schedule / virtual_stages: the pipeline schedule and stages per rank.
        reshard_after_forward: ZeRO-3 frees gathered parameters after each forward (gathers again for backward).
        sequence_parallel: tensor parallelism also splits the norm / dropout regions along the sequence
            (Korthikanti et al. 2022); needs ``tp > 1``.
        embedding_and_loss_as_layers: the pipeline split counts the embedding and the output layer + loss as one
            block each (see the module docstring).
        microbatch_group: interleaved schedules run ``N`` consecutive micro-batches per stage before switching
            stage (Megatron's ``microbatch_group_size_per_vp_stage``, Llama 3's tunable ``N``); 0: ``N = pp``
            (Narayanan et al. 2021's depth-first order, the fewest micro-batches in flight Megatron allows).
        cp_mode: context parallelism's attention (``cp > 1``): ``ring`` (keys/values around the cp ranks, overlapped
            with block compute) or ``ulysses`` (all-to-alls between sequence and head shards).

    Example::

        Layout(ParallelDims(16, dp=2, tp=4, pp=2), micro_batch=2, microbatches=8, sequence_parallel=True)
        Layout(ParallelDims(16, cp=4, tp=4), cp_mode="ulysses")
    """

    dims: ParallelDims
    zero_stage: int = 0
    micro_batch: int = 1
    microbatches: int = 1
    accumulate: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    reshard_after_forward: bool = True
    sequence_parallel: bool = False
    embedding_and_loss_as_layers: bool = False
    microbatch_group: int = 0
    cp_mode: str = "ring"

    def __post_init__(self) -> None:
        if not isinstance(self.dims, ParallelDims):
            raise TypeError(f"Layout.dims must be a ParallelDims, got {type(self.dims).__name__}")
        if self.dims.world_size is None:  # a strategy's request, before the world size is known
            raise ValueError("Layout.dims must be resolved degrees (ParallelDims for a world size), not a request")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.sequence_parallel and self.dims.tp == 1:
            raise ValueError("sequence_parallel splits the tensor-parallel regions along the sequence: it needs tp > 1")
        if self.cp_mode not in CP_MODES:
            raise ValueError(f"cp_mode {self.cp_mode!r} is not one of {', '.join(CP_MODES)}")

    # ------------------------------------------------------------------ the degrees, read from dims
    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def sharding(self) -> int:
        return self.dims.sharding

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def ep(self) -> int:
        return self.dims.ep

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def shard_group(self) -> int:
        """Ranks FSDP shards the model state over: ``sharding × cp`` (cp ranks hold the same parameters; hybrid4d
        shards over both, torchtitan's ``dp_shard_cp``), 1 without sharding."""
        return self.sharding * self.cp if self.sharding > 1 else 1

    @property
    def replica_group(self) -> int:
        """Ranks that all-reduce whole gradients: ``dp × cp`` without sharding (hybrid4d's gradient all-reduce spans the
        cp ranks, which saw other tokens), ``dp`` (HSDP's replicas of one shard) with it."""
        return self.dp * self.cp if self.sharding == 1 else self.dp

    @property
    def mesh_order(self) -> tuple[str, ...]:
        return self.dims.mesh_order

    @property
    def degrees(self) -> dict[str, int]:
        """``dp, sharding, cp, tp, pp`` (:attr:`ParallelDims.degrees`)."""
        return self.dims.degrees

    @property
    def world(self) -> int:
        return self.dims.world_size

    @property
    def label(self) -> str:
        text = f"dp={self.dp} sharding={self.sharding}" + (f" cp={self.cp}" if self.cp > 1 else "") + f" tp={self.tp} pp={self.pp}"
        text += f" ep={self.ep}" if self.ep > 1 else ""
        text += f" cp_mode={self.cp_mode}" if self.cp > 1 and self.cp_mode != "ring" else ""
        return text + (" sequence_parallel" if self.sequence_parallel else "")

    @property
    def micro_steps(self) -> int:
        """Micro-batches a rank runs per optimizer step."""
        return self.microbatches if self.pp > 1 else self.accumulate

    def as_dict(self) -> dict[str, Any]:
        return {**self.dims.as_dict(), "mesh_order": list(self.dims.mesh_order), "zero_stage": self.zero_stage,
                "micro_batch": self.micro_batch, "microbatches": self.microbatches, "accumulate": self.accumulate,
                "schedule": self.schedule, "virtual_stages": self.virtual_stages,
                "reshard_after_forward": self.reshard_after_forward, "sequence_parallel": self.sequence_parallel,
                "embedding_and_loss_as_layers": self.embedding_and_loss_as_layers, "microbatch_group": self.microbatch_group,
                "cp_mode": self.cp_mode}


def crosses_nodes(dims: ParallelDims, axis: str, devices_per_node: int) -> bool:
    """Whether some group of ``axis`` spans two nodes: with ``mesh_order`` outermost → innermost, a group is
    ``degree`` ranks ``stride`` apart (stride = the product of the degrees inside it); it stays in a node iff
    ``stride · degree`` divides ``devices_per_node``. ``ep`` groups are consecutive data-parallel ranks."""
    order = list(dims.mesh_order)
    if axis == EP:
        if dims.ep == 1:
            return False
        # Consecutive data-parallel ranks (dp just outside sharding) are `stride` ranks apart: a group spans stride·ep.
        stride = math.prod(getattr(dims, a) for a in order[order.index(SHARDING) + 1:])
        return devices_per_node % (stride * dims.ep) != 0
    degree = getattr(dims, axis)
    if degree == 1:
        return False
    stride = math.prod(getattr(dims, a) for a in order[order.index(axis) + 1:])
    return devices_per_node % (stride * degree) != 0


def group_crosses_nodes(dims: ParallelDims, axes: tuple[str, ...], devices_per_node: int) -> bool:
    """Whether a group of the ``axes`` flattened together (adjacent in ``mesh_order``, as :class:`ParallelDims` keeps
    ``dp, sharding, cp``) spans two nodes: ``stride · Π degrees`` consecutive ranks must fit a node."""
    order = list(dims.mesh_order)
    size = math.prod(getattr(dims, a) for a in axes)
    if size == 1:
        return False
    inner = max(order.index(a) for a in axes if getattr(dims, a) > 1)
    outer = min(order.index(a) for a in axes if getattr(dims, a) > 1)
    stride = math.prod(getattr(dims, a) for a in order[inner + 1:])
    span = math.prod(getattr(dims, a) for a in order[outer:inner + 1])  # what lies between is in the group or of degree 1
    return devices_per_node % (stride * span) != 0


def members_per_node(dims: ParallelDims, axes: tuple[str, ...], devices_per_node: int) -> int:
    """How many ranks of one group of the ``axes`` (flattened together, adjacent in ``mesh_order``) share a node: the
    group's ranks are ``stride`` apart (the product of the degrees inside them), so a node holds
    ``devices_per_node / stride`` of them, at most the group, at least one. A ring collective of a group spanning nodes
    gets that many GPUs' share of the network (:meth:`~parallelkit.planner.hardware.Hardware.collective_time`)."""
    order = list(dims.mesh_order)
    active = [a for a in axes if getattr(dims, a) > 1]
    if not active:
        return 1
    size = math.prod(getattr(dims, a) for a in active)
    inner = max(order.index(a) for a in active)
    stride = math.prod(getattr(dims, a) for a in order[inner + 1:])
    return max(1, min(size, devices_per_node // stride))


# ------------------------------------------------------------------------------------ pipeline geometry
@dataclass
class Stages:
    """Per pipeline rank: layer ids, whether it holds the embedding / the head, and micro-batches in flight."""

    ranks: list[int] = field(default_factory=list)  # pipeline coordinates described
    weights: list[int] = field(default_factory=list)  # pipeline ranks each entry stands for (averages)
    layers: list[list[int]] = field(default_factory=list)
    first: list[bool] = field(default_factory=list)
    last: list[bool] = field(default_factory=list)
    in_flight_layers: list[float] = field(default_factory=list)  # layer·micro-batches of activations kept, peak
    in_flight_head: list[int] = field(default_factory=list)  # micro-batches of logits kept by the head
    in_flight_outputs: list[float] = field(default_factory=list)  # chunk-micro-batches whose stage output is kept
    sends: list[int] = field(default_factory=list)  # p2p sends per micro-batch (forward + backward)


def stage_ids(rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    if schedule == "zbv":
        return sorted({rank, 2 * pp - 1 - rank})
    return [rank + v * pp for v in range(virtual)]


def stage_layers(num_layers: int, num_stages: int, embedding_and_loss: bool = False) -> list[range]:
    """Block ids of each stage. ``embedding_and_loss``: the split is of ``num_layers + 2`` slots, the first the
    embedding and the last the output layer + loss, which hold no block."""
    slots = num_layers + 2 if embedding_and_loss else num_layers
    base, extra = divmod(slots, num_stages)
    starts = [s * base + min(s, extra) for s in range(num_stages)] + [slots]
    if not embedding_and_loss:
        return [range(a, b) for a, b in zip(starts[:-1], starts[1:])]
    return [range(max(a, 1) - 1, max(min(b, num_layers + 1) - 1, max(a, 1) - 1)) for a, b in zip(starts[:-1], starts[1:])]


def pipeline_slots(layout: Layout, num_layers: int) -> int:
    """What the pipeline split divides: the blocks, and the embedding and the loss when they count as blocks."""
    return num_layers + (2 if layout.embedding_and_loss_as_layers else 0)


def representative_ranks(pp: int, embedding_and_loss: bool = False) -> tuple[list[int], list[int]]:
    """Pipeline ranks that bound every estimate, and how many ranks each stands for: the first (most micro-batches in
    flight, the embedding, the most layers when uneven), the last (the head), and one in the middle for the rest —
    and the second when the first holds one block fewer (``embedding_and_loss``: it then keeps the most in flight)."""
    if pp <= 2 or (embedding_and_loss and pp <= 4):
        return list(range(pp)), [1] * pp
    if embedding_and_loss:
        return [0, 1, pp // 2, pp - 1], [1, 1, pp - 3, 1]
    return [0, pp // 2, pp - 1], [1, pp - 2, 1]


def interleaved_peak(chunk_weights: list[float], m: int, group: int, warmup: int) -> float:
    """Peak of ``Σ weight`` over the chunk-micro-batches in flight of one rank of an interleaved schedule (Megatron's
    order: forward ``k`` runs chunk ``(k // N) % v``, backward ``j`` chunk ``v − 1 − (j // N) % v``; ``warmup``
    forwards, then one forward and one backward at a time). Equal weights: ``min(m·v, warmup + 1) × weight``.
    Forwards and backwards both repeat every ``N·v``, so one such period of the steady state holds the peak."""
    v, total = len(chunk_weights), m * len(chunk_weights)
    if len(set(chunk_weights)) == 1:
        return min(total, warmup + 1) * chunk_weights[0]
    warmup = min(total, warmup)
    kept = sum(chunk_weights[(k // group) % v] for k in range(warmup))
    peak = kept
    for i in range(min(total - warmup, group * v)):  # forward warmup + i, then backward i
        kept += chunk_weights[((warmup + i) // group) % v]
        peak = max(peak, kept)
        kept -= chunk_weights[v - 1 - (i // group) % v]
    return peak


def pipeline_stages(layout: Layout, num_layers: int, ranks: list[int] | None = None) -> Stages:
    """The :class:`Stages` of ``ranks`` (default: every pipeline rank).

    Micro-batches in flight at the peak (activations kept for backward): GPipe all ``m``; 1F1B
    ``min(m, pp − r)`` (Narayanan et al. 2021, §2.2.1); interleaved ``min(m·v, (v − 1)·N + 2·(pp − 1 − r) + 1)``
    chunk-micro-batches (``N`` consecutive micro-batches per chunk, ``N = pp`` by default: Megatron's warm-up) of
    ``L_r / v`` layers each — on rank 0 with ``N = pp`` that is Korthikanti et al.'s ``L·(1 + (p − 1)/(p·v))``;
    chunks of unequal size (an uneven split, ``embedding_and_loss_as_layers``) are followed through the schedule's order
    (:func:`interleaved_peak`); zero bubble and ZB-V keep 1F1B's peak (Qi et al. 2023).
    """
    pp, v, m = layout.pp, layout.virtual_stages if layout.pp > 1 else 1, layout.micro_steps
    num_stages = pp * v
    split = layout.embedding_and_loss_as_layers and pp > 1
    blocks = stage_layers(num_layers, num_stages, split)
    out = Stages()
    chosen = list(range(pp)) if ranks is None else ranks
    for r in chosen:
        out.ranks.append(r)
        out.weights.append(1)
        ids = stage_ids(r, pp, v, layout.schedule) if pp > 1 else [0]
        layers = [layer for s in ids for layer in blocks[s]]
        out.layers.append(layers)
        out.first.append(0 in ids)
        out.last.append(num_stages - 1 in ids)
        outputs = sum(s < num_stages - 1 for s in ids) / len(ids)  # share of the rank's chunks that send an output
        if pp == 1:
            kept, chunks = float(len(layers)), 0.0
            head = 1
        elif layout.schedule == "gpipe":
            kept, chunks, head = float(m * len(layers)), float(m * len(ids)), m
        elif layout.schedule in ("interleaved_1f1b", "zero_bubble") and v > 1:
            group = layout.microbatch_group or pp
            warmup = (v - 1) * group + 2 * (pp - 1 - r)
            kept = interleaved_peak([float(len(blocks[s])) for s in ids], m, group, warmup)
            chunks, head = float(min(m * v, warmup + 1)), 1
        else:  # 1f1b, zbv
            kept, chunks, head = float(min(m, pp - r) * len(layers)), float(min(m, pp - r) * len(ids)), 1
        out.in_flight_layers.append(kept)
        out.in_flight_outputs.append(chunks * outputs)
        out.in_flight_head.append(head)
        out.sends.append(sum((s < num_stages - 1) + (s > 0) for s in ids))
    return out
