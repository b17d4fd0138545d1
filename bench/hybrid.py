"""Every hybrid4d layout of one GPT on 8 ranks: measured bytes against the planner's estimates, and its choice.

For ``model=gpt`` (4 layers, 4 heads, width 128, sequence 64, global batch 32 — the config defaults) on 8
processes, :func:`parallelkit.auto_plan.choose_layout` lists every ``dp × sharding × tp × pp = 8`` and the
layouts ``strategy=hybrid4d`` can run, with its estimates. Each runnable layout is then trained for a few
steps with ``python train.py strategy=hybrid4d ...`` (the same micro-batches the planner assumed), and the
table puts side by side, per layout:

- model-state bytes of the most loaded rank (params + grads + optimizer): the estimate against
  ``summary.json`` ``model_state_bytes`` (max over ranks of each), with the ratio estimate / measured;
- bytes sent per step on each axis by global rank 0 (``summary.json`` ``comm`` is rank 0's own counter; rank 0
  is the first pipeline stage, which sends activations forward only): the planner's estimate for that rank
  against ``comm.by_kind``, kinds mapped to axes — dp ``grad_allreduce``/``grad_all_reduce``, sharding ``grad_reduce_scatter`` +
  ``param_all_gather``, tp every ``tp*`` kind, pp ``pp_p2p`` (loss broadcast and metrics are left out);
- the measured median step time and the planner's estimated step time and rank.

The planner's choice (what ``strategy=auto trainer.devices=8`` trains with) is marked.

    python bench/hybrid.py                  # every runnable layout, 3 steps each (~10-15 min on 2 shared cores)
    python bench/hybrid.py --steps 2        # quicker

Writes ``bench/results/hybrid.json`` and prints a Markdown table for the README.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AXES = ("dp", "sharding", "tp", "pp")
WORKLOAD = ["model=gpt", "data=chars"]


def axis_of(kind: str) -> str | None:
    """The mesh axis a ``comm.by_kind`` entry belongs to (None: not model traffic)."""
    if kind in ("grad_allreduce", "grad_all_reduce"):
        return "dp"
    if kind in ("grad_reduce_scatter", "param_all_gather"):
        return "sharding"
    if kind.startswith("tp"):
        return "tp"
    if kind == "pp_p2p":
        return "pp"
    return None


def measured_comm(summary: dict) -> dict[str, float]:
    out = dict.fromkeys(AXES, 0.0)
    for kind, value in summary["comm"]["by_kind"].items():
        axis = axis_of(kind)
        if axis:
            out[axis] += value["bytes_per_step"]
    return out


def train(overrides: list[str], run_dir: Path, steps: int, timeout: float) -> dict:
    command = [sys.executable, str(ROOT / "train.py"), *WORKLOAD, *overrides, "trainer.devices=8",
               f"trainer.max_steps={steps}", "trainer.limit_val_batches=0", f"trainer.log_every_n_steps={steps}",
               "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per layout (≥ 2: step time needs two)")
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args(argv)

    from parallelkit.auto_plan import choose_layout
    from parallelkit.plan import compose_config
    from parallelkit.strategies.auto import AutoStrategy

    cfg = compose_config([*WORKLOAD, "strategy=auto"])
    auto = AutoStrategy()
    hardware = auto.resolve_hardware(8)  # this machine's defaults, as strategy=auto trainer.devices=8 uses
    plan = choose_layout(cfg, 8, hardware)
    runnable = [c for c in plan.candidates if c.invalid is None]
    rank_of = {id(c): i for i, c in enumerate(runnable, 1)}
    results = {"workload": {"overrides": WORKLOAD, "world_size": 8, "steps": args.steps, "num_params": plan.num_params},
               "hardware": vars(hardware), "chosen": plan.chosen.degrees,
               "not_runnable": [{"degrees": c.degrees, "why": c.invalid} for c in plan.candidates if c.invalid],
               "layouts": []}
    with tempfile.TemporaryDirectory(prefix="pk_bench_hybrid_") as tmp:
        for i, c in enumerate(runnable):
            overrides = ["strategy=hybrid4d", *(f"strategy.{k}={v}" for k, v in c.degrees.items()),
                         f"strategy.microbatches={c.microbatches}"]
            start = time.time()
            summary = train(overrides, Path(tmp) / f"layout{i}", args.steps, args.timeout)
            print(f"[{i + 1}/{len(runnable)}] {c.label}: {time.time() - start:.0f} s", file=sys.stderr, flush=True)
            state = sum(summary["model_state_bytes"].values())
            comm = measured_comm(summary)
            rank0 = c.comm_bytes_by_pp_rank[0]  # global rank 0 has pp coordinate 0 in every mesh order
            results["layouts"].append({
                "degrees": c.degrees, "microbatches": c.microbatches, "chosen": c is plan.chosen,
                "planner_rank": rank_of[id(c)], "fits": c.fits,
                "estimated_state_bytes": c.memory["state"], "measured_state_bytes": state,
                "state_ratio": c.memory["state"] / state,
                "estimated_comm_bytes": rank0, "measured_comm_bytes": comm,
                "estimated_comm_bytes_busiest_rank": c.comm_bytes,
                "comm_ratio": {a: (rank0[a] / comm[a] if comm[a] else None) for a in AXES if rank0[a] or comm[a]},
                "estimated_step_time_s": c.total_time, "measured_step_time_s": summary["step_time_s_median"],
                "measured_dims": summary["dims"], "train_loss": summary["train_loss"],
            })
    out = ROOT / "bench" / "results" / "hybrid.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(markdown(results))
    print(f"\nwrote {out}")


def _kib(n: float) -> str:
    return f"{n / 1024:,.0f}"


def markdown(results: dict) -> str:
    lines = [
        "| layout (dp×sh×tp×pp) | state KiB, max rank: est. / meas. (ratio) | comm KiB/step of rank 0: est. / meas. (ratio) per axis "
        "| step ms meas. | planner est. ms (rank) |",
        "|---|---|---|---|---|",
    ]
    for row in results["layouts"]:
        d = row["degrees"]
        layout = "×".join(str(d[a]) for a in AXES) + (" **← auto**" if row["chosen"] else "")
        comm = "; ".join(
            f"{a} {_kib(row['estimated_comm_bytes'][a])} / {_kib(row['measured_comm_bytes'][a])}"
            + (f" ({row['comm_ratio'][a]:.2f})" if row["comm_ratio"].get(a) else "")
            for a in AXES if a in row["comm_ratio"]) or "none"
        lines.append(
            f"| {layout} | {_kib(row['estimated_state_bytes'])} / {_kib(row['measured_state_bytes'])} "
            f"({row['state_ratio']:.2f}) | {comm} | {row['measured_step_time_s'] * 1e3:.0f} | "
            f"{row['estimated_step_time_s'] * 1e3:.1f} ({row['planner_rank']}) |"
        )
    ratios = [r["state_ratio"] for r in results["layouts"]] + [
        v for r in results["layouts"] for v in r["comm_ratio"].values() if v]
    lines.append("")
    lines.append(f"Estimate / measured over all layouts and axes: {min(ratios):.2f} – {max(ratios):.2f}. "
                 f"{len(results['not_runnable'])} layouts hybrid4d cannot run were skipped.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
