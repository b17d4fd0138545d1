"""Rank 0's CPU time per training step, by category, sampled with py-spy: where the per-step overhead goes.

Runs each variant once under ``py-spy record`` (rank 0, the launching process; ``--nonblocking``, so the
sampled process is not paused), keeps the main thread's samples taken inside one training step
(Lightning: below ``_TrainingEpochLoop.advance``; the hand-written loop: the body of its ``for`` loop) and
sorts each sample into a category by the innermost frame it recognises. Output: milliseconds of CPU per
step per category (samples / rate / steps), and the other threads' CPU over the whole run per step.

    pip install py-spy          # or set PY_SPY=/path/to/py-spy
    python bench/profile_steps.py --steps 400       # the overhead bench's GPT and contenders

A diagnostic for the overhead analysis; sampling error is about ±sqrt(samples).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402

# Innermost match wins; order matters only within one frame.
CATEGORIES = [
    ("backward (autograd, DDP reducer, all-reduce)", r"_engine_run_backward|Tensor\.backward"),
    ("forward + loss", r"GPT\.forward|GPT\.loss|Block\.forward|cross_entropy|DistributedDataParallel\.forward"),
    ("AdamW update", r"_single_tensor_adam|_multi_tensor_adam|_fused_adam|^adam |_init_group"),
    ("zero_grad", r"zero_grad"),
    ("data loading", r"dataloader\.py|collate|DataParallelBatchSampler|fetchers\.py"),
    ("Lightning: SIGTERM broadcast", r"_broadcast_sigterm_tensor"),
    ("Lightning: progress bar", r"ProgressBar"),
    ("Lightning: self.log / logger connector", r"_LoggerConnector|_ResultCollection|LightningModule\.log |_ResultMetric"),
    ("parallelkit: RunSummary", r"RunSummary"),
    ("Lightning: ModelCheckpoint", r"ModelCheckpoint"),
    ("LR scheduler", r"update_lr_schedulers|_update_learning_rates"),
    ("parallelkit: per-batch reseed (exact resume)", r"TrainModule\.on_train_batch_start"),
]
OTHER = "Lightning: loop, hooks, closures (rest)"
LIGHTNING_REGION = "_TrainingEpochLoop.advance ("


def loop_body_lines() -> range:
    """Line numbers of the hand-written loop's training ``for`` loop (bench/ddp_loop.py)."""
    lines = (Path(__file__).resolve().parent / "ddp_loop.py").read_text().splitlines()
    start = next(i for i, line in enumerate(lines, 1) if line.strip().startswith("for _ in range(args.steps)"))
    end = next(i for i, line in enumerate(lines, 1) if i > start and line.strip().startswith('marks["last_step_end"]'))
    return range(start, end)


def in_region(frames: list[str], body: range) -> int | None:
    """Index of the frame that marks a training step, or None."""
    for i, frame in enumerate(frames):
        if LIGHTNING_REGION in frame:
            return i
        m = re.match(r"main \(.*ddp_loop\.py:(\d+)\)", frame)
        if m and int(m.group(1)) in body:
            return i
    return None


def categorize(raw: Path, steps: int, rate: float) -> dict:
    body = loop_body_lines()
    per_cat: collections.Counter = collections.Counter()
    rest: collections.Counter = collections.Counter()
    other_threads: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames, n = stack.split(";"), int(count)
        thread = frames[0].split(":")[-1].strip()
        if thread != "MainThread":
            other_threads[thread] += n
            continue
        start = in_region(frames, body)
        if start is None:
            continue
        below = frames[start + 1:]
        found = None
        for frame in reversed(below):
            found = next((name for name, pattern in CATEGORIES if re.search(pattern, frame)), None)
            if found:
                break
        if found is None:
            found = OTHER
            rest[" > ".join(f.split(" (")[0] for f in below[-3:]) or "(loop body)"] += n
        per_cat[found] += n
    ms = lambda n: n / rate / steps * 1e3  # noqa: E731
    return {
        "ms_per_step": {k: ms(v) for k, v in per_cat.most_common()},
        "total_ms_per_step": ms(sum(per_cat.values())),
        "other_threads_ms_per_step": {k: ms(v) for k, v in other_threads.most_common()},
        "rest_top": {k: ms(v) for k, v in rest.most_common(12)},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--rate", type=int, default=250, help="samples per second")
    p.add_argument("--contenders", default="ddp_loop,parallelkit,lightning", help="of bench/overhead.py's")
    p.add_argument("--py-spy", default=os.environ.get("PY_SPY") or shutil.which("py-spy"))
    p.add_argument("--out", default=str(overhead.ROOT / "bench" / "results" / "profile_steps.json"))
    ns = p.parse_args(argv)
    if not ns.py_spy:
        p.error("py-spy not found: pip install py-spy, or pass --py-spy / set PY_SPY")
    args = overhead.parse_args(["--rounds", "1", "--steps", str(ns.steps)])
    run_root = Path(tempfile.mkdtemp(prefix="pk_profile_"))
    commands = overhead.commands(args, run_root)
    results = {}
    for name in [v.strip() for v in ns.contenders.split(",") if v.strip()]:
        raw = run_root / f"{name}.raw"
        # Rank 0 is the launching process in all three (parallelkit's rank 1 is a child py-spy does not follow).
        spy = [ns.py_spy, "record", "-r", str(ns.rate), "--nonblocking", "-t", "-f", "raw", "-o", str(raw), "--"]
        with open(run_root / f"{name}.log", "wb") as log:
            subprocess.run(spy + commands[name], cwd=overhead.ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
        summary = json.loads((run_root / name / "summary.json").read_text())
        results[name] = res = categorize(raw, len(summary["train_loss"]), ns.rate)
        res["step_time_ms_median"] = summary["step_time_s_median"] * 1e3
        print(f"\n== {name}: step {res['step_time_ms_median']:.2f} ms (median wall), rank-0 main thread CPU in steps "
              f"{res['total_ms_per_step']:.2f} ms/step")
        for k, v in res["ms_per_step"].items():
            print(f"  {v:7.3f} ms  {k}")
        print("  other threads (whole run, per step): " + ", ".join(f"{k} {v:.3f} ms" for k, v in res["other_threads_ms_per_step"].items()))
        for k, v in list(res["rest_top"].items())[:6]:
            print(f"      rest: {v:.3f} ms  {k}")
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(ns), "results": results}, indent=1))
    print(f"\nwrote {out}; raw profiles in {run_root}")


if __name__ == "__main__":
    main()
