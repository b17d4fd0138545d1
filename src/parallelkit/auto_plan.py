"""The automatic planner behind ``strategy=auto``: choose ``dp × sharding × tp × pp`` for a model and a machine.

In the spirit of PaddlePaddle's end-to-end adaptive distributed training (a cost model over candidate
layouts) and MindSpore's sharding-strategy search, with a deliberately small, explicit cost model. The
entry function is :func:`choose_layout`; ``strategy=auto`` calls it before any process starts and trains
with ``strategy=hybrid4d`` at the chosen degrees.

**Candidates.** Every ``(dp, sharding, tp, pp)`` whose product is the world size. A candidate is *valid*
when ``strategy=hybrid4d`` accepts it — the checks are hybrid4d's own, not copies: ``ParallelDims``
(degrees), ``check_hybrid_degrees`` (combinations not composed yet, e.g. sharding with pp), ``check_model``
(heads, width, vocabulary divisible by tp), ``check_workload`` (blocks ≥ pp, micro-batches) and the data
module's batch plan (global batch divisible by dp × sharding). Micro-batches ``m`` (pp > 1): the largest
divisor of the per-rank batch up to ``max_microbatches``.

**Memory per rank** (bytes, the most loaded pipeline rank) = model state + activations (+ gathered block):

- model state: :func:`parallelkit.plan.rank_state_bytes` on the real model (meta device) — the model's TP
  plan divides the layers it splits by ``tp``, its pipeline cut keeps the stage's modules, and ZeRO divides
  by ``sharding`` per stage. With fp32 AdamW (Ψ parameters) that is the ZeRO paper's table: DP ``16Ψ``,
  stage 1 ``8Ψ + 8Ψ/N``, stage 2 ``4Ψ + 12Ψ/N``, stage 3 ``16Ψ/N`` (then ÷ tp·pp for the split layers).
  hybrid4d shards with FSDP2, i.e. ZeRO stage 3; stages 1-2 are modelled but not offered.
- activations per layer and micro-batch of ``b`` sequences (Korthikanti et al. 2022, no sequence
  parallel, their 16-bit figure × 2 for fp32): ``s·b·h·(10 + 24/t + 5·a·s/(h·t)) · 2``; ``recompute=full``
  keeps only each layer's input ``4·s·b·h`` (+ one layer's full set). Layers held = the rank's stage; the
  micro-batches in flight = ``min(m, pp − pp_rank)`` under 1F1B, ``m`` under GPipe, 1 without a pipeline.
  The last stage adds the logits and their gradient, ``2·4·b·s·V/t`` per micro-batch in flight.
- stage 3 adds one gathered block (parameters + gradients, the largest block of the stage, ÷ tp); in a
  pipeline FSDP2 reduces gradients only after the last micro-batch, so the stage's whole gradients, and
  (hybrid4d's default there: no resharding between micro-batches) its whole parameters.

**Step time** (seconds) = compute / (1 − bubble) + Σ over axes (bytes / bandwidth + collectives × latency):

- compute: ``B·s·(6Ψ + 12·L·h·s)`` FLOPs for the global batch (forward + backward), split evenly over all
  ranks, at ``flops_per_device``.
- bubble: ``(pp − 1) / (m + pp − 1)`` of the pipelined time (1F1B and GPipe alike).
- bytes each rank sends per axis: :func:`parallelkit.plan.rank_comm_bytes` (dp ring all-reduce, sharding
  reduce-scatter + all-gathers, Megatron TP ``8·b·s·h·(t−1)/t`` per layer, PP ``b·s·h`` per boundary and
  direction). Collectives per step: dp one per ``bucket_mb`` bucket; sharding one reduce-scatter and one or
  two all-gathers per block (+1 for the rest of the model); tp 4 per layer and micro-batch; pp one send per
  micro-batch, boundary and direction.
- bandwidth and latency of an axis: intra-node when every group of that axis lies inside one node. With
  ``mesh_order`` outermost → innermost, an axis's group is ``degree`` ranks ``stride`` apart (stride = the
  product of the degrees inside it); it is intra-node iff ``stride·degree`` divides ``devices_per_node``.
- No overlap of communication with compute is assumed (conservative; ranks the same way for all layouts).

Layouts that do not fit ``memory_per_device`` are discarded; the cheapest that fits wins (ties: less memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from parallelkit.distributed.parallel_dims import DEFAULT_MESH_ORDER, DP, PP, SHARDING, TP, ParallelDims
from parallelkit.errors import ConfigError

COMM_AXES = (DP, SHARDING, TP, PP)
FP32 = 4


@dataclass(frozen=True)
class Hardware:
    """What the cost model knows of the machine. Bandwidths in bytes/s per device and direction.

    Args:
        devices_per_node: processes per node (ranks ``k·n … k·n+n−1`` share a node).
        memory_per_device: bytes one rank may use.
        intra_node_bandwidth / inter_node_bandwidth: bytes/s one rank sends over the fast / slow links.
        intra_node_latency / inter_node_latency: seconds per collective or message.
        flops_per_device: achievable fp32 FLOP/s of one rank.
    """

    devices_per_node: int
    memory_per_device: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency: float
    inter_node_latency: float
    flops_per_device: float

    def __post_init__(self) -> None:
        for name in ("devices_per_node", "memory_per_device", "intra_node_bandwidth", "inter_node_bandwidth",
                     "flops_per_device"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"strategy.hardware.{name} should be a number greater than 0. Got {value!r}.")
        for name in ("intra_node_latency", "inter_node_latency"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"strategy.hardware.{name} should be a number of seconds ≥ 0. Got {value!r}.")


@dataclass
class Candidate:
    """One layout and its estimates (memory of the most loaded rank; comm per axis of the busiest rank)."""

    degrees: dict[str, int]
    zero_stage: int = 0
    microbatches: int = 1
    invalid: str | None = None
    memory: dict[str, float] = field(default_factory=dict)  # state, activations, gathered, total
    comm_bytes: dict[str, float] = field(default_factory=dict)  # the busiest pipeline rank's, per axis
    comm_bytes_by_pp_rank: list[dict[str, float]] = field(default_factory=list)  # index = pp coordinate
    comm_time: dict[str, float] = field(default_factory=dict)
    crosses_nodes: dict[str, bool] = field(default_factory=dict)
    compute_time: float = 0.0
    bubble: float = 0.0
    total_time: float = math.inf
    fits: bool = False

    @property
    def label(self) -> str:
        d = self.degrees
        return f"dp={d[DP]} sharding={d[SHARDING]} tp={d[TP]} pp={d[PP]}"

    def why_not(self, memory_per_device: float) -> str:
        if self.invalid:
            return self.invalid
        if not self.fits:
            return f"needs {_gib(self.memory['total'])} per rank > {_gib(memory_per_device)}"
        return ""


@dataclass
class AutoPlan:
    """The planner's answer: every candidate, ranked (valid and fitting first, by estimated step time)."""

    world_size: int
    hardware: Hardware
    num_params: int
    candidates: list[Candidate]

    @property
    def chosen(self) -> Candidate:
        return self.candidates[0]

    def as_dict(self) -> dict[str, Any]:
        """The chosen layout and its estimates, as written to ``summary.json`` (``auto_plan``)."""
        c = self.chosen
        return {"chosen": dict(c.degrees), "zero_stage": c.zero_stage, "microbatches": c.microbatches,
                "estimated_memory_bytes": {k: int(v) for k, v in c.memory.items()},
                "estimated_comm_bytes_per_step": {k: int(v) for k, v in c.comm_bytes.items()},
                "estimated_comm_bytes_per_step_by_pp_rank": [{k: int(v) for k, v in r.items()} for r in c.comm_bytes_by_pp_rank],
                "estimated_step_time_s": c.total_time, "candidates_fitting": sum(x.fits for x in self.candidates),
                "candidates_valid": sum(x.invalid is None for x in self.candidates)}


# ------------------------------------------------------------------------------------ enumeration
def layouts(world_size: int) -> list[dict[str, int]]:
    """Every ``(dp, sharding, tp, pp)`` whose product is ``world_size``."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    out = []
    for tp in divisors:
        for pp in divisors:
            if world_size % (tp * pp):
                continue
            rest = world_size // (tp * pp)
            for sharding in (d for d in divisors if rest % d == 0):
                out.append({DP: rest // sharding, SHARDING: sharding, TP: tp, PP: pp})
    return out


def crosses_nodes(dims: ParallelDims, axis: str, devices_per_node: int) -> bool:
    """Whether some group of ``axis`` spans two nodes (see the module docstring)."""
    degree = getattr(dims, axis)
    if degree == 1:
        return False
    order = list(dims.mesh_order)
    stride = math.prod(getattr(dims, a) for a in order[order.index(axis) + 1:])
    return devices_per_node % (stride * degree) != 0


# ------------------------------------------------------------------------------------ estimates
def activation_bytes(shape: dict[str, int], micro_batch: int, tp: int, layers: int, in_flight: int,
                     last_stage: bool, recompute: str) -> float:
    """Activations one rank keeps for backward (see the module docstring)."""
    s, h, a, v = shape["seq_len"], shape["n_embd"], max(shape["n_head"], 1), shape["vocab_size"]
    if h == 0:  # not a transformer (no width): nothing this model counts
        return 0.0
    b = micro_batch
    attention = 0.0 if recompute == "selective" else 5 * a * s / (h * tp)
    per_layer = s * b * h * (10 + 24 / tp + attention) * 2
    if recompute == "full":
        kept = layers * FP32 * s * b * h + per_layer  # inputs of every layer + one layer recomputed at a time
    else:
        kept = layers * per_layer
    logits = 2 * FP32 * b * s * v / tp if last_stage else 0.0
    return (kept + logits) * in_flight


def collectives_per_step(dims: ParallelDims, options: dict[str, Any], pp_rank: int, local_bytes: float,
                         microbatches: int, bucket_mb: float) -> dict[str, float]:
    """How many collectives (or point-to-point messages) this rank issues per step, per axis."""
    layers = options["layers_per_pp_rank"][pp_rank]
    count = dict.fromkeys(COMM_AXES, 0.0)
    if dims.sharding > 1:
        gathers = 2 if options["zero_stage"] >= 3 and options["reshard_after_forward"] else 1
        count[SHARDING] = (layers + 1) * (1 + gathers)
        count[DP] = (layers + 1) if dims.dp > 1 else 0
    elif dims.dp > 1:
        count[DP] = math.ceil(local_bytes / (bucket_mb * 2**20))
    if dims.tp > 1:
        count[TP] = 4 * layers * microbatches
    if dims.pp > 1:
        for sid in options["stage_ids"][pp_rank]:
            count[PP] += microbatches * ((sid < options["num_stages"] - 1) + (sid > 0))
    return count


def estimate(candidate: Candidate, model: Any, dims: ParallelDims, hw: Hardware, workload: dict[str, Any],
             cache: dict) -> Candidate:
    """Fill in ``candidate``'s memory, communication and time estimates (the cost model of the module docstring)."""
    from parallelkit.distributed.grad_sync import DEFAULT_BUCKET_MB
    from parallelkit.plan import plan_options, rank_comm_bytes, rank_state_bytes
    from parallelkit.strategies.hybrid4d import resolve_reshard_after_forward

    shape, m = workload["shape"], candidate.microbatches
    rank_batch = workload["global_batch_size"] // dims.data_parallel_size
    options = plan_options(model, dims, shape=shape, rank_batch=rank_batch, slots=workload["slots"],
                           zero_stage=candidate.zero_stage, schedule=workload["schedule"], cache=cache,
                           reshard_after_forward=resolve_reshard_after_forward(workload["reshard_after_forward"], dims.pp),
                           sequence_parallel=workload["sequence_parallel"], plan_source=workload["plan_source"])
    block_bytes = cache.setdefault("block_bytes", _largest_block_bytes(model))
    worst_memory: dict[str, float] = {"total": -1.0}
    comm_bytes = dict.fromkeys(COMM_AXES, 0.0)
    counts = dict.fromkeys(COMM_AXES, 0.0)
    for r in range(dims.pp):  # every rank of one pipeline rank has the same load: one representative each
        coords = {DP: 0, SHARDING: 0, TP: 0, PP: r, "ep": 0}
        state, local, expert = rank_state_bytes(model, dims, coords, options)
        in_flight = 1 if dims.pp == 1 else (m if workload["schedule"] == "gpipe" else min(m, dims.pp - r))
        act = activation_bytes(shape, rank_batch // m, dims.tp, options["layers_per_pp_rank"][r], in_flight,
                               r == dims.pp - 1, workload["recompute"])
        gathered = 0.0
        if options["zero_stage"] >= 3 and dims.pp > 1:  # no reduce-scatter before the last micro-batch: whole
            # gradients of the stage, and its whole parameters too unless each forward reshards
            gathered = local + (block_bytes / dims.tp if options["reshard_after_forward"] else local)
        elif options["zero_stage"] >= 3:
            gathered = 2 * block_bytes / dims.tp
        mem = {"state": float(sum(state.values())), "activations": act, "gathered": gathered}
        mem["total"] = mem["state"] + act + gathered
        if mem["total"] > worst_memory["total"]:
            worst_memory = mem
        sent = rank_comm_bytes(dims, coords, local, options, expert)
        candidate.comm_bytes_by_pp_rank.append({axis: float(sent[axis]) for axis in COMM_AXES})
        calls = collectives_per_step(dims, options, r, local, m, DEFAULT_BUCKET_MB)
        for axis in COMM_AXES:
            comm_bytes[axis] = max(comm_bytes[axis], sent[axis])
            counts[axis] = max(counts[axis], calls[axis])
    candidate.memory = worst_memory
    candidate.comm_bytes = comm_bytes
    for axis in COMM_AXES:
        cross = crosses_nodes(dims, axis, hw.devices_per_node)
        bw, lat = (hw.inter_node_bandwidth, hw.inter_node_latency) if cross else (hw.intra_node_bandwidth, hw.intra_node_latency)
        candidate.crosses_nodes[axis] = cross
        candidate.comm_time[axis] = comm_bytes[axis] / bw + counts[axis] * lat
    s, h, layers = shape["seq_len"], shape["n_embd"], shape["n_layer"]
    flops = workload["global_batch_size"] * s * (6 * workload["num_params"] + 12 * layers * h * s)
    candidate.compute_time = flops / dims.world_size / hw.flops_per_device
    candidate.bubble = (dims.pp - 1) / (m + dims.pp - 1)
    candidate.total_time = candidate.compute_time / (1 - candidate.bubble) + sum(candidate.comm_time.values())
    candidate.fits = candidate.memory["total"] <= hw.memory_per_device
    return candidate


def _largest_block_bytes(model: Any) -> float:
    """Bytes of the largest repeated block (``layers.i``), the unit FSDP2 gathers at a time."""
    sizes: dict[str, float] = {}
    for name, p in model.named_parameters():
        if name.startswith("layers."):
            key = name.split(".")[1]
            sizes[key] = sizes.get(key, 0.0) + p.numel() * p.element_size()
    return max(sizes.values(), default=0.0)


# ------------------------------------------------------------------------------------ the entry point
def choose_layout(cfg: Any, world_size: int, hardware: Hardware, *, max_microbatches: int = 8,
                  make_strategy: Any = None, strategy_kwargs: dict[str, Any] | None = None) -> AutoPlan:
    """Rank every layout of ``world_size`` ranks for the run ``cfg`` describes on ``hardware``.

    Args:
        cfg: the composed ``train`` config (model, data, optim, trainer, recompute).
        world_size: ranks of the job.
        hardware: the machine (see :class:`Hardware`).
        max_microbatches: upper bound on pipeline micro-batches per rank and step.
        make_strategy: builds the strategy a candidate would run (default: ``hybrid4d``); its own checks
            decide validity.
        strategy_kwargs: further arguments of ``make_strategy`` (schedule, mesh_order, ...).

    Returns:
        The :class:`AutoPlan`; ``plan.chosen`` is the best layout. Raises :class:`ConfigError` if none fits.
    """
    from parallelkit.plan import build_workload, model_shape, optimizer_slots
    from parallelkit.strategies.hybrid4d import hybrid4d

    make_strategy = make_strategy or hybrid4d
    kwargs = dict(strategy_kwargs or {})
    accumulate = cfg.trainer.get("accumulate_grad_batches", 1)
    datamodule, model = build_workload(cfg)
    workload = {"shape": model_shape(model, datamodule), "global_batch_size": datamodule.plan.global_batch_size,
                "slots": optimizer_slots(cfg.optim.optimizer._target_), "schedule": kwargs.get("schedule", "1f1b"),
                "recompute": cfg.get("recompute", "none"), "num_params": sum(p.numel() for p in model.parameters()),
                "reshard_after_forward": kwargs.get("reshard_after_forward"),  # None: hybrid4d's default per layout
                "sequence_parallel": kwargs.get("sequence_parallel", False), "plan_source": kwargs.get("plan")}
    mesh_order = tuple(kwargs.get("mesh_order", DEFAULT_MESH_ORDER))
    cache: dict = {}
    candidates = []
    for degrees in layouts(world_size):
        candidate = Candidate(degrees, zero_stage=3 if degrees[SHARDING] > 1 else 0)
        try:
            dp_size = degrees[DP] * degrees[SHARDING]
            batch = datamodule.configure(dp_size, accumulate)  # global batch divisible by dp × sharding
            if degrees[PP] > 1:
                candidate.microbatches = max(d for d in range(1, max_microbatches + 1) if batch.micro_batch_size % d == 0)
            strategy = make_strategy(**degrees, microbatches=candidate.microbatches, **kwargs)
            dims = strategy.plan(world_size)
            strategy.check_model(model, world_size)
            strategy.check_workload(model, datamodule)
        except ConfigError as err:
            candidate.invalid = str(err)
        else:
            estimate(candidate, model, ParallelDims(world_size, **degrees, mesh_order=mesh_order), hardware, workload, cache)
        candidates.append(candidate)
    candidates.sort(key=lambda c: (c.invalid is not None, not c.fits, c.total_time if c.fits else c.memory.get("total", 0.0)))
    plan = AutoPlan(world_size, hardware, workload["num_params"], candidates)
    if not plan.chosen.fits:
        valid = [c for c in candidates if c.invalid is None]
        if not valid:
            reasons = "; ".join(sorted({c.invalid for c in candidates}))[:2000]
            raise ConfigError(f"strategy=auto found no layout of {world_size} ranks that hybrid4d can run: {reasons}")
        best = min(valid, key=lambda c: c.memory["total"])
        raise ConfigError(
            f"strategy=auto: no layout of {world_size} ranks fits strategy.hardware.memory_per_device="
            f"{_gib(hardware.memory_per_device)}. The smallest needs {_gib(best.memory['total'])} per rank "
            f"({best.label}: model state {_gib(best.memory['state'])}, activations {_gib(best.memory['activations'])}). "
            "Use more devices, devices with more memory (strategy.hardware.memory_per_device), recompute=full, "
            "a smaller data.global_batch_size or a smaller model."
        )
    return plan


# ------------------------------------------------------------------------------------ output
def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**26 else f"{n / 2**20:.2f} MiB"


def _ms(seconds: float, cross: bool = False) -> str:
    return f"{seconds * 1e3:.3g}{'*' if cross else ''}"


def format_ranking(plan: AutoPlan, top: int = 8) -> str:
    """The ranking as a plain-text table: the best ``top`` layouts that fit, then those that do not, and why."""
    hw = plan.hardware
    lines = [
        f"strategy=auto: {plan.world_size} ranks ({hw.devices_per_node} per node), {plan.num_params:,} parameters, "
        f"{_gib(hw.memory_per_device)} per device, intra/inter-node {hw.intra_node_bandwidth / 1e9:.3g}/"
        f"{hw.inter_node_bandwidth / 1e9:.3g} GB/s, {hw.flops_per_device / 1e12:.3g} TFLOP/s",
        " # | dp sh tp pp | stage  m | memory/rank | compute ms | bubble | comm ms dp / sharding / tp / pp (* = across nodes) | total ms | note",
    ]
    fitting = [c for c in plan.candidates if c.fits][:top]
    unfit = [c for c in plan.candidates if c.invalid is None and not c.fits][:max(2, top // 2)]
    for i, c in enumerate(fitting + unfit, 1):
        d = c.degrees
        comm = " / ".join(_ms(c.comm_time[a], c.crosses_nodes[a]) for a in COMM_AXES)
        note = "chosen" if c is plan.chosen else ("doesn't fit: " + c.why_not(hw.memory_per_device) if not c.fits else "")
        lines.append(f"{i:2d} | {d[DP]:2d} {d[SHARDING]:2d} {d[TP]:2d} {d[PP]:2d} | {c.zero_stage:5d} {c.microbatches:2d} | "
                     f"{_gib(c.memory['total']):>11} | {_ms(c.compute_time):>10} | {c.bubble:6.1%} | {comm} | "
                     f"{_ms(c.total_time):>8} | {note}")
    invalid = [c for c in plan.candidates if c.invalid]
    if invalid:
        lines.append(f"{len(invalid)} layout(s) hybrid4d cannot run, e.g.: " + "; ".join(
            f"{c.label}: {c.invalid.split(': ', 1)[-1][:160]}" for c in invalid[:3]))
    c = plan.chosen
    slowest = max(COMM_AXES, key=lambda a: c.comm_time[a])
    lines.append(f"chosen: {c.label} — estimated {_ms(c.total_time)} ms/step, {_gib(c.memory['total'])} per rank; "
                 f"its largest communication cost is {slowest} ({_ms(c.comm_time[slowest])} ms).")
    return "\n".join(lines)
