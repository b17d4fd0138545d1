"""The search: every layout of the world size that ``strategy=hybrid4d`` can run, every way to cut its batch, costed.

**Degrees** ``dp × sharding × cp × tp × pp (× ep)`` = world, each a :class:`ParallelDims`, pruned before anything is
costed for what cannot run (:mod:`~parallelkit.planner.pruning`). hybrid4d's own checks confirm the choice before
training (:meth:`parallelkit.strategies.auto.AutoStrategy.resolve`).

**Sequence parallelism** (``SearchOptions.sequence_parallel``): fixed by ``strategy.sequence_parallel``, or, unset,
both ways for every ``tp > 1`` the model allows it (:attr:`Layout.sequence_parallel` says which was chosen).
**Context parallel attention** (``SearchOptions.cp_mode``) likewise: fixed by ``strategy.cp_mode``, or, unset, ring
for every ``cp > 1`` and all-to-all (Ulysses) where the heads divide (:attr:`Layout.cp_mode`).

**Batch cut** (free parameters): without a pipeline, gradient accumulation ``a`` (micro-batch ``B_r / a``); with
one, the micro-batch count ``m`` (micro-batch ``B_r / m``) as the schedule allows (1F1B: ``m ≥ pp·v``;
interleaved: whole rounds), and the stages per rank ``v`` for interleaved schedules. Each cut is a candidate.

**Dominated cuts** are not costed (:func:`~parallelkit.planner.pruning.dominated_by_less_cp`), nor context-parallel
chunks shorter than :data:`~parallelkit.planner.pruning.MIN_CP_CHUNK` tokens.

**Ranking**: fitting candidates by estimated step time (ties: less memory), then the rest by memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from parallelkit.distributed.parallel_dims import EP, ParallelDims
from parallelkit.errors import ConfigError
from parallelkit.planner.cost_model import CostModel, StepTime
from parallelkit.planner.hardware import Hardware
from parallelkit.planner.layout import (
    MULTI_STAGE,
    Layout,
    pipeline_slots,
    pipeline_stages,
    representative_ranks,
)
from parallelkit.planner.memory import RankMemory, rank_memory
from parallelkit.planner.pruning import (  # noqa: F401  (degree_problem, ulysses_problem: public here as before)
    MIN_CP_CHUNK,
    context_parallel_degrees,
    degree_problem,
    divisors,
    dominated_by_less_cp,
    ulysses_problem,
)
from parallelkit.planner.search_options import SearchOptions  # noqa: F401  (public here as before)
from parallelkit.planner.workload import Workload


@dataclass
class Candidate:
    """One layout and batch cut, with its estimates (the most loaded pipeline rank's memory; per-axis comm)."""

    layout: Layout
    invalid: str | None = None
    memory: dict[str, float] = field(default_factory=dict)
    memory_by_pp_rank: dict[int, dict[str, float]] = field(default_factory=dict)
    time: StepTime | None = None
    fits: bool = False
    tokens_per_s_per_device: float = 0.0

    @property
    def degrees(self) -> dict[str, int]:
        return self.layout.degrees

    @property
    def label(self) -> str:
        return self.layout.label

    @property
    def microbatches(self) -> int:
        return self.layout.microbatches

    @property
    def total_time(self) -> float:
        return self.time.total if self.time else math.inf

    @property
    def comm_bytes(self) -> dict[str, float]:
        return self.time.comm_bytes if self.time else {}

    @property
    def crosses_nodes(self) -> dict[str, bool]:
        return self.time.crosses if self.time else {}

    def why_not(self, usable_memory: float) -> str:
        if self.invalid:
            return self.invalid
        if not self.fits:
            return f"needs {gib(self.memory['total'])} per rank > {gib(usable_memory)}"
        return ""

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"layout": self.layout.as_dict(), "fits": self.fits, "invalid": self.invalid}
        if self.time is not None:
            out.update(memory_bytes={k: int(v) for k, v in self.memory.items()},
                       memory_bytes_by_pp_rank={str(r): {k: int(v) for k, v in m.items()} for r, m in self.memory_by_pp_rank.items()},
                       time_s=self.time.as_dict(), comm_bytes_per_step={k: int(v) for k, v in self.time.comm_bytes.items()},
                       crosses_nodes=dict(self.time.crosses), step_time_s=self.total_time,
                       tokens_per_s_per_device=self.tokens_per_s_per_device)
        return out


@dataclass
class AutoPlan:
    """The planner's answer: every candidate, ranked; ``chosen`` is the first."""

    world_size: int
    hardware: Hardware
    workload: Workload
    candidates: list[Candidate]
    invalid_layouts: int = 0

    @property
    def chosen(self) -> Candidate:
        return self.candidates[0]

    @property
    def num_params(self) -> int:
        return self.workload.num_params

    def as_dict(self) -> dict[str, Any]:
        """The chosen layout and its estimates, as written to ``summary.json`` (``auto_plan``)."""
        c = self.chosen
        by_rank = c.time.comm_bytes_by_rank if c.time else []
        return {"chosen": dict(c.degrees), "ep": c.layout.ep, "sequence_parallel": c.layout.sequence_parallel, "cp_mode": c.layout.cp_mode,
                "zero_stage": c.layout.zero_stage if c.layout.sharding > 1 else 0,
                "microbatches": c.layout.microbatches, "accumulate": c.layout.accumulate, "micro_batch": c.layout.micro_batch,
                "virtual_stages": c.layout.virtual_stages, "hardware": self.hardware.name,
                "estimated_memory_bytes": {k: int(v) for k, v in c.memory.items()},
                "estimated_comm_bytes_per_step": {k: int(v) for k, v in c.comm_bytes.items() if k != EP or v},
                "estimated_comm_bytes_per_step_by_pp_rank": [{k: int(v) for k, v in r.items() if k != EP or v} for r in by_rank],
                "estimated_step_time_s": c.total_time, "estimated_time_terms_s": c.time.as_dict() if c.time else {},
                "candidates_fitting": sum(x.fits for x in self.candidates),
                "candidates_valid": sum(x.invalid is None for x in self.candidates)}


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**26 else f"{n / 2**20:.2f} MiB"


# ------------------------------------------------------------------------------------ enumeration
def degree_sets(world: int, experts: int = 0, cps: tuple[int, ...] | list[int] = (1,)) -> list[tuple[int, int, int, int, int, int]]:
    """Every ``(dp, sharding, cp, tp, pp, ep)`` with ``dp·sharding·cp·tp·pp = world`` and ``cp`` one of ``cps`` (``ep``
    divides ``dp·sharding`` and the experts)."""
    out = []
    for cp in (c for c in cps if world % c == 0):
        for tp in divisors(world // cp):
            for pp in divisors(world // (cp * tp)):
                rest = world // (cp * tp * pp)
                for sharding in divisors(rest):
                    eps = [e for e in divisors(rest) if experts and experts % e == 0] or [1]
                    for ep in eps:
                        out.append((rest // sharding, sharding, cp, tp, pp, ep))
    return out


def sequence_parallel_options(w: Workload, hw: Hardware, base: Layout, opts: SearchOptions) -> list[bool]:
    """The ``sequence_parallel`` values to cost for ``base``'s degrees: none but False without tp; the one asked for;
    else both where the model allows it (a refusal of the searched ``True`` only drops it)."""
    if base.tp == 1 or opts.sequence_parallel is False:
        return [False]
    if opts.sequence_parallel:
        return [True]
    return [False, True] if degree_problem(w, hw, replace(base, sequence_parallel=True), opts) is None else [False]


def cp_mode_options(w: Workload, hw: Hardware, base: Layout, opts: SearchOptions) -> list[str]:
    """The ``cp_mode`` values to cost for ``base``'s degrees: ring without cp (unused) and where it is asked for; the
    one asked for; else ring, and ulysses where the heads allow it."""
    if base.cp == 1:
        return [base.cp_mode]
    if opts.cp_mode is not None:
        return [opts.cp_mode]
    return ["ring", "ulysses"] if degree_problem(w, hw, replace(base, cp_mode="ulysses"), opts) is None else ["ring"]


def batch_cuts(w: Workload, layout: Layout, opts: SearchOptions) -> list[tuple[int, int, int]]:
    """``(accumulate, microbatches, virtual_stages)`` options for these degrees (see the module docstring)."""
    dp_size = layout.dp * layout.sharding
    rank_batch = w.global_batch // dp_size if w.global_batch is not None else w.per_rank_batch * w.accumulate
    if layout.pp == 1:
        if opts.search_accumulate and w.global_batch is not None:
            return [(a, 1, 1) for a in divisors(rank_batch)]
        return [(w.accumulate, 1, 1)] if rank_batch % w.accumulate == 0 else []
    virtuals, slots = [1], pipeline_slots(layout, w.shape.layers)  # each stage: a block, the embedding or the loss
    if opts.schedule in MULTI_STAGE:
        if opts.schedule == "zbv":
            virtuals = [2]
        elif opts.virtual_stages is not None:
            virtuals = [opts.virtual_stages]
        else:
            virtuals = [v for v in range(2, 9) if layout.pp * v <= slots] or [2]
    out = []
    for m in divisors(rank_batch):
        if opts.max_microbatches is not None and m > opts.max_microbatches:
            continue
        for v in virtuals:
            stages = layout.pp * v
            if stages > slots:
                continue
            if opts.schedule in ("1f1b", "zbv") and m < stages:
                continue
            if opts.schedule in ("interleaved_1f1b", "zero_bubble") and m % max(1, m // layout.pp):
                continue
            out.append((1, m, v))
    return out


# ------------------------------------------------------------------------------------ costing
def evaluate(w: Workload, hw: Hardware, layout: Layout, model: CostModel | None = None) -> Candidate:
    """Estimate one layout (memory of its representative pipeline ranks, step time)."""
    model = model or CostModel(w, hw)
    ranks, weights = representative_ranks(layout.pp, layout.embedding_and_loss_as_layers)
    stages = pipeline_stages(layout, w.shape.layers, ranks)
    stages.weights = weights
    memory: list[RankMemory] = [rank_memory(w, layout, stages, i) for i in range(len(ranks))]
    time = model.step(layout, stages, memory)
    worst = max(memory, key=lambda r: r.total)
    tokens = (w.global_batch if w.global_batch is not None else w.per_rank_batch * w.accumulate * layout.dp * layout.sharding) * w.seq_len
    candidate = Candidate(layout, memory=worst.as_dict(), memory_by_pp_rank={r: m.as_dict() for r, m in zip(ranks, memory)},
                          time=time, fits=worst.total <= hw.usable_memory,
                          tokens_per_s_per_device=tokens / time.total / layout.world if time.total else 0.0)
    return candidate


def search(w: Workload, hw: Hardware, world: int, opts: SearchOptions = SearchOptions()) -> AutoPlan:
    """Every candidate for ``world`` ranks, ranked (see the module docstring). Raises :class:`ConfigError` if none fits."""
    model = CostModel(w, hw)
    candidates: list[Candidate] = []
    invalid = 0
    for dp, sharding, cp, tp, pp, ep in degree_sets(world, w.shape.experts, context_parallel_degrees(w, world, opts)):
        reshard = (pp == 1) if opts.reshard_after_forward is None else opts.reshard_after_forward
        dims = ParallelDims(world, dp=dp, sharding=sharding, cp=cp, tp=tp, pp=pp, ep=ep, mesh_order=tuple(opts.mesh_order))
        base = Layout(dims, zero_stage=opts.zero_stage if sharding > 1 else 0, schedule=opts.schedule,
                      reshard_after_forward=reshard, sequence_parallel=bool(opts.sequence_parallel) and tp > 1,
                      cp_mode=opts.cp_mode or "ring")
        problem = degree_problem(w, hw, base, opts)
        cuts = [] if problem else batch_cuts(w, base, opts)
        if not problem and not cuts:
            problem = (f"no micro-batch count of the per-rank batch suits schedule={opts.schedule} with pp={pp}"
                       + (f" (max_microbatches={opts.max_microbatches})" if opts.max_microbatches else ""))
        if problem:
            invalid += 1
            candidates.append(Candidate(base, invalid=problem))
            continue
        rank_batch = (w.global_batch // (dp * sharding)) if w.global_batch is not None else w.per_rank_batch * w.accumulate
        for sp in sequence_parallel_options(w, hw, base, opts):
            for mode in cp_mode_options(w, hw, replace(base, sequence_parallel=sp), opts):
                for accumulate, m, v in cuts:
                    layout = replace(base, micro_batch=rank_batch // (accumulate * m), microbatches=m, accumulate=accumulate,
                                     virtual_stages=v, sequence_parallel=sp, cp_mode=mode)
                    if cp > 1 and dominated_by_less_cp(w, layout):
                        continue
                    candidates.append(evaluate(w, hw, layout, model))
    candidates.sort(key=_rank_key)
    plan = AutoPlan(world, hw, w, candidates, invalid)
    if not candidates or not candidates[0].fits:
        _raise_nothing_fits(plan)
    return plan


def _rank_key(c: Candidate) -> tuple:
    if c.invalid is not None:
        return (2, 0.0, 0.0)
    if not c.fits:
        return (1, c.memory.get("total", 0.0), 0.0)
    return (0, c.total_time, c.memory["total"])


def _raise_nothing_fits(plan: AutoPlan) -> None:
    world, hw = plan.world_size, plan.hardware
    valid = [c for c in plan.candidates if c.invalid is None]
    if not valid:
        reasons = "; ".join(sorted({c.invalid for c in plan.candidates if c.invalid}))[:2000]
        raise ConfigError(f"strategy=auto found no layout of {world} ranks that hybrid4d can run: {reasons}")
    best = min(valid, key=lambda c: c.memory["total"])
    raise ConfigError(
        f"strategy=auto: no layout of {world} ranks fits strategy.hardware ({hw.name}: {gib(hw.usable_memory)} usable per device). "
        f"The smallest needs {gib(best.memory['total'])} per rank ({best.label}, micro-batch {best.layout.micro_batch}: model state "
        f"{gib(best.memory['state'])}, activations {gib(best.memory['activations'])}). Use more devices, devices with more memory "
        "(strategy.hardware.memory_per_device), recompute=full, a smaller data.global_batch_size or a smaller model."
    )
