"""Expert parallelism on the chars task: token drops and aux loss by capacity factor, all-to-all bytes against
the formulas, and tokens/s of ``ep=2`` against all experts local (``ep=1``), side by side in one run.

    python bench/moe.py             # 2 rounds × 60 steps, ~5 min on 2 shared cores
    python bench/moe.py --quick     # 1 round × 15 steps, a smoke run

Every job is ``python train.py model=moe_gpt strategy=moe trainer.devices=2 ...`` in a subprocess; the numbers
come from its ``summary.json``. Writes ``bench/results/moe.json`` (``moe_quick.json`` with ``--quick``) and
prints markdown tables.

All-to-all bytes: parallelkit sends only the routed, kept tokens (``all_to_all_single`` with split sizes),
never padding. Per rank and step, with ``L`` MoE layers, ``T`` tokens per rank, hidden size ``H``, fp32:

- routed-token formula (expected, balanced routing): ``4·L · (ep−1)/ep · T·k·(1 − dropped) · H · 4 B``
  (2 all-to-alls forward + 2 backward; a token whose expert lives on its own rank stays home);
- capacity formula (what a dispatch padded to the capacity sends, e.g. GShard's ``E×C×H`` buffers, with the
  capacity per rank-batch ``C = cf·T·k/E``): ``4·L · (ep−1)/ep · cf·T·k · H · 4 B`` — an upper bound here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CAPACITY_FACTORS = (1.0, 1.25, 2.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round × 15 steps")
    parser.add_argument("--rounds", type=int, default=2, help="speed rounds (ep=2 and ep=1 alternate)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--num-experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--table", action="store_true", help="print the tables of the saved results and exit (runs nothing)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 1, 15
    return args


def run_job(args: argparse.Namespace, run_dir: Path, ep: int, capacity_factor: float) -> dict:
    cmd = [
        sys.executable, str(ROOT / "train.py"), "model=moe_gpt", "strategy=moe", f"strategy.ep={ep}", "trainer.devices=2",
        f"model.n_layer={args.n_layer}", f"model.n_embd={args.n_embd}", "model.n_head=4",
        f"model.num_experts={args.num_experts}", f"model.top_k={args.top_k}", f"model.capacity_factor={capacity_factor}",
        f"data.seq_len={args.seq_len}", f"data.global_batch_size={args.global_batch_size}",
        f"trainer.max_steps={args.steps}", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false", f"hydra.run.dir={run_dir}",
    ]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["wall_s"] = time.perf_counter() - started
    return summary


def formulas(args: argparse.Namespace, ep: int, capacity_factor: float, dropped: float) -> dict[str, float]:
    tokens_per_rank = args.global_batch_size // 2 * args.seq_len
    per_exchange = (ep - 1) / ep * tokens_per_rank * args.top_k * args.n_embd * 4
    exchanges = 4 * args.n_layer
    return {
        "routed_tokens_bytes": exchanges * per_exchange * (1 - dropped),
        "capacity_bytes": exchanges * per_exchange * capacity_factor,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.table:
        print(markdown(json.loads((ROOT / "bench" / "results" / ("moe_quick.json" if args.quick else "moe.json")).read_text())))
        return
    results: dict = {"args": {k: v for k, v in vars(args).items() if k != "table"}, "capacity": {}, "speed": {"ep2": [], "ep1": []}}
    with tempfile.TemporaryDirectory(prefix="bench_moe_") as tmp:
        tmp_dir = Path(tmp)
        for cf in CAPACITY_FACTORS:
            s = run_job(args, tmp_dir / f"cf{cf}", ep=2, capacity_factor=cf)
            measured = s["comm"]["by_kind"]["moe_all_to_all"]["bytes_per_step"]
            dropped = s["moe"]["dropped_frac"]
            results["capacity"][str(cf)] = {
                "dropped_frac": dropped,
                "aux_loss_mean": s["moe"]["aux_loss_mean"],
                "final_loss": s["final_loss"],
                "all_to_all_bytes_per_step": measured,
                "all_to_all_per_step": s["comm"]["by_kind"]["moe_all_to_all"]["collectives_per_step"],
                **formulas(args, 2, cf, dropped),
                "tokens_per_expert": s["moe"]["tokens_per_expert"],
            }
            print(f"cf={cf}: dropped {dropped:.4f}, aux {s['moe']['aux_loss_mean']:.4f}", flush=True)
        for round_ in range(args.rounds):
            for ep in ((2, 1) if round_ % 2 == 0 else (1, 2)):
                s = run_job(args, tmp_dir / f"speed{round_}_ep{ep}", ep=ep, capacity_factor=1.25)
                results["speed"][f"ep{ep}"].append(
                    {"tokens_per_s": s["samples_per_s"] * args.seq_len, "step_time_s_median": s["step_time_s_median"], "final_loss": s["final_loss"]}
                )
                print(f"round {round_} ep={ep}: {s['samples_per_s'] * args.seq_len:,.0f} tokens/s", flush=True)
    add_ratios(results)
    out = ROOT / "bench" / "results" / ("moe_quick.json" if args.quick else "moe.json")
    out.write_text(json.dumps(results, indent=2))
    print(markdown(results))
    print(f"\nwrote {out}")


def add_ratios(results: dict) -> None:
    """ep=2 over ep=1 tokens/s, per round (the two jobs of a round run back to back): median and range."""
    speed = results["speed"]
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(speed["ep2"], speed["ep1"])]
    speed["ratios_ep2_over_ep1"] = ratios
    speed["ratio_ep2_over_ep1"] = statistics.median(ratios)


def load_results() -> dict:
    return json.loads((ROOT / "bench" / "results" / "moe.json").read_text())


def tables(results: dict) -> dict[str, str]:
    """The Markdown tables of saved results: ``capacity`` and ``speed`` (``--table``; bench/docs_tables.py)."""
    return dict(zip(("capacity", "speed"), markdown(results).split("\n\n")))


def markdown(results: dict) -> str:
    lines = [
        "| capacity factor | dropped assignments | aux loss (mean) | final loss | all-to-all bytes/step/rank | routed-token formula | ratio "
        "| capacity formula | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cf, r in results["capacity"].items():
        m = r["all_to_all_bytes_per_step"]
        lines.append(
            f"| {cf} | {r['dropped_frac']:.2%} | {r['aux_loss_mean']:.4f} | {r['final_loss']:.4f} | {m:,.0f} | "
            f"{r['routed_tokens_bytes']:,.0f} | {m / r['routed_tokens_bytes']:.3f} | {r['capacity_bytes']:,.0f} | {m / r['capacity_bytes']:.3f} |"
        )
    speed = results["speed"]
    lines += [
        "",
        "| experts | tokens/s (median) | × all local, per round: median (range) |",
        "|---|---:|---:|",
        f"| ep=2 (2 per rank, all-to-all) | {statistics.median(r['tokens_per_s'] for r in speed['ep2']):,.0f} | "
        f"{speed['ratio_ep2_over_ep1']:.3f} ({min(speed['ratios_ep2_over_ep1']):.2f}–{max(speed['ratios_ep2_over_ep1']):.2f}, "
        f"{len(speed['ratios_ep2_over_ep1'])} rounds) |",
        f"| ep=1 (all 4 on every rank) | {statistics.median(r['tokens_per_s'] for r in speed['ep1']):,.0f} | 1.000 |",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
