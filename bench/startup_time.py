"""Start-up of ``strategy=deepspeed`` beside ``strategy=zero``: seconds from the command to the first finished step.

Each contender is ``python train.py strategy=S strategy.stage=2 trainer.devices=2`` on the default GPT (2 gloo
ranks, 3 steps, no validation) run as a subprocess; on rank 0 a callback of this file (:class:`FirstStep`)
prints the wall-clock time at the end of the first optimizer step. What it measures is what a user waits
for: imports, launching the second rank, the config, the data, the model, the engine, and the first step.

- ``zero``: parallelkit's own ZeRO (no compiled ops);
- ``deepspeed (cold)``: DeepSpeed with an empty ``TORCH_EXTENSIONS_DIR`` (a new machine or a new cache: any
  op DeepSpeed would JIT-compile with gcc is compiled now);
- ``deepspeed (warm)``: the same cache directory again (what was compiled is loaded).

The contenders are interleaved, ``--rounds`` times, so machine noise hits them alike; the table shows the
median of each and its ratio to ``zero``'s (the median of the per-round ratios, with their range).

    python bench/startup_time.py                 # 3 rounds, about 3 minutes on 2 cores
    python bench/startup_time.py --rounds 1      # a smoke run

Writes ``bench/results/startup_time.json`` and prints the Markdown table of docs/benchmarks.md (``--table``: of the
saved results; ``python bench/docs_tables.py`` writes it into the page).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback

ROOT = Path(__file__).resolve().parent.parent
STAMP = "startup_time: first step done at "


class FirstStep(Callback):
    """On global rank 0, print the wall-clock time at the end of the first optimizer step (to stderr)."""

    def __init__(self) -> None:
        self.done = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 0 and trainer.global_step >= 1 and not self.done:
            self.done = True
            print(f"{STAMP}{time.time():.3f}", file=sys.stderr, flush=True)


def run_once(strategy: str, extensions_dir: Path, run_dir: Path, timeout_s: float) -> dict:
    """One job; the seconds from its start to the first finished step and to its exit."""
    command = [sys.executable, str(ROOT / "train.py"), f"strategy={strategy}", "strategy.stage=2", "trainer.devices=2",
               "trainer.max_steps=3", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
               "trainer.enable_model_summary=false", "+callbacks.first_step._target_=startup_time.FirstStep",
               f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions_dir),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])}
    start = time.time()
    proc = subprocess.run(command, cwd=run_dir.parent, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.time() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{strategy} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    stamp = re.search(re.escape(STAMP) + r"([\d.]+)", proc.stderr)
    if stamp is None:
        raise RuntimeError(f"{strategy}: no first-step stamp in its output:\n{proc.stderr[-3000:]}")
    built = sorted({p.parent.name for p in extensions_dir.rglob("*.so")}) if extensions_dir.exists() else []
    return {"first_step_s": float(stamp.group(1)) - start, "wall_s": wall, "extensions_built": built}


def markdown(table: list[dict]) -> str:
    lines = ["| start-up (2 ranks, default GPT, stage 2) | to the first step (median) | × zero | whole job (3 steps) | ops compiled |",
             "|---|---:|---:|---:|---|"]
    for row in table:
        low, high = row["ratio_range"]
        lines.append(f"| {row['contender']} | {row['first_step_s_median']:.1f} s | {row['ratio_median']:.2f} ({low:.2f}–{high:.2f}) | "
                     f"{row['wall_s_median']:.1f} s | {', '.join(row['extensions_built']) or 'none'} |")
    return "\n".join(lines)


def load_results() -> dict:
    return json.loads((ROOT / "bench" / "results" / "startup_time.json").read_text())


def tables(results: dict) -> dict[str, str]:
    """The Markdown table of saved results (``--table``; bench/docs_tables.py)."""
    return {"": markdown(results["table"])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per job (a cold DeepSpeed build took ~65 s)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "startup_time.json")
    parser.add_argument("--table", action="store_true", help="print the table(s) of the saved results and exit (runs nothing)")
    args = parser.parse_args(argv)
    if args.table:
        print(tables(json.loads(args.out.read_text()))[""])
        return

    results: dict[str, list[dict]] = {"zero": [], "deepspeed (cold)": [], "deepspeed (warm)": []}
    with tempfile.TemporaryDirectory(prefix="pk_startup_") as tmp:
        tmp = Path(tmp)
        for round_ in range(args.rounds):
            cache = tmp / f"extensions_{round_}"  # empty: the cold run compiles into it, the warm run reads it
            for name, strategy in (("zero", "zero"), ("deepspeed (cold)", "deepspeed"), ("deepspeed (warm)", "deepspeed")):
                run_dir = tmp / f"{round_}_{strategy}_{len(results[name])}"
                shutil.rmtree(run_dir, ignore_errors=True)
                results[name].append(run_once(strategy, cache if strategy == "deepspeed" else tmp / "unused", run_dir, args.timeout))
                row = results[name][-1]
                print(f"round {round_ + 1}: {name:17s} first step {row['first_step_s']:6.1f} s, whole job {row['wall_s']:6.1f} s, "
                      f"compiled ops in the cache: {row['extensions_built'] or 'none'}", flush=True)

    table = []
    for name, rows in results.items():
        ratios = [r["first_step_s"] / z["first_step_s"] for r, z in zip(rows, results["zero"])]
        table.append({"contender": name, "first_step_s_median": statistics.median(r["first_step_s"] for r in rows),
                      "wall_s_median": statistics.median(r["wall_s"] for r in rows), "ratio_median": statistics.median(ratios),
                      "ratio_range": [min(ratios), max(ratios)], "extensions_built": rows[-1]["extensions_built"]})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": platform.node(), "cpus": os.cpu_count(), "rounds": args.rounds,
                                    "date": time.strftime("%Y-%m-%d"), "table": table, "runs": results}, indent=2) + "\n")
    print("\n" + markdown(table))


if __name__ == "__main__":
    main()
