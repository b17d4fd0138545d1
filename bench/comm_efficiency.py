"""What the communication-efficient callbacks save, and what they cost in loss, on 2 gloo ranks.

Every contender is ``python train.py model=gpt data=chars trainer.devices=2 ...`` with the same seed,
model, data, global batch, optimizer and number of steps; only the callback differs:

- ``dense``: plain DDP (parallelkit's counting all-reduce), the reference;
- ``dgc``: ``callbacks=[dgc]``, warm-up 75 % → … → 99.9 % over the first fifth of the run;
- ``dgc_99``: the same, stopping at 99 %;
- ``local_k4`` / ``local_k16``: ``callbacks=[local_sgd]`` with a fixed period of 4 / 16 steps;
- ``local_adaptive``: ``callbacks=[local_sgd] callbacks.local_sgd.adaptive=true`` (period from 4, growing);
- ``powersgd``: ``callbacks=[grad_compression] callbacks.grad_compression.method=powersgd`` (rank 2);
- ``dgc_adamw`` (full run only): DGC with AdamW instead of momentum SGD (no momentum correction).

The optimizer is momentum SGD (``optim=sgd``, lr 0.05, momentum 0.9), the setting of the DGC paper: with
it DGC's momentum correction applies. Bytes are what parallelkit counted per rank and step (the callback's
own ``summary.json`` entry: gradient/parameter traffic only, without the loss metric's few bytes); the
ratio is dense bytes / sent bytes. The loss is the final validation loss (the same 16 validation batches
for every contender) relative to dense DDP's.

    python bench/comm_efficiency.py            # 300 steps, 8 runs: about 2 minutes on 2 quiet cores
    python bench/comm_efficiency.py --quick    # 40 steps, a smoke run (its own results file)
    python bench/comm_efficiency.py --steps 12500 --val-every 500 --only dgc,dgc_99 --tag _long   # DGC's horizon

DGC at 99.9 % sends each coordinate about once per 1/(1 − 0.999) = 1,000 steps, so its loss is judged on the
long run (10,000 steps at 99.9 %: about ten sends per coordinate; 16 min), not on the 300-step table: see
docs/communication.md.

Writes ``bench/results/comm_efficiency[_quick].json`` and ``.png`` and prints a Markdown table for the README.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def contenders(steps: int, full: bool) -> dict[str, list[str]]:
    rampup = max(steps // 5, 5)
    runs = {
        "dense": [],
        "dgc": ["callbacks=[dgc]", f"callbacks.dgc.rampup_steps={rampup}"],
        "dgc_99": ["callbacks=[dgc]", f"callbacks.dgc.rampup_steps={rampup}", "callbacks.dgc.sparsity=[0.75,0.9375,0.984375,0.99]"],
        "local_k4": ["callbacks=[local_sgd]", "callbacks.local_sgd.k_steps=4"],
        "local_k16": ["callbacks=[local_sgd]", "callbacks.local_sgd.k_steps=16"],
        "local_adaptive": ["callbacks=[local_sgd]", "callbacks.local_sgd.k_steps=4", "callbacks.local_sgd.adaptive=true"],
        "powersgd": ["callbacks=[grad_compression]", "callbacks.grad_compression.method=powersgd",
                     "callbacks.grad_compression.powersgd_rank=2", f"callbacks.grad_compression.start_iter={min(10, steps // 4)}"],
    }
    if full:
        runs["dgc_adamw"] = ["callbacks=[dgc]", f"callbacks.dgc.rampup_steps={rampup}", "optim=adamw"]
    return runs


SECTION = {"dgc": "dgc", "dgc_99": "dgc", "dgc_adamw": "dgc", "local_k4": "local_sgd", "local_k16": "local_sgd",
           "local_adaptive": "local_sgd", "powersgd": "grad_compression"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--quick", action="store_true", help="40 steps, no dgc_adamw; writes comm_efficiency_quick.*")
    p.add_argument("--only", default=None, help="comma-separated contenders (default: all); dense is always run")
    p.add_argument("--tag", default="", help="suffix of the results files, e.g. _long")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--val-every", type=int, default=0,
                   help="also validate every N steps (the same batches; training is unchanged) for a loss-gap curve")
    return p.parse_args(argv)


def run_one(name: str, extra: list[str], args: argparse.Namespace, workdir: Path) -> dict:
    run_dir = workdir / name
    command = [
        sys.executable, str(ROOT / "train.py"), "model=gpt", "data=chars", "optim=sgd", "trainer.devices=2",
        f"model.n_layer={args.n_layer}", f"model.n_head={args.n_head}", f"model.n_embd={args.n_embd}",
        f"data.seq_len={args.seq_len}", f"data.global_batch_size={args.global_batch_size}", f"seed={args.seed}",
        f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.val_every or args.steps}", "trainer.limit_val_batches=16",
        "trainer.log_every_n_steps=10", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
        "checkpoint.every_n_steps=0", *extra, f"hydra.run.dir={run_dir}",
    ]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    section = summary.get(SECTION.get(name, ""), {})
    grad = summary["comm"]["by_kind"].get("grad_allreduce", {}).get("bytes_per_step", 0.0)
    sent = section.get("bytes_sent_per_step", grad) if section else grad
    with open(run_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    loss = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    val_curve = {int(r["step"]) + 1: float(r["val_loss"]) for r in rows if r.get("val_loss")}  # after step+1 updates
    return {
        "name": name, "overrides": extra, "wall_s": wall, "bytes_sent_per_step": sent,
        "val_loss": summary["val_loss"], "val_curve": val_curve, "final_train_loss": summary["final_loss"], "train_loss": loss,
        "step_time_s_median": summary["step_time_s_median"], "callback": section,
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {n: r["val_gap_curve"] for n, r in results.items() if n != "dense" and len(r.get("val_gap_curve", {})) > 1}
    fig, axes = plt.subplots(1, 3 if curves else 2, figsize=(18 if curves else 12, 4.5))
    ax_loss, ax_bytes = axes[0], axes[1]
    for name, r in results.items():
        loss = r["train_loss"]
        window = max(10, len(loss) // 100)
        smooth = [sum(loss[max(0, i - window + 1): i + 1]) / len(loss[max(0, i - window + 1): i + 1]) for i in range(len(loss))]
        ax_loss.plot(range(len(smooth)), smooth, label=f"{name} (val {r['val_loss']:.3f})", linewidth=1.2)
    ax_loss.set_xlabel("optimizer step")
    ax_loss.set_ylabel(f"train loss (mean of last {window} steps)")
    ax_loss.set_title("loss, 2 ranks, GPT on chars")
    ax_loss.legend(fontsize=8)
    names = list(results)
    sent = [results[n]["bytes_sent_per_step"] / 1024 for n in names]
    bars = ax_bytes.bar(names, sent, color="tab:blue")
    ax_bytes.set_yscale("log")
    ax_bytes.set_ylabel("KiB sent per rank per step (log)")
    ax_bytes.set_title("communication")
    for bar, n in zip(bars, names):
        ax_bytes.annotate(f"{results[n]['ratio']:.0f}×" if results[n]["ratio"] >= 10 else f"{results[n]['ratio']:.1f}×",
                          (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax_bytes.tick_params(axis="x", rotation=30)
    if curves:
        ax_gap = axes[2]
        for name, curve in curves.items():
            steps = sorted(curve)
            ax_gap.plot(steps, [100 * curve[s] for s in steps], marker=".", label=name, linewidth=1.2)
        ax_gap.axhspan(-2, 2, color="tab:green", alpha=0.15, label="within 2 %")
        ax_gap.axhline(0, color="black", linewidth=0.8)
        ax_gap.set_xlabel("optimizer step")
        ax_gap.set_ylabel("validation loss vs dense DDP (%)")
        ax_gap.set_title("loss gap over the run")
        ax_gap.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.quick:
        args.steps = 40
    runs = contenders(args.steps, full=not args.quick)
    if args.only:
        keep = {"dense", *args.only.split(",")}
        runs = {k: v for k, v in runs.items() if k in keep}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="comm_eff_") as tmp:
        for name, extra in runs.items():
            results[name] = run_one(name, extra, args, Path(tmp))
            print(f"{name}: {results[name]['bytes_sent_per_step']:.0f} B/step, val {results[name]['val_loss']:.4f}, "
                  f"{results[name]['wall_s']:.0f} s", flush=True)
    dense = results["dense"]
    for r in results.values():
        r["ratio"] = dense["bytes_sent_per_step"] / r["bytes_sent_per_step"] if r["bytes_sent_per_step"] else float("inf")
        r["val_loss_vs_dense"] = r["val_loss"] / dense["val_loss"] - 1
        r["val_gap_curve"] = {s: v / dense["val_curve"][s] - 1 for s, v in r["val_curve"].items() if s in dense["val_curve"]}
    suffix = ("_quick" if args.quick else "") + args.tag
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"args": vars(args), "host": platform.node(), "python": platform.python_version(), "results": results}
    (RESULTS / f"comm_efficiency{suffix}.json").write_text(json.dumps(out, indent=2))
    plot(results, RESULTS / f"comm_efficiency{suffix}.png")
    print()
    print("| run | bytes sent / rank / step | ratio to dense | final val loss | vs dense |")
    print("|---|---:|---:|---:|---:|")
    for name, r in results.items():
        extra = ""
        cb = r["callback"]
        if name.startswith("dgc") and cb.get("compression_ratio_after_warmup"):
            extra = f" (after warm-up {cb['compression_ratio_after_warmup']:.0f}×)"
        if name.startswith("local") and cb:
            extra = f" ({cb['sync_steps']} averagings, final period {cb['final_period']})"
        print(f"| {name} | {r['bytes_sent_per_step'] / 1024:,.1f} KiB | {r['ratio']:.1f}×{extra} | {r['val_loss']:.4f} | "
              f"{100 * r['val_loss_vs_dense']:+.2f} % |")
    for name, r in results.items():
        if name != "dense" and len(r["val_gap_curve"]) > 1:
            print(f"{name} vs dense over the run: " + ", ".join(f"{s}: {100 * g:+.1f} %" for s, g in sorted(r["val_gap_curve"].items())))
    print(f"\nwrote {RESULTS / f'comm_efficiency{suffix}.json'} and .png")


if __name__ == "__main__":
    main()
