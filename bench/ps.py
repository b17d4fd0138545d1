"""Parameter-server bridge: bytes per step against ``U·(8 + 4·D)·2``, server memory against the rows touched,
for a 10^5- and a 10^7-row id space per field, and sync / async / geo side by side (samples/s, AUC).

    python bench/ps.py            # 6 jobs × 60 steps, ~3 min on 2 shared cores
    python bench/ps.py --quick    # 3 jobs × 20 steps, a smoke run

Every job is ``python train.py strategy=ps model=ctr data=ctr optim=adagrad trainer.devices=3 ...`` (2 workers
+ 1 server, or 1 worker + 2 servers) in a subprocess; the numbers come from its ``summary.json``. Writes
``bench/results/ps.json`` (``ps_quick.json`` with ``--quick``) and prints a markdown table.

What is counted (``summary.json`` → ``ps``): the tensor payloads a worker sends and receives over RPC per
training step (pull: ids out, rows back; push: ids and gradient rows out); RPC framing is not counted. The
formula uses ``U`` = the unique ids of each of the worker's batches, as the worker saw them. A dense table of
the same id space would hold ``8 · rows_per_field · D · 4`` bytes of values alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 jobs × 20 steps")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 20
    return args


def run_job(run_dir: Path, steps: int, rows_per_field: int, mode: str = "sync", servers: int = 1) -> dict:
    cmd = [
        sys.executable, str(ROOT / "train.py"), "strategy=ps", f"strategy.mode={mode}", f"strategy.servers={servers}",
        "strategy.geo_k_steps=5", "model=ctr", "data=ctr", "optim=adagrad", "trainer.devices=3",
        f"data.rows_per_field={rows_per_field}", f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(cmd, cwd=run_dir.parent, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    ps, table = summary["ps"], summary["ps"]["tables"]["embedding"]
    dim = 16
    return {
        "mode": mode, "servers": servers, "workers": ps["workers"], "rows_per_field": rows_per_field, "steps": summary["steps"],
        "bytes_per_step": ps["bytes_per_step"], "formula_bytes_per_step": ps["formula_bytes_per_step"], "bytes_ratio": ps["bytes_ratio"],
        "server_rows": table["rows"], "unique_ids_touched": table["unique_ids_touched"], "server_row_bytes": table["row_bytes"],
        "server_allocated_bytes": table["allocated_bytes"], "dense_table_bytes": 8 * rows_per_field * dim * 4,
        "peak_rss_bytes": summary["peak_rss_bytes"], "server_peak_rss_bytes": ps["server_peak_rss_bytes"], "samples_per_s": summary["samples_per_s"], "step_time_s_median": summary["step_time_s_median"],
        "val_auc": summary["val_auc"], "bayes_auc": summary["data"]["bayes_auc"], "final_loss": summary["final_loss"],
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    jobs = [(10**5, "sync", 1), (10**7, "sync", 1), (10**7, "async", 1)]
    if not args.quick:
        jobs += [(10**7, "geo", 1), (10**7, "sync", 2), (10**5, "async", 1)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_ps_") as tmp:
        for i, (size, mode, servers) in enumerate(jobs):
            rows.append(run_job(Path(tmp) / f"job{i}", args.steps, size, mode, servers))
            print(f"done: {mode} servers={servers} rows_per_field={size:.0e}", file=sys.stderr, flush=True)
    out = ROOT / "bench" / "results" / ("ps_quick.json" if args.quick else "ps.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": args.steps, "global_batch_size": 256, "embedding_dim": 16, "jobs": rows}, indent=2))
    print("| mode | servers × workers | id space / field | bytes/step/worker | ÷ U·(8+4D)·2 | server rows = touched | table MiB on servers (dense MiB) | server peak RSS MiB | samples/s | val AUC (Bayes) |")
    print("|---|---|---:|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['servers']} × {r['workers']} | {r['rows_per_field']:.0e} | {r['bytes_per_step'] / 1024:,.1f} KiB | {r['bytes_ratio']:.3f} "
            f"| {r['server_rows']:,} = {r['unique_ids_touched']:,} | {r['server_allocated_bytes'] / 2**20:.1f} ({r['dense_table_bytes'] / 2**20:,.0f}) "
            f"| {r['server_peak_rss_bytes'] / 2**20:,.0f} | {r['samples_per_s']:,.0f} | {r['val_auc']:.4f} ({r['bayes_auc']:.4f}) |"
        )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
