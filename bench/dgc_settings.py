"""What DGC and PowerSGD need at ``bench/slow_network.py``'s step budget: final validation loss and bytes per setting.

Each setting is ``bench/slow_network.py``'s own ``train.py`` command (2 ranks, the same seed, model, data, schedule
and validation batches), run off the throttle: the final validation loss and the bytes per step do not depend on
the link (the same seed gives the same losses to the last digit), so the settings are found here and only the
promising ones are timed on the throttled link (``slow_network.py --tag _tuned``). Defaults: the reduced run of
docs/benchmarks.md (150 steps, GPT 2 × 128, 4 heads).

    python bench/dgc_settings.py            # ~12 runs, ~6 min on 2 cores
    python bench/dgc_settings.py --table    # the table of bench/results/dgc_settings.json

Writes ``bench/results/dgc_settings.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slow_network import RESULTS, bench_pythonpath, job_command, read_run  # noqa: E402

SGD = ["optim=sgd"]
DGC = ["callbacks=[dgc]"]
PSGD4 = ["callbacks=[grad_compression]", "callbacks.grad_compression.method=powersgd", "callbacks.grad_compression.powersgd_rank=4"]


def settings(steps: int) -> dict[str, tuple[str, list[str]]]:
    """name -> (what it is, overrides). The DGC ramp is a fifth of the run, as in slow_network.py."""
    ramp = f"callbacks.dgc.rampup_steps={max(steps // 5, 5)}"
    clip, small_dense = "callbacks.dgc.local_clip_norm=1.0", "callbacks.dgc.dense_min_numel=16384"
    return {
        "dense": ("dense DDP, AdamW (the default)", []),
        "dense_sgd": ("dense DDP, momentum SGD (`optim=sgd`)", SGD),
        "dgc_adamw": ("DGC, AdamW, defaults (99.9 %)", [*DGC, ramp]),
        "dgc_adamw_s99": ("DGC, AdamW, 99 %", [*DGC, ramp, "callbacks.dgc.sparsity=[0.75,0.9375,0.99]"]),
        "dgc_adamw_s96": ("DGC, AdamW, 96 %", [*DGC, ramp, "callbacks.dgc.sparsity=[0.75,0.9375,0.96]"]),
        "dgc_adamw_s90": ("DGC, AdamW, 90 %", [*DGC, ramp, "callbacks.dgc.sparsity=[0.75,0.9]"]),
        "dgc_adamw_clip": ("DGC, AdamW, 99.9 %, local clipping 1.0", [*DGC, ramp, clip]),
        "dgc_adamw_dense_first": ("DGC, AdamW, 99.9 %, dense for the first fifth, then the ramp",
                                  [*DGC, ramp, f"callbacks.dgc.rampup_begin_step={max(steps // 5, 5)}"]),
        "dgc_sgd": ("DGC, momentum SGD, defaults (99.9 %, momentum correction and masking)", [*SGD, *DGC, ramp]),
        "dgc_sgd_clip": ("DGC, momentum SGD, 99.9 %, local clipping 1.0", [*SGD, *DGC, ramp, clip]),
        "dgc_sgd_clip_small_dense": ("DGC, momentum SGD, 99.9 %, clipping, tensors under 16,384 elements dense (PaddlePaddle's rule)",
                                     [*SGD, *DGC, ramp, clip, small_dense]),
        "dgc_sgd_clip_s90": ("DGC, momentum SGD, 90 %, local clipping 1.0", [*SGD, *DGC, ramp, clip, "callbacks.dgc.sparsity=[0.75,0.9]"]),
        "powersgd_r4": ("PowerSGD rank 4 (dense for 10 steps, the default)", PSGD4),
        "powersgd_r4_start": ("PowerSGD rank 4, dense for the first fifth", [*PSGD4, f"callbacks.grad_compression.start_iter={max(steps // 5, 2)}"]),
    }


def run(name: str, extra: list[str], args: argparse.Namespace, workdir: Path) -> dict:
    command, run_dir, clock = job_command(name, extra, args, workdir)
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=args.timeout,
                          env={**os.environ, "PYTHONPATH": bench_pythonpath()})
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
    summary, curve = read_run(run_dir, clock)
    return {"overrides": extra, "wall_s": time.perf_counter() - start, "final_val_loss": summary["val_loss"],
            "best_val_loss": min(v for _, v in curve), "val_losses": [v for _, v in curve],
            "bytes_per_step": summary["comm"]["bytes_sent_per_step"]}


def load_results() -> dict:
    return json.loads((RESULTS / "dgc_settings.json").read_text())


def tables(results: dict) -> dict[str, str]:
    """The Markdown table of saved results (``--table``; bench/docs_tables.py)."""
    rows = results["results"]
    dense = {"AdamW": rows["dense"]["final_val_loss"], "SGD": rows["dense_sgd"]["final_val_loss"]}
    lines = ["| setting | final val loss | ÷ its optimizer's dense | best val loss | bytes / step / rank |", "|---|---:|---:|---:|---:|"]
    for name, r in rows.items():
        what = results["labels"][name]
        if "error" in r:
            lines.append(f"| {what} | failed | | | |")
            continue
        ref = dense["SGD" if "optim=sgd" in r["overrides"] else "AdamW"]
        lines.append(f"| {what} | {r['final_val_loss']:.3f} | {r['final_val_loss'] / ref:.3f} | {r['best_val_loss']:.3f} | "
                     f"{r['bytes_per_step'] / 1024:,.1f} KiB |")
    return {"": "\n".join(lines)}


def main(argv: list[str] | None = None) -> None:
    from slow_network import parse_args

    args = parse_args(["--steps", "150", "--n-embd", "128", "--n-head", "4", *(argv or [])])
    if args.table:
        print(tables(load_results())[""])
        return
    chosen = settings(args.steps)
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in ("dense", "dense_sgd") or k in args.only.split(",")}
    results = {}
    with tempfile.TemporaryDirectory(prefix="dgc_settings_") as tmp:
        for name, (_, extra) in chosen.items():
            results[name] = run(name, extra, args, Path(tmp))
            r = results[name]
            print(f"{name}: " + (r["error"][:300] if "error" in r else f"val {r['final_val_loss']:.4f}, {r['bytes_per_step'] / 1024:.1f} KiB/step"),
                  flush=True)
    out = {"args": vars(args), "measured": time.strftime("%Y-%m-%d %H:%M"), "labels": {k: v[0] for k, v in chosen.items()}, "results": results}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "dgc_settings.json").write_text(json.dumps(out, indent=1))
    print("\n" + tables(out)[""] + "\n\nwrote bench/results/dgc_settings.json")


if __name__ == "__main__":
    main(sys.argv[1:])
