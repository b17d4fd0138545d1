"""Step time and memory of parallelkit's ZeRO stages 1-3 against DDP, DeepSpeed's defaults and FSDP2's defaults.

Issue 23, item 3. Every contender trains the same GPT on the same data (``data=chars``, ``seq_len=64``, global
batch 32), with the same seed, AdamW and warm-up + cosine schedule, on 2 gloo ranks, as one subprocess job:

- ``ddp``: ``python train.py strategy=ddp`` — the reference;
- ``zero1`` / ``zero2`` / ``zero3``: ``python train.py strategy=zero strategy.stage=K`` with parallelkit's
  defaults (``conf/strategy/zero.yaml``: stage 3 shards each block then the root with FSDP2,
  ``reshard_after_forward: true``, ``prefetch: true`` — the next block gathered while one computes, the
  reduce-scatters overlapped with backward —, parallelkit's counted collectives; stages 1-2 ``bucket_cap_mb: 25``);
  ``zero3np`` is stage 3 with ``strategy.prefetch=false``, what the overlap buys;
- ``ds1`` / ``ds2`` / ``ds3``: ``python train.py strategy=deepspeed strategy.stage=K`` with DeepSpeed's own ZeRO
  defaults, as a user who writes ``{"zero_optimization": {"stage": K}}`` runs it
  (``bench/deepspeed_defaults.py``, whose docstring tabulates the differences). parallelkit's
  ``strategy=deepspeed`` instead sets ``overlap_comm: false``, reduce/all-gather buckets of 1/8 of the model
  (DeepSpeed: 5e8 elements), ``stage3_prefetch_bucket_size: 0`` (DeepSpeed: 5e7),
  ``stage3_param_persistence_threshold: 0`` (DeepSpeed: 1e5 — every tensor of the default GPT stays gathered)
  and ``stage3_max_reuse_distance: 0`` (DeepSpeed: 1e9), and lets Lightning accumulate
  (``managed_gradient_accumulation: false``; DeepSpeed: true, which with stage 3 turns ``overlap_comm`` on).
  That tuned variant runs with ``--only ...,pkds1,pkds2,pkds3``;
- ``fsdp2``: ``bench/fsdp2_loop.py``, a hand-written loop with ``fully_shard`` per block then the root and
  every FSDP2 default (FSDP2's own collectives; no Lightning, so its per-step cost lacks Lightning's ~1-1.5 ms).

Models (``--models``): ``default`` is ``conf/model/gpt.yaml`` (``n_layer=4 n_head=4 n_embd=128``, 0.83 M
parameters); ``10x`` is ``n_layer=12 n_head=4 n_embd=240`` (8.41 M parameters, 10.1× — deeper and wider, so
stage 3 has three times the sharding units and larger collectives).

Every job gets the same intra-op threads per rank, ``OMP_NUM_THREADS`` = cores / ranks (``--threads``), as
parallelkit's ranks and Lightning's launcher set it anyway, so that the hand-written FSDP2 loop gets it too.

The memory cost of prefetching: after the timed rounds, ``zero3`` and ``zero3np`` (those that ``--only`` names) run
once more for 10 steps with ``bench/fsdp_gathered.py``, which measures the peak bytes of full (gathered)
parameters a rank holds; the difference is one block's parameters.

Rounds are interleaved: each round runs every contender once, in an order rotated per round. Per job the
numbers come from its ``summary.json`` (``parallelkit.callbacks.run_summary``, which the loop mirrors):

- step time: ``step_time_s_median``, rank 0's median wall time between consecutive optimizer steps (the first
  interval, which holds the first step's warm-up, is one of ``--steps``, so the median leaves it out);
  the table shows the median over rounds, and × DDP is the median of the per-round ratios (range in brackets);
- model state: ``model_state_bytes`` (params / grads / optimizer state a rank holds, the maximum over ranks —
  for DeepSpeed every buffer its ZeRO optimizer allocated, including its reduce buckets, 2 GB of fp32 at
  5e8 elements, which the kernel backs with pages only where written);
- peak RSS: ``peak_rss_bytes``, the maximum over ranks of the process's peak resident memory;
- loss: the largest per-step |loss − DDP's loss| over rounds (all contenders train the same thing).

    python bench/zero_speed.py                        # 5 rounds × 50 steps, both models (~55 min on 2 cores)
    python bench/zero_speed.py --rounds 3             # the table of docs/benchmarks.md (~35 min)
    python bench/zero_speed.py --models default       # the default GPT only
    python bench/zero_speed.py --quick                # 1 round × 6 steps, a smoke run (writes zero_speed_quick.json)

Writes ``bench/results/zero_speed.json`` and prints a Markdown table per model for docs/benchmarks.md
(``--table``: of the saved results; ``python bench/docs_tables.py`` writes them into the page).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # become_subreaper, children_cpu_s, _reap_group

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = "ddp"
MODELS = {
    "default": {"n_layer": 4, "n_head": 4, "n_embd": 128},  # conf/model/gpt.yaml
    "10x": {"n_layer": 12, "n_head": 4, "n_embd": 240},
}
DS_DEFAULTS = "strategy._target_=bench.deepspeed_defaults.DeepSpeedDefaultsStrategy"
# name → (label, train.py overrides, or None for the FSDP2 loop)
CONTENDERS = {
    "ddp": ("DDP `strategy=ddp`", ["strategy=ddp"]),
    **{f"zero{k}": (f"parallelkit `strategy=zero` stage {k}", ["strategy=zero", f"strategy.stage={k}"]) for k in (1, 2, 3)},
    "zero3np": ("parallelkit stage 3, `strategy.prefetch=false`", ["strategy=zero", "strategy.stage=3", "strategy.prefetch=false"]),
    **{f"ds{k}": (f"DeepSpeed defaults, stage {k}", ["strategy=deepspeed", f"strategy.stage={k}", DS_DEFAULTS]) for k in (1, 2, 3)},
    "fsdp2": ("FSDP2 defaults (hand-written loop)", None),
    **{f"pkds{k}": (f"`strategy=deepspeed` (parallelkit's tuning), stage {k}", ["strategy=deepspeed", f"strategy.stage={k}"]) for k in (1, 2, 3)},
}
DEFAULT_ONLY = ("ddp", "zero1", "zero2", "zero3", "zero3np", "ds1", "ds2", "ds3", "fsdp2")
# Targets (issue 23): ratio to DDP, and which contender parallelkit's stage must beat.
TARGET_RATIO = {"zero1": 1.05, "zero2": 1.05, "zero3": 1.40}  # zero3np: no target (what prefetching buys)
RIVALS = {"zero1": ("ds1",), "zero2": ("ds2",), "zero3": ("ds3", "fsdp2")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (each runs every contender once)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps per job")
    p.add_argument("--quick", action="store_true", help="1 round × 6 steps, a smoke run (overrides --rounds and --steps)")
    p.add_argument("--models", default="default,10x", help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--only", default=",".join(DEFAULT_ONLY), help=f"comma-separated contenders from {','.join(CONTENDERS)}")
    p.add_argument("--devices", type=int, default=2, help="ranks per job")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=None, help="intra-op threads per rank (OMP_NUM_THREADS) for every job; default: cores / ranks")
    p.add_argument("--timeout", type=float, default=900, help="seconds before a job is killed")
    p.add_argument("--out", default=None, help="default: bench/results/zero_speed.json (zero_speed_quick.json with --quick)")
    p.add_argument("--keep", action="store_true", help="keep the run directories (printed at the end)")
    p.add_argument("--gathered-only", action="store_true",
                   help="only measure the stage-3 gathered-parameter peaks again and merge them into --out's results")
    p.add_argument("--table", action="store_true", help="print the table(s) of the saved results and exit (runs nothing)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 1, 6
    if args.out is None:  # a smoke run must not overwrite the measurement docs/benchmarks.md quotes
        args.out = str(ROOT / "bench" / "results" / ("zero_speed_quick.json" if args.quick else "zero_speed.json"))
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.only = [c.strip() for c in args.only.split(",") if c.strip()]
    if set(args.models) - set(MODELS) or not args.models:
        p.error(f"--models takes names from {','.join(MODELS)}; got {args.models}")
    if set(args.only) - set(CONTENDERS) or REFERENCE not in args.only:
        p.error(f"--only takes names from {','.join(CONTENDERS)} and must include {REFERENCE}; got {args.only}")
    if args.threads is None:
        args.threads = max(1, len(os.sched_getaffinity(0)) // args.devices)
    if args.rounds < 1 or args.steps < 3:
        p.error("--rounds must be ≥ 1 and --steps ≥ 3")
    return args


def command(name: str, model: dict, args: argparse.Namespace, out: Path) -> list[str]:
    py = sys.executable
    overrides = CONTENDERS[name][1]
    if overrides is None:
        return [py, "bench/fsdp2_loop.py", f"--out={out}", f"--world-size={args.devices}", f"--steps={args.steps}",
                f"--seed={args.seed}", *(f"--{k.replace('_', '-')}={v}" for k, v in model.items()),
                f"--seq-len={args.seq_len}", f"--global-batch-size={args.global_batch_size}"]
    return [
        py, "train.py", *overrides, f"trainer.devices={args.devices}", f"hydra.run.dir={out}", f"seed={args.seed}",
        *(f"model.{k}={v}" for k, v in model.items()), f"data.seq_len={args.seq_len}",
        f"data.global_batch_size={args.global_batch_size}", f"trainer.max_steps={args.steps}",
        # No validation and no checkpoint between steps (the loop does neither); the end-of-run checkpoint stays.
        "trainer.limit_val_batches=0", "checkpoint.every_n_steps=0", "checkpoint.every_n_minutes=0",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
    ]


def run_job(cmd: list[str], log_path: Path, threads: int, timeout: float) -> tuple[float, int]:
    """Run one job in its own session with ``threads`` intra-op threads per rank; return (wall seconds, exit code)
    once every process of the job has gone (``overhead._reap_group``)."""
    import signal
    import subprocess

    # Every contender gets the same threads: Lightning's launcher sets OMP_NUM_THREADS = cores / ranks for
    # strategy=ddp and strategy=deepspeed, but strategy=zero's ranks start without it and run a thread per core.
    env = dict(os.environ, PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="1", OMP_NUM_THREADS=str(threads))
    with open(log_path, "wb") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = -signal.SIGKILL
        wall = time.perf_counter() - start
        overhead._reap_group(proc.pid)
    return wall, code


def run_contender(cmd: list[str], out: Path, args: argparse.Namespace) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "summary.json"
    summary_path.unlink(missing_ok=True)
    cpu_before = overhead.children_cpu_s()
    wall, code = run_job(cmd, out / "job.log", args.threads, args.timeout)
    if not summary_path.exists():
        tail = (out / "job.log").read_bytes()[-3000:].decode(errors="replace")
        raise SystemExit(f"no summary.json (exit code {code}). Command:\n  {' '.join(cmd)}\nLog tail:\n{tail}")
    s = json.loads(summary_path.read_text())
    return {
        "exit_code": code, "wall_s": wall, "cpu_s": overhead.children_cpu_s() - cpu_before,
        "step_time_s_median": s["step_time_s_median"], "num_params": s["num_params"], "train_loss": s["train_loss"],
        "model_state_bytes": s["model_state_bytes"], "peak_rss_bytes": s["peak_rss_bytes"],
    }


# ------------------------------------------------------------------------------------------- reporting
def aggregate(rounds: list[dict], names: list[str]) -> dict:
    med = statistics.median
    agg = {}
    for name in names:
        ratio = [r[name]["step_time_s_median"] / r[REFERENCE]["step_time_s_median"] for r in rounds]
        loss_diff = max(max((abs(a - b) for a, b in zip(r[name]["train_loss"], r[REFERENCE]["train_loss"])), default=0.0)
                        if len(r[name]["train_loss"]) == len(r[REFERENCE]["train_loss"]) else float("inf") for r in rounds)
        agg[name] = {
            "step_time_s_median": med([r[name]["step_time_s_median"] for r in rounds]),
            "ratio_to_ddp_median": med(ratio),
            "ratio_to_ddp_range": [min(ratio), max(ratio)],
            "model_state_bytes": {k: med([r[name]["model_state_bytes"][k] for r in rounds]) for k in ("params", "grads", "optimizer")},
            "model_state_bytes_total": med([sum(r[name]["model_state_bytes"].values()) for r in rounds]),
            "peak_rss_bytes": med([r[name]["peak_rss_bytes"] for r in rounds]),
            "wall_s_median": med([r[name]["wall_s"] for r in rounds]),
            "cpu_s_median": med([r[name]["cpu_s"] for r in rounds]),
            "max_abs_loss_diff_vs_ddp": loss_diff,
        }
    return agg


def targets(rounds: list[dict], agg: dict, names: list[str]) -> list[dict]:
    """Each issue-23 target that the contenders run can check: ratio to DDP, and faster than each rival
    (the median over rounds of the per-round ratio parallelkit / rival below 1)."""
    out = []
    for name, limit in TARGET_RATIO.items():
        if name not in names:
            continue
        ratio = agg[name]["ratio_to_ddp_median"]
        out.append({"target": f"{name} ≤ {limit:.2f}× DDP", "value": ratio, "met": ratio <= limit})
        for rival in RIVALS[name]:
            if rival in names:
                vs = statistics.median(r[name]["step_time_s_median"] / r[rival]["step_time_s_median"] for r in rounds)
                out.append({"target": f"{name} faster than {rival}", "value": vs, "met": vs < 1.0})
    return out


def gathered_peaks(model: dict, names: list[str], args: argparse.Namespace, root: Path) -> dict:
    """Peak bytes of gathered parameters per rank (rank 0), for the stage-3 contenders run (bench/fsdp_gathered.py)."""
    peaks = {}
    for name in ("zero3", "zero3np"):
        if name not in names:
            continue
        out = root / f"gathered_{name}"
        probe = out / "gathered.json"
        cmd = [a if not a.startswith("trainer.max_steps=") else "trainer.max_steps=10" for a in command(name, model, args, out)]
        cmd.append(f"+callbacks.gathered={{_target_:bench.fsdp_gathered.GatheredPeak,out:{probe}}}")
        out.mkdir(parents=True, exist_ok=True)
        _, code = run_job(cmd, out / "job.log", args.threads, args.timeout)
        if code != 0 or not probe.exists():
            raise SystemExit(f"gathered-parameter probe failed (exit code {code}); log: {out / 'job.log'}")
        peaks[name] = json.loads(probe.read_text())
    return peaks


def gathered_line(peaks: dict) -> str:
    if not peaks:
        return ""

    def mib(n: float) -> str:
        return f"{n / 2**20:.2f} MiB"

    units = next(iter(peaks.values()))["unit_full_bytes"]
    root = next(v for k, v in units.items() if k.endswith("(root)"))
    block = max(v for k, v in units.items() if not k.endswith("(root)"))
    parts = [f"`{name}` {mib(p['peak_gathered_bytes'])}" for name, p in peaks.items()]
    return (f"Full (gathered) parameters held at the peak, rank 0 (bench/fsdp_gathered.py): {', '.join(parts)}; "
            f"one block is {mib(block)}, the root unit {mib(root)}.")


def markdown(model_name: str, model: dict, num_params: int, agg: dict, checks: list[dict], names: list[str], args: argparse.Namespace) -> str:
    def mib(n: float) -> str:
        return f"{n / 2**20:,.2f}"

    shape = " ".join(f"{k}={v}" for k, v in model.items())
    lines = [
        (
            f"**{model_name}** GPT ({shape}, {num_params / 1e6:.2f} M parameters), {args.devices} ranks (gloo), "
            f"{args.rounds} rounds × {args.steps} steps, {args.threads} thread(s) per rank. Targets: stage 3 ≤ 1.40× DDP, "
            "stages 1–2 ≤ 1.05×, parallelkit faster than DeepSpeed's and FSDP2's defaults at every stage."
        ),
        "",
        "| contender | step time | × DDP (range) | model state MiB: params / grads / optimizer (total), max rank | peak RSS MiB, max rank "
        "| max \\|Δ loss\\| vs DDP |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        a = agg[name]
        s = a["model_state_bytes"]
        lines.append(
            f"| {CONTENDERS[name][0]} | {a['step_time_s_median'] * 1e3:.1f} ms | **{a['ratio_to_ddp_median']:.3f}** "
            f"({a['ratio_to_ddp_range'][0]:.2f}–{a['ratio_to_ddp_range'][1]:.2f}) | {mib(s['params'])} / {mib(s['grads'])} / "
            f"{mib(s['optimizer'])} ({mib(a['model_state_bytes_total'])}) | {mib(a['peak_rss_bytes'])} | {a['max_abs_loss_diff_vs_ddp']:.1e} |"
        )
    if checks:
        lines.append("")
        lines.append("Targets: " + "; ".join(f"{c['target']}: {c['value']:.3f} ({'met' if c['met'] else 'NOT met'})" for c in checks) + ".")
    return "\n".join(lines)


def load_results() -> dict:
    return json.loads((ROOT / "bench" / "results" / "zero_speed.json").read_text())


def tables(results: dict) -> dict[str, str]:
    """Per model, what the run printed, rendered again from the saved aggregates (``--table``; bench/docs_tables.py)."""
    args = argparse.Namespace(**results["config"])
    out = {}
    for model_name, saved in results["models"].items():
        out[model_name] = markdown(model_name, saved["shape"], saved["num_params"], saved["aggregate"], saved["targets"],
                                   list(saved["aggregate"]), args)
        if saved.get("gathered_peaks"):
            out[model_name] += "\n\n" + gathered_line(saved["gathered_peaks"])
    return out


def merge_gathered(args: argparse.Namespace, names: list[str]) -> None:
    """``--gathered-only``: the gathered-parameter probes alone, merged into the saved results of a full run."""
    path = Path(args.out)
    results = json.loads(path.read_text())
    run_root = Path(tempfile.mkdtemp(prefix="pk_zero_gathered_"))
    for model_name in args.models:
        saved = results["models"][model_name]
        peaks = gathered_peaks(MODELS[model_name], names, args, run_root / model_name)
        saved["gathered_peaks"] = peaks
        table = saved["markdown"].split("\n\nFull (gathered)")[0]
        saved["markdown"] = table + ("\n\n" + gathered_line(peaks) if peaks else "")
        print(saved["markdown"] + "\n")
    overhead.write_results(results, path, run_root, args.keep)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.table:
        print("\n\n".join(tables(json.loads(Path(args.out).read_text())).values()))
        return
    names = [c for c in CONTENDERS if c in args.only]
    if args.gathered_only:
        merge_gathered(args, names)
        return
    overhead.become_subreaper()
    run_root = Path(tempfile.mkdtemp(prefix="pk_zero_speed_"))
    print(f"zero_speed: models {args.models}, {args.rounds} rounds × {names}, {args.steps} steps, {args.devices} ranks; "
          f"runs in {run_root}", flush=True)
    started = time.perf_counter()
    results: dict = {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": len(os.sched_getaffinity(0))},
        "models": {},
    }
    printed = []
    for model_name in args.models:
        model = MODELS[model_name]
        rounds: list[dict] = []
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            result = {}
            for name in order:
                out = run_root / model_name / f"r{r}" / name  # fresh: train.py will not start over a finished run
                result[name] = rec = run_contender(command(name, model, args, out), out, args)
                print(f"  {model_name} round {r + 1}/{args.rounds} {name:6s} step {rec['step_time_s_median'] * 1e3:8.1f} ms  "
                      f"state {sum(rec['model_state_bytes'].values()) / 2**20:8.2f} MiB  peak RSS {rec['peak_rss_bytes'] / 2**20:7.1f} MiB  "
                      f"process {rec['wall_s']:6.1f} s  exit {rec['exit_code']}", flush=True)
            rounds.append(result)
        agg = aggregate(rounds, names)
        checks = targets(rounds, agg, names)
        num_params = rounds[0][REFERENCE]["num_params"]
        peaks = gathered_peaks(model, names, args, run_root / model_name)
        table = markdown(model_name, model, num_params, agg, checks, names, args)
        if peaks:
            table += "\n\n" + gathered_line(peaks)
        printed.append(table)
        results["models"][model_name] = {
            "shape": model, "num_params": num_params,
            "commands": {name: " ".join(command(name, model, args, run_root / model_name / "r0" / name)[1:]) for name in names},
            "aggregate": agg, "targets": checks, "gathered_peaks": peaks,
            "rounds": [{n: {k: v for k, v in rec.items() if k != "train_loss"} for n, rec in rr.items()} for rr in rounds],
            "markdown": table,
        }
    print()
    print("\n\n".join(printed))
    bad = [(m, r_i, n, rec["exit_code"]) for m, res in results["models"].items() for r_i, rr in enumerate(res["rounds"])
           for n, rec in rr.items() if rec["exit_code"] != 0]
    if bad:
        print(f"\nnon-zero exit codes (model, round, contender, code): {bad}")
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    overhead.write_results(results, Path(args.out), run_root, args.keep)


if __name__ == "__main__":
    main()
