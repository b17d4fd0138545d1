"""What the planner prints and writes: the ranking with the terms that decided it, and ``--json`` with everything."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from parallelkit.distributed.parallel_dims import CP, DP, EP, PP, SHARDING, TP
from parallelkit.planner.search import AutoPlan, Candidate, gib

TERMS = ("compute", "recompute", "bubble", "comm_dp", "comm_sharding", "comm_cp", "comm_tp", "comm_pp", "comm_ep", "optimizer", "host")


def best_per_layout(plan: AutoPlan) -> list[Candidate]:
    """The best batch cut (sequence parallelism or not, cp mode) of every degree set, in ranking order."""
    seen, out = set(), []
    for c in plan.candidates:
        key = c.layout.dims
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g}"


def _cut(c: Candidate) -> str:
    lay = c.layout
    sp = (" sp" if lay.sequence_parallel else "") + (" uly" if lay.cp > 1 and lay.cp_mode == "ulysses" else "")
    if lay.pp > 1:
        return f"{lay.micro_batch}×{lay.microbatches}" + (f" v{lay.virtual_stages}" if lay.virtual_stages > 1 else "") + sp
    return f"{lay.micro_batch}×{lay.accumulate}a{sp}"


def deciding_terms(a: Candidate, b: Candidate, top: int = 3) -> str:
    """The time terms where ``a`` and ``b`` differ most, as ``term +x ms`` (positive: ``b`` pays more)."""
    ta, tb = a.time.as_dict(), b.time.as_dict()
    diffs = sorted(((tb.get(k, 0.0) - ta.get(k, 0.0), k) for k in TERMS), key=lambda d: -abs(d[0]))
    return ", ".join(f"{k} {d * 1e3:+.3g} ms" for d, k in diffs[:top] if abs(d) > 0)


def format_ranking(plan: AutoPlan, top: int = 8) -> str:
    """The ranking as a plain-text table: the best ``top`` layouts that fit, then some that do not and why."""
    hw, w = plan.hardware, plan.workload
    layouts = best_per_layout(plan)
    fitting = [c for c in layouts if c.fits][:top]
    unfit = [c for c in layouts if c.invalid is None and not c.fits][:max(2, top // 2)]
    shape = w.shape
    lines = [
        f"strategy=auto: {plan.world_size} ranks ({hw.devices_per_node} per node, profile {hw.name}), {plan.num_params:,} parameters "
        f"({shape.family}, {shape.layers} layers × {shape.hidden}, vocabulary {shape.vocab:,}{', tied' if shape.tied else ''}), "
        f"seq {w.seq_len}, batch {w.global_batch if w.global_batch is not None else str(w.per_rank_batch) + '/rank'}, "
        f"precision {w.precision.name}, recompute={w.recompute}; {gib(hw.usable_memory)} usable per device",
        " # | dp sh cp tp pp ep | micro×m (sp: seq. parallel, uly: cp all-to-all) | memory/rank (state+gathered+act) | compute | recomp | bubble "
        "| comm ms dp / sh / cp / tp / pp / ep (* = across nodes) | optim+host | total ms | tok/s/dev | note",
    ]
    for i, c in enumerate(fitting + unfit, 1):
        lay, t = c.layout, c.time
        comm = " / ".join(_ms(t.comm[a]) + ("*" if t.crosses.get(a) else "") for a in (DP, SHARDING, CP, TP, PP, EP))
        note = "chosen" if c is plan.chosen else ("doesn't fit: " + c.why_not(hw.usable_memory) if not c.fits else "")
        if t.shared_units_floor:
            note += (" " if note else "") + "(node's shared cores bound it)"
        mem = f"{gib(c.memory['total'])} ({gib(c.memory['state'])}+{gib(c.memory['gathered'])}+{gib(c.memory['activations'] + c.memory['logits'])})"
        lines.append(f"{i:2d} | {lay.dp:2d} {lay.sharding:2d} {lay.cp:2d} {lay.tp:2d} {lay.pp:2d} {lay.ep:2d} | {_cut(c):>26} | {mem:>33} | "
                     f"{_ms(t.compute):>7} | {_ms(t.recompute):>6} | {_ms(t.bubble):>6} | {comm} | {_ms(t.optimizer + t.host):>5} | "
                     f"{_ms(t.total):>8} | {c.tokens_per_s_per_device:9.4g} | {note}")
    invalid = [c for c in layouts if c.invalid]
    if invalid:
        lines.append(f"{len(invalid)} layout(s) hybrid4d cannot run, e.g.: " + "; ".join(
            f"{c.label}: {c.invalid[:140]}" for c in invalid[:3]))
    c = plan.chosen
    lines.append(f"chosen: {c.label}, micro-batch {c.layout.micro_batch} × {c.layout.micro_steps}"
                 f"{' (accumulate)' if c.layout.pp == 1 and c.layout.accumulate > 1 else ''} — estimated {_ms(c.total_time)} ms/step, "
                 f"{c.tokens_per_s_per_device:.4g} tokens/s per device, {gib(c.memory['total'])} per rank.")
    runner = next((x for x in fitting if x is not c), None)
    if runner is not None:
        lines.append(f"deciding terms against the runner-up {runner.label} ({_ms(runner.total_time)} ms): {deciding_terms(c, runner)}.")
    return "\n".join(lines)


def plan_json(plan: AutoPlan) -> dict[str, Any]:
    """Everything: the workload, the hardware, every candidate (layout, memory and time terms, fits or why not), the choice."""
    w = plan.workload
    return {
        "world_size": plan.world_size,
        "workload": {"shape": vars(w.shape), "num_params": w.num_params, "seq_len": w.seq_len, "global_batch": w.global_batch,
                     "per_rank_batch": w.per_rank_batch, "precision": vars(w.precision), "recompute": w.recompute,
                     "optimizer_slots": w.optimizer_slots, "attention": w.attention,
                     "runtime": vars(w.runtime)},
        "hardware": plan.hardware.as_dict(),
        "chosen": plan.chosen.as_dict(),
        "candidates": [c.as_dict() for c in plan.candidates],
    }


def write_json(plan: AutoPlan, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan_json(plan), indent=1, default=list))
    return path
