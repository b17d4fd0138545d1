"""The search: every layout of the world size that ``strategy=hybrid4d`` can run, every way to cut its batch, costed.

**Degrees** ``dp × sharding × cp × tp × pp (× ep)`` = world, each a :class:`ParallelDims`. They are pruned before
anything is costed (:func:`degree_problem`) for what no strategy can change: tp must divide the sizes the model's
tensor-parallel plan splits (and each rank's ``s/cp`` tokens, under sequence parallelism), pp ≤ its blocks, ep its
experts and ``dp × sharding``, ``dp × sharding`` the global batch, ``2·cp`` the sequence (context parallelism's
load-balanced chunks; all-to-all attention also needs the heads left by tp to divide by cp); for what the model cannot
do (no tensor-parallel plan, no pipeline cut, no sequence parallelism, no context-parallel plan:
:class:`~parallelkit.planner.shapes.ModelShape`); and for tp or ep groups across nodes unless allowed (cp groups may
span nodes: their ring hops overlap block compute, and Llama 3 ran cp 16 over 16 nodes). hybrid4d's own checks confirm the choice before training
(:meth:`parallelkit.strategies.auto.AutoStrategy.resolve`).

**Sequence parallelism** (``SearchOptions.sequence_parallel``): fixed by ``strategy.sequence_parallel``, or, unset,
both ways for every ``tp > 1`` the model allows it (:attr:`Layout.sequence_parallel` says which was chosen).
**Context parallel attention** (``SearchOptions.cp_mode``) likewise: fixed by ``strategy.cp_mode``, or, unset, ring
for every ``cp > 1`` and all-to-all (Ulysses) where the heads divide (:attr:`Layout.cp_mode`).

**Batch cut** (free parameters): without a pipeline, gradient accumulation ``a`` (micro-batch ``B_r / a``); with
one, the micro-batch count ``m`` (micro-batch ``B_r / m``) as the schedule allows (1F1B: ``m ≥ pp·v``;
interleaved: whole rounds), and the stages per rank ``v`` for interleaved schedules. Each cut is a candidate.

**Dominated cuts** are not costed: ``cp > 1`` with a micro-batch ``b`` sharing a factor ``g`` with ``cp`` runs what
moving ``g`` of ``cp`` into data parallelism runs (``sharding × g`` or ``dp × g``: the same ranks and gradient groups)
at micro-batch ``b/g`` — the same tokens per rank, the same GEMM and attention FLOPs, the same memory with fused or
all-to-all attention — with a ring ``g`` times shorter. Context parallelism pays where the sequence is the last thing
left to split. Nor are chunks shorter than :data:`MIN_CP_CHUNK` tokens searched (``cp ≤ s / 256``): a block smaller
than a fused attention kernel's tile of query rows leaves the kernel mostly idle.

**Ranking**: fitting candidates by estimated step time (ties: less memory), then the rest by memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from parallelkit.distributed.parallel_dims import DEFAULT_MESH_ORDER, EP, TP, ParallelDims
from parallelkit.errors import ConfigError
from parallelkit.planner.cost_model import CostModel, StepTime
from parallelkit.planner.hardware import Hardware
from parallelkit.planner.layout import (
    CP_MODES,
    MULTI_STAGE,
    SCHEDULES,
    Layout,
    crosses_nodes,
    pipeline_slots,
    pipeline_stages,
    representative_ranks,
)
from parallelkit.planner.memory import RankMemory, rank_memory
from parallelkit.planner.workload import Workload


@dataclass(frozen=True)
class SearchOptions:
    """What the search may vary and what it must respect.

    Args:
        schedule: the pipeline schedule (``strategy.schedule``).
        virtual_stages: stages per rank for interleaved schedules; None: searched (2 … 8).
        max_microbatches: upper bound on pipeline micro-batches (None: any divisor of the per-rank batch).
        search_accumulate: choose gradient accumulation without a pipeline (else keep ``trainer.accumulate_grad_batches``).
        mesh_order: outermost → innermost mesh axes.
        reshard_after_forward: ZeRO-3 option; None: hybrid4d's default (reshard without a pipeline only).
        allow_tp_across_nodes / allow_ep_across_nodes: let tp / ep groups span nodes.
        norm_clipping: ``trainer.gradient_clip_val`` by norm (hybrid4d refuses it with ep > 1).
        zero_stage: what sharding shards (hybrid4d's FSDP2: 3).
        sequence_parallel: ``strategy.sequence_parallel``; None: searched (both ways for every ``tp > 1`` the model
            allows it).
        cp_mode: ``strategy.cp_mode`` (``ring`` or ``ulysses``); None: searched (ring, and ulysses where the heads
            divide) for every ``cp > 1``.
        max_cp: the largest context-parallel degree searched (None: any the sequence and the model allow; 1: none).
    """

    schedule: str = "1f1b"
    virtual_stages: int | None = None
    max_microbatches: int | None = None
    search_accumulate: bool = True
    mesh_order: tuple[str, ...] = DEFAULT_MESH_ORDER
    reshard_after_forward: bool | None = None
    allow_tp_across_nodes: bool = False
    allow_ep_across_nodes: bool = False
    norm_clipping: bool = False
    zero_stage: int = 3
    sequence_parallel: bool | None = None
    cp_mode: str | None = None
    max_cp: int | None = None

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"strategy.schedule={self.schedule!r} is not a pipeline schedule. Use one of {', '.join(SCHEDULES)}.")
        if self.max_microbatches is not None and (not isinstance(self.max_microbatches, int) or self.max_microbatches < 1):
            raise ConfigError(f"strategy.max_microbatches should be an int greater than 0 or null. Got {self.max_microbatches!r}.")
        if self.sequence_parallel not in (None, True, False):
            raise ConfigError(f"strategy.sequence_parallel should be true, false or absent (searched). Got {self.sequence_parallel!r}.")
        if self.cp_mode is not None and self.cp_mode not in CP_MODES:
            raise ConfigError(f"strategy.cp_mode should be one of {', '.join(CP_MODES)} or null (searched). Got {self.cp_mode!r}.")
        if self.max_cp is not None and (not isinstance(self.max_cp, int) or isinstance(self.max_cp, bool) or self.max_cp < 1):
            raise ConfigError(f"strategy.max_cp should be an int greater than 0 or null. Got {self.max_cp!r}.")


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
def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


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


#: Fewest tokens in each of the ``2·cp`` chunks the search considers: flash attention's tiles are 64–128 query rows.
MIN_CP_CHUNK = 128


def context_parallel_degrees(w: Workload, world: int, opts: SearchOptions) -> list[int]:
    """The ``cp`` degrees worth searching: 1, and every divisor of ``world`` with ``2·cp`` dividing the sequence into
    chunks of at least :data:`MIN_CP_CHUNK` tokens (up to ``opts.max_cp``) when the model has a context-parallel plan."""
    if w.shape.cp_refusal or opts.max_cp == 1:
        return [1]
    return [c for c in divisors(world) if w.seq_len % (2 * c) == 0 and (c == 1 or w.seq_len // (2 * c) >= MIN_CP_CHUNK)
            and (opts.max_cp is None or c <= opts.max_cp)]


def dominated_by_less_cp(w: Workload, layout: Layout) -> bool:
    """Whether moving ``g = gcd(micro-batch, cp) > 1`` of ``cp`` into data parallelism runs the same work with a shorter
    ring (module docstring): fused or all-to-all attention (the same memory), an all-to-all the smaller cp allows."""
    g = math.gcd(layout.micro_batch, layout.cp)
    if g == 1 or (w.attention != "flash" and layout.cp_mode != "ulysses"):
        return False
    return layout.cp_mode == "ring" or ulysses_problem(w.shape.heads // layout.tp, max(w.shape.kv_heads // layout.tp, 1), layout.cp // g) is None


def ulysses_problem(heads: int, kv_heads: int, cp: int) -> str | None:
    """Why all-to-all attention cannot split these heads (those one tp rank holds) over ``cp`` ranks (None: it can):
    query heads divide by cp, key/value heads divide by cp or divide it
    (``parallelkit.distributed.context_parallel_attention.check_ulysses_heads``, without torch)."""
    if heads % cp:
        return f"strategy.cp_mode=ulysses: cp={cp} must divide the {heads} attention heads of a tp rank"
    if kv_heads % cp and cp % kv_heads:
        return f"strategy.cp_mode=ulysses: cp={cp} must divide the {kv_heads} key/value heads of a tp rank, or be divided by them"
    return None


def degree_problem(w: Workload, hw: Hardware, layout: Layout, opts: SearchOptions) -> str | None:
    """Why these degrees cannot run (None: they can), in the words of the checks that refuse them: what no strategy
    can change (divisibility, the batch split), what the model cannot do, and groups across nodes unless allowed."""
    shape, tp, pp, ep, cp = w.shape, layout.tp, layout.pp, layout.ep, layout.cp
    dp_size = layout.dp * layout.sharding
    if cp > 1:
        if shape.cp_refusal:
            return f"strategy.cp={cp}: {shape.cp_refusal}"
        if w.seq_len % (2 * cp):
            return f"data.seq_len={w.seq_len} must divide by 2·cp = {2 * cp} (context parallelism's load-balanced chunks)"
        if layout.cp_mode == "ulysses":
            problem = ulysses_problem(shape.heads // tp, max(shape.kv_heads // tp, 1), cp)
            if problem:
                return problem
        if layout.sharding > 1 and layout.zero_stage in (1, 2):
            return f"ZeRO stage {layout.zero_stage} with strategy.cp={cp}: optimizer sharding composes with data parallelism only"
    if tp > 1:
        if shape.tp_plan:
            return shape.tp_plan
        if layout.sequence_parallel and shape.sp_refusal:
            return f"strategy.sequence_parallel=true with model={shape.family}: {shape.sp_refusal}"
        tokens = [(f"data.seq_len / cp ({w.seq_len} / {cp})" if cp > 1 else "data.seq_len (block_size)", w.seq_len // cp)]
        sizes = list(shape.tp_sizes) + (tokens if layout.sequence_parallel else [])
        bad = [f"{name}={value}" for name, value in sizes if value % tp]
        if bad:
            return f"strategy.tp={tp} does not divide " + "; ".join(bad)
        if not opts.allow_tp_across_nodes and crosses_nodes(layout.dims, TP, hw.devices_per_node):
            return f"tp={tp} groups would span nodes of {hw.devices_per_node} ranks (strategy.allow_tp_across_nodes=true allows it)"
    if ep > 1:
        if not shape.experts:
            return f"strategy.ep={ep}: the model has no Mixture-of-Experts layers"
        if shape.experts % ep or dp_size % ep:
            return f"strategy.ep={ep} must divide the {shape.experts} experts and dp × sharding = {dp_size}"
        if opts.norm_clipping:
            return f"strategy.ep={ep} with gradient clipping by norm (each rank holds different experts)"
        if not opts.allow_ep_across_nodes and crosses_nodes(layout.dims, EP, hw.devices_per_node):
            return f"ep={ep} groups would span nodes of {hw.devices_per_node} ranks (strategy.allow_ep_across_nodes=true allows it)"
    if pp > 1:
        if pp > shape.layers:
            return f"The pipeline has {pp} stages but the model has only {shape.layers} blocks to distribute"
        if shape.pp_refusal:
            return shape.pp_refusal
    if w.global_batch is not None and w.global_batch % dp_size:
        return f"data.global_batch_size={w.global_batch} cannot be split evenly over dp × sharding = {dp_size} ranks"
    return None


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
