"""Per-rank model-state bytes and traffic of DP and ZeRO stages 1/2/3 against the ZeRO paper's formulas.

For N = 2 and 4 ranks it runs ``train.py`` (``model=gpt``, the default size) with ``strategy=ddp`` and
``strategy=zero strategy.stage=1|2|3`` and reads ``summary.json``:

* memory: ``model_state_bytes`` (params + grads + optimizer, everything the strategy keeps per rank, DDP's
  gradient buckets included) beside the formula for fp32 Adam with Ψ parameters (DP 16Ψ, stage 1 8Ψ+8Ψ/N,
  stage 2 4Ψ+12Ψ/N, stage 3 16Ψ/N);
* traffic: counted bytes sent per step and rank (at the algorithms gloo runs, its message headers included)
  beside the theory (DP and stages 1-2: 2(N−1)/N·4Ψ, stage 3: 1.5× that less one gather of the root unit,
  which FSDP2 keeps gathered from forward into backward: :func:`theory_sent`), and the bytes that really left each
  process (``summary.json`` ``os_bytes_written``:
  the kernel's count of what the process handed to ``write``/``writev``, which gloo's TCP transport sends
  with), per step, from the difference of a long and a short run (which cancels start-up traffic and the
  files written). It is per process, so other jobs on the machine do not disturb it — unlike the loopback
  interface's counter (``/sys/class/net/lo/statistics/tx_bytes``), still recorded as ``sent_loopback``.

DeepSpeed's rows come from ``bench/memory_deepspeed.py`` (merged if its results file exists).

    python bench/memory.py                   # writes bench/results/memory.json and memory.png, prints the table
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
LOOPBACK = Path("/sys/class/net/lo/statistics/tx_bytes")

CONTENDERS = {  # name → (strategy overrides, ZeRO stage of the formula)
    # DDP's default keeps its gradient buckets besides p.grad (4Ψ more than the formula's DP)
    "DP (ddp)": (["strategy=ddp"], 0),
    "DP (ddp, gradient_as_bucket_view)": (["strategy=ddp", "strategy.gradient_as_bucket_view=true"], 0),
    "zero stage 1": (["strategy=zero", "strategy.stage=1"], 1),
    "zero stage 2": (["strategy=zero", "strategy.stage=2"], 2),
    "zero stage 3": (["strategy=zero", "strategy.stage=3"], 3),
}


def formula_bytes(stage: int, psi: int, n: int) -> float:
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]


def theory_sent(stage: int, psi: int, n: int) -> float:
    """DP and stages 1-2: the ring all-reduce's 2(N−1)/N·4Ψ. Stage 3: every gradient reduce-scattered once, each
    block gathered in forward and again in backward, the root unit (embeddings, final norm, head) once, as it
    stays gathered from forward into backward (FSDP2's root default): the paper's 1.5× less one gather of the root."""
    ring = 2 * (n - 1) / n * 4 * psi
    if stage != 3:
        return ring
    import yaml

    gpt = yaml.safe_load((REPO / "conf" / "model" / "gpt.yaml").read_text())
    d = gpt["n_embd"]
    blocks = gpt["n_layer"] * (12 * d * d + 13 * d)  # attention 4(d² + d), MLP 8d² + 5d, two LayerNorms 4d (bias: true)
    return (n - 1) / n * 4 * (psi + 2 * blocks + (psi - blocks))


def loopback_bytes() -> int | None:
    try:
        return int(LOOPBACK.read_text())
    except OSError:
        return None


def run(overrides: list[str], n: int, steps: int, workdir: Path) -> tuple[dict, int | None]:
    run_dir = workdir / f"run{len(list(workdir.iterdir()))}"
    args = [
        *overrides,
        f"trainer.devices={n}",
        f"trainer.max_steps={steps}",
        "trainer.limit_val_batches=0",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "checkpoint.every_n_steps=0",
        f"hydra.run.dir={run_dir}",
    ]
    before = loopback_bytes()
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True, timeout=900)
    after = loopback_bytes()
    if proc.returncode != 0:
        raise SystemExit(f"train.py {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    lo = after - before if before is not None and after is not None else None
    return json.loads((run_dir / "summary.json").read_text()), lo


def measure(ranks: list[int], steps: tuple[int, int]) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in ranks:
            for name, (overrides, stage) in CONTENDERS.items():
                short, lo_short = run(overrides, n, steps[0], Path(tmp))
                long, lo_long = run(overrides, n, steps[1], Path(tmp))
                psi = long["num_params"]
                state = long["model_state_bytes"]
                total = sum(state.values())
                counted = long["comm"]["bytes_sent_per_step"] - long["comm"]["by_kind"].get("metrics", {}).get("bytes_per_step", 0)
                wire = (lo_long - lo_short) / (steps[1] - steps[0]) / n if lo_short is not None else None
                written = (long["os_bytes_written"] - short["os_bytes_written"]) / (steps[1] - steps[0])
                rows.append({
                    "contender": name, "backend": "parallelkit", "ranks": n, "stage": stage, "num_params": psi, **state,
                    "total": total, "formula": formula_bytes(stage, psi, n), "ratio": total / formula_bytes(stage, psi, n),
                    "sent_counted": counted, "sent_theory": theory_sent(stage, psi, n), "sent_loopback": wire,
                    "sent_written": written,
                })
                print(f"N={n} {name}: {total / 2**20:.2f} MiB (×{rows[-1]['ratio']:.3f} of formula), "
                      f"sent {counted / 2**20:.2f} MiB/step (theory {rows[-1]['sent_theory'] / 2**20:.2f}, written by the process "
                      f"{written / 2**20:.3f}, loopback {'-' if wire is None else f'{wire / 2**20:.2f}'})", flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    def mib(v: float | None) -> str:
        return "-" if v is None else f"{v / 2**20:.2f}"

    lines = [
        "| N | strategy | params | grads | optimizer | total MiB | formula MiB | measured / formula | sent MiB/step (counted) | theory "
        "| written by the process | written / theory |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['ranks']} | {r['contender']} | {mib(r['params'])} | {mib(r['grads'])} | {mib(r['optimizer'])} | {mib(r['total'])} | "
            f"{mib(r['formula'])} | {r['ratio']:.3f} | {mib(r.get('sent_counted'))} | {mib(r.get('sent_theory'))} | {mib(r.get('sent_written'))} | "
            f"{'-' if r.get('sent_written') is None else format(r['sent_written'] / r['sent_theory'], '.3f')} |"
        )
    return "\n".join(lines)


def load_results() -> dict:
    return json.loads((RESULTS / "memory.json").read_text())


def tables(results: dict) -> dict[str, str]:
    """The Markdown table of saved results (``--table``; docs/benchmarks.md, bench/docs_tables.py)."""
    return {"": markdown(results["rows"])}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({r["ranks"] for r in rows})
    fig, axes = plt.subplots(1, len(ranks), figsize=(6 * len(ranks), 4), sharey=True)
    for ax, n in zip(axes if len(ranks) > 1 else [axes], ranks):
        subset = [r for r in rows if r["ranks"] == n]
        x = range(len(subset))
        bottom = [0.0] * len(subset)
        for key, colour in (("params", "#4C72B0"), ("grads", "#DD8452"), ("optimizer", "#55A868")):
            values = [r[key] / 2**20 for r in subset]
            ax.bar(x, values, bottom=bottom, color=colour, label=key)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.scatter(list(x), [r["formula"] / 2**20 for r in subset], color="black", marker="_", s=600, zorder=3, label="ZeRO formula")
        ax.set_xticks(list(x), [r["contender"].replace(" ", "\n", 1) for r in subset], fontsize=8)
        ax.set_title(f"N = {n} ranks")
        ax.set_ylabel("model-state MiB per rank")
    (axes[0] if len(ranks) > 1 else axes).legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, nargs=2, default=[2, 7], help="short and long run (their difference is the traffic of the extra steps)")
    parser.add_argument("--keep-other-ranks", action="store_true", help="keep saved parallelkit rows for ranks not measured now")
    parser.add_argument("--table", action="store_true", help="print the table of bench/results/memory.json and exit (runs nothing)")
    args = parser.parse_args(argv)
    if args.table:
        print(tables(load_results())[""])
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = measure(args.ranks, tuple(args.steps))
    previous = RESULTS / "memory.json"
    if args.keep_other_ranks and previous.exists():  # re-measure some N, keep the saved rows of the others
        rows += [r for r in json.loads(previous.read_text())["rows"] if r["backend"] == "parallelkit" and r["ranks"] not in args.ranks]
        rows.sort(key=lambda r: r["ranks"])
    deepspeed = RESULTS / "memory_deepspeed.json"
    if deepspeed.exists():
        rows += json.loads(deepspeed.read_text()).get("rows", [])
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "memory.json").write_text(json.dumps({"rows": rows}, indent=2))
    plot(rows, RESULTS / "memory.png")
    print(markdown(rows))


if __name__ == "__main__":
    main()
