"""How much parallelkit's ``strategy=ddp`` costs over a hand-written DDP loop, per step and per process.

Three contenders train the same GPT on the same data, with the same seed, optimizer, schedule and number
of steps, on 2 gloo ranks; each is one job launched as a subprocess, so its whole-process wall time
includes start-up (imports, launching the other rank, rendezvous, model build) and teardown:

- ``parallelkit``: ``python train.py strategy=ddp trainer.devices=2 ... trainer.limit_val_batches=0``, the
  default config otherwise (Rich progress bar, model summary, CSV logger, RunSummary, end-of-run
  checkpoint), plus ``--pk-args``; validation is off because the other two do not validate;
- ``ddp_loop``: ``bench/ddp_loop.py``, plain ``DistributedDataParallel`` written by hand (the reference);
- ``lightning``: ``bench/lightning_stock.py``, Lightning's stock ``Trainer(strategy="ddp")``.

The jobs are interleaved — every round runs all three, in an order rotated each round — so machine noise
hits them alike. Each job reports the median wall time between consecutive optimizer steps on rank 0;
the table shows, over rounds, the median of those medians, of the whole-process wall times, of the time
outside the steps (whole process − steps × median step: start-up, first-step warm-up, teardown) and of
the CPU seconds of all ranks together, and the ratios to the hand-written loop (the median of the
per-round ratios, with their range). It also checks that parallelkit's and the hand-written loop's
per-step losses agree, which shows that the comparison is like for like.

    python bench/overhead.py                 # default: 6 rounds × 150 steps, about 5 minutes on 2 quiet cores
    python bench/overhead.py --quick         # 2 rounds × 30 steps, a smoke run
    python bench/overhead.py --tty           # contenders write to a pseudo-terminal (live progress bars)
    git worktree add /tmp/before HEAD~1 && python bench/overhead.py --before /tmp/before
                                             # + that checkout's train.py as a fourth contender, side by side

Writes ``bench/results/overhead.json`` and prints the Markdown table of docs/benchmarks.md (``--table``: of the saved
results; ``python bench/docs_tables.py`` writes it into the page).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONTENDERS = ("parallelkit", "ddp_loop", "lightning")
REFERENCE = "ddp_loop"
LABELS = {
    "parallelkit": "parallelkit `strategy=ddp`",
    "ddp_loop": "hand-written DDP loop",
    "lightning": "Lightning stock `strategy=\"ddp\"`",
    "before": "parallelkit `strategy=ddp`, another checkout (`--before`)",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6, help="interleaved rounds (each runs all three contenders)")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per run")
    p.add_argument("--quick", action="store_true", help="2 rounds × 30 steps (overrides --rounds and --steps)")
    p.add_argument("--devices", type=int, default=2, help="ranks per job")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--pk-args", default="", help="extra overrides for train.py, e.g. 'trainer.enable_progress_bar=false'")
    p.add_argument("--only", default=",".join(CONTENDERS), help=f"comma-separated subset of {','.join(CONTENDERS)}")
    p.add_argument("--tty", action="store_true", help="give each job a pseudo-terminal instead of a log file")
    p.add_argument("--loss-tol", type=float, default=1e-5, help="max |Δ loss| per step between parallelkit and the loop")
    p.add_argument("--timeout", type=float, default=600, help="seconds before a job is killed")
    p.add_argument("--out", default=None, help="default: bench/results/overhead.json (overhead_quick.json with --quick)")
    p.add_argument("--keep", action="store_true", help="keep the run directories (printed at the end)")
    p.add_argument("--before", default=None, metavar="CHECKOUT",
                   help="another checkout (a git worktree of the commit before): its train.py, with its own src/, runs "
                        "as the contender 'before' in every round")
    p.add_argument("--table", action="store_true", help="print the table(s) of the saved results and exit (runs nothing)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 2, 30
    if args.out is None:  # a smoke run must not overwrite the measurement docs/benchmarks.md quotes
        args.out = str(ROOT / "bench" / "results" / ("overhead_quick.json" if args.quick else "overhead.json"))
    args.only = [c.strip() for c in args.only.split(",") if c.strip()]
    if args.before is not None:
        args.before = str(Path(args.before).resolve())
        if not (Path(args.before) / "train.py").is_file() or not (Path(args.before) / "src" / "parallelkit").is_dir():
            p.error(f"--before {args.before}: not a parallelkit checkout (no train.py and src/parallelkit there)")
        args.only.append("before")
    unknown = set(args.only) - set(CONTENDERS) - ({"before"} if args.before else set())  # "before" only from --before
    if unknown or REFERENCE not in args.only:
        p.error(f"--only takes names from {CONTENDERS} and must include {REFERENCE}; got {args.only}")
    if args.rounds < 1 or args.steps < 3:
        p.error("--rounds must be ≥ 1 and --steps ≥ 3")
    return args


def commands(args: argparse.Namespace, run_dir: Path) -> dict[str, list[str]]:
    py = sys.executable
    common = [
        f"--steps={args.steps}", f"--seed={args.seed}", f"--n-layer={args.n_layer}", f"--n-head={args.n_head}",
        f"--n-embd={args.n_embd}", f"--seq-len={args.seq_len}", f"--global-batch-size={args.global_batch_size}",
    ]
    def parallelkit(name: str) -> list[str]:
        return [
            py, "train.py", "strategy=ddp", f"trainer.devices={args.devices}", f"hydra.run.dir={run_dir / name}",
            f"seed={args.seed}", f"model.n_layer={args.n_layer}", f"model.n_head={args.n_head}", f"model.n_embd={args.n_embd}",
            f"data.seq_len={args.seq_len}", f"data.global_batch_size={args.global_batch_size}", f"trainer.max_steps={args.steps}",
            "trainer.limit_val_batches=0",  # no validation every 100 steps: the other two do not validate
            *args.pk_args.split(),
        ]

    return {
        "parallelkit": parallelkit("parallelkit"),
        "before": parallelkit("before"),
        "ddp_loop": [py, "bench/ddp_loop.py", f"--out={run_dir / 'ddp_loop'}", f"--world-size={args.devices}", *common],
        "lightning": [py, "bench/lightning_stock.py", f"--out={run_dir / 'lightning'}", f"--devices={args.devices}", *common],
    }


# ------------------------------------------------------------------------------------------- running jobs
def _drain(fd: int, sink) -> None:
    while True:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the last holder of the terminal's other end has gone
            break
        if not data:
            break
        sink.write(data)
    os.close(fd)


def run_job(cmd: list[str], log_path: Path, tty: bool, timeout: float, checkout: Path = ROOT) -> tuple[float, int, float]:
    """Run one job in its own session; return (wall seconds from launch to the launcher's exit, exit code,
    the launch as ``time.time()``).

    After the launching process exits, wait (untimed) until every process of the job has gone, so that a
    straggling rank never overlaps the next job.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="1")
    env.pop("OMP_NUM_THREADS", None)  # every contender picks its threads itself (Lightning's rule)
    if checkout != ROOT:  # that checkout's own code before the installed (editable) one
        env["PYTHONPATH"] = os.pathsep.join([str(checkout / "src"), *filter(None, [env.get("PYTHONPATH")])])
    with open(log_path, "wb") as log:
        if tty:
            import fcntl
            import pty
            import struct
            import termios

            master, slave = pty.openpty()
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 140, 0, 0))
            env.setdefault("TERM", "xterm-256color")
            launched, start = time.time(), time.perf_counter()
            proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, start_new_session=True)
            os.close(slave)
            reader = threading.Thread(target=_drain, args=(master, log), daemon=True)
            reader.start()
        else:
            launched, start = time.time(), time.perf_counter()
            proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = -signal.SIGKILL
        wall = time.perf_counter() - start
        _reap_group(proc.pid)
        if tty:
            reader.join(timeout=10)
    return wall, code, launched


def become_subreaper() -> bool:
    """Adopt orphaned grandchildren (Linux), so that every rank of a job is reaped here and its CPU time counted."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _reap_group(pgid: int, grace: float = 30.0) -> None:
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:  # orphaned ranks, adopted by this (subreaper) process
                pass
        except ChildProcessError:
            pass
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def write_results(result: dict, out: Path, run_root: Path, keep: bool) -> None:
    """Write the benchmark's JSON and remove its scratch run directories (unless ``--keep``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    if keep:
        print(f"run directories kept in {run_root}")
    else:
        shutil.rmtree(run_root, ignore_errors=True)


def run_contender(name: str, cmd: list[str], run_dir: Path, args: argparse.Namespace) -> dict:
    out = run_dir / name
    # Every round starts in an empty directory (this benchmark's own scratch): parallelkit keeps a finished run's
    # directory as it is and would not train there again (parallelkit.run_dir).
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    summary_path = out / "summary.json"
    cpu_before = children_cpu_s()
    checkout = Path(args.before) if name == "before" else ROOT
    wall, code, launched = run_job(cmd, out / "job.log", args.tty, args.timeout, checkout)
    record = {"contender": name, "wall_s": wall, "exit_code": code, "launched": launched}
    # CPU seconds of all ranks together: less sensitive to other load on the machine than wall time.
    record["cpu_s"] = children_cpu_s() - cpu_before
    if not summary_path.exists():
        tail = (out / "job.log").read_bytes()[-3000:].decode(errors="replace")
        raise SystemExit(f"{name} wrote no summary.json (exit code {code}). Command:\n  {' '.join(cmd)}\nLog tail:\n{tail}")
    summary = json.loads(summary_path.read_text())
    record["step_time_s_median"] = summary["step_time_s_median"]
    record["train_loss"] = summary["train_loss"]
    record["steps"] = len(summary["train_loss"])
    # Time outside the training steps: start-up + teardown (+ the first step's warm-up beyond a median step).
    record["outside_steps_s"] = wall - record["steps"] * summary["step_time_s_median"]
    return record


# ------------------------------------------------------------------------------------------- reporting
def loss_check(rounds: list[dict], name: str) -> dict:
    """Largest per-step |loss difference| between ``name`` and the hand-written loop, over all rounds."""
    worst, steps = 0.0, None
    for r in rounds:
        a, b = r[name]["train_loss"], r[REFERENCE]["train_loss"]
        if len(a) != len(b):
            return {"max_abs_diff": float("inf"), "steps": (len(a), len(b))}
        steps = len(a)
        worst = max(worst, max(abs(x - y) for x, y in zip(a, b)))
    return {"max_abs_diff": worst, "steps": steps}


def aggregate(rounds: list[dict], names: list[str]) -> dict:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    agg = {}
    for name in names:
        step = [r[name]["step_time_s_median"] for r in rounds]
        wall = [r[name]["wall_s"] for r in rounds]
        outside = [r[name]["outside_steps_s"] for r in rounds]
        cpu = [r[name]["cpu_s"] for r in rounds]
        cpu_ratio = [r[name]["cpu_s"] / r[REFERENCE]["cpu_s"] for r in rounds]
        step_ratio = [r[name]["step_time_s_median"] / r[REFERENCE]["step_time_s_median"] for r in rounds]
        wall_ratio = [r[name]["wall_s"] / r[REFERENCE]["wall_s"] for r in rounds]
        agg[name] = {
            "step_time_s_median": med(step),
            "wall_s_median": med(wall),
            "outside_steps_s_median": med(outside),
            "step_ratio_median": med(step_ratio),
            "step_ratio_range": [min(step_ratio), max(step_ratio)],
            "wall_ratio_median": med(wall_ratio),
            "wall_ratio_range": [min(wall_ratio), max(wall_ratio)],
            "cpu_s_median": med(cpu),
            "cpu_ratio_median": med(cpu_ratio),
            "cpu_ratio_range": [min(cpu_ratio), max(cpu_ratio)],
            "extra_outside_steps_s_median": med([r[name]["outside_steps_s"] - r[REFERENCE]["outside_steps_s"] for r in rounds]),
        }
    return agg


def load_results() -> dict:
    return json.loads((ROOT / "bench" / "results" / "overhead.json").read_text())


def tables(results: dict) -> dict[str, str]:
    """The Markdown table of saved results (``--table``; bench/docs_tables.py)."""
    return {"": markdown_table(results["aggregate"], list(results["aggregate"]), results.get("labels"))}


def markdown_table(agg: dict, names: list[str], labels: dict | None = None) -> str:
    labels = {**LABELS, **(labels or {})}
    lines = [
        "| | step time | × loop, per step | whole process | × loop, whole process | outside the steps | CPU, all ranks | × loop, CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        a = agg[name]
        ratio = lambda key: f"**{a[key + '_median']:.3f}** ({a[key + '_range'][0]:.2f}–{a[key + '_range'][1]:.2f})"  # noqa: E731
        lines.append(
            f"| {labels[name]} | {a['step_time_s_median'] * 1e3:.1f} ms | {ratio('step_ratio')} | "
            f"{a['wall_s_median']:.1f} s | {ratio('wall_ratio')} | {a['outside_steps_s_median']:.1f} s | "
            f"{a['cpu_s_median']:.1f} s | {ratio('cpu_ratio')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.table:
        print(tables(json.loads(Path(args.out).read_text()))[""])
        return
    names = [c for c in (*CONTENDERS, "before") if c in args.only]
    if args.before:
        sha = subprocess.run(["git", "-C", args.before, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        LABELS["before"] = f"parallelkit `strategy=ddp` at {sha or args.before} (`--before`)"
    become_subreaper()
    run_root = Path(tempfile.mkdtemp(prefix="pk_overhead_"))
    cmds = commands(args, run_root)
    print(f"overhead: {args.rounds} rounds × {names}, {args.steps} steps, GPT n_layer={args.n_layer} n_embd={args.n_embd} "
          f"seq_len={args.seq_len} global batch {args.global_batch_size}, {args.devices} ranks, "
          f"{'pty' if args.tty else 'log file'} output; runs in {run_root}", flush=True)
    rounds: list[dict] = []
    started = time.perf_counter()
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        result = {}
        for name in order:
            result[name] = rec = run_contender(name, cmds[name], run_root, args)
            print(f"  round {r + 1}/{args.rounds} {name:12s} step {rec['step_time_s_median'] * 1e3:7.1f} ms  "
                  f"process {rec['wall_s']:6.2f} s  outside steps {rec['outside_steps_s']:5.2f} s  "
                  f"CPU {rec['cpu_s']:6.2f} s  exit {rec['exit_code']}", flush=True)
        rounds.append(result)

    agg = aggregate(rounds, names)
    checks = {name: loss_check(rounds, name) for name in names if name != REFERENCE}
    table = markdown_table(agg, names)
    print()
    print(table)
    print()
    ok = True
    for name, check in checks.items():
        passed = check["max_abs_diff"] <= args.loss_tol
        ok &= passed or name not in ("parallelkit", "before")
        print(f"loss check {name} vs {REFERENCE}: max |Δ loss| over {check['steps']} steps × {args.rounds} rounds = "
              f"{check['max_abs_diff']:.2e} ({'OK' if passed else 'MISMATCH'}, tolerance {args.loss_tol:g})")
    bad_exits = [(r_i, n, rec["exit_code"]) for r_i, rr in enumerate(rounds) for n, rec in rr.items() if rec["exit_code"] != 0]
    if bad_exits:
        print(f"non-zero exit codes (round, contender, code): {bad_exits}")
    print(f"total {time.perf_counter() - started:.0f} s")

    result = {
        "config": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "commands": {k: " ".join(v[1:]) for k, v in cmds.items() if k in names},
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": len(os.sched_getaffinity(0))},
        "labels": {n: LABELS[n] for n in names},
        "aggregate": agg,
        "loss_check": checks,
        "rounds": [{n: {k: v for k, v in rec.items() if k != "train_loss"} for n, rec in rr.items()} for rr in rounds],
        "markdown": table,
    }
    write_results(result, Path(args.out), run_root, args.keep)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
