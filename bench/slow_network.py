"""Time to a target loss on a slow link: dense DDP against the communication-efficient callbacks, 2 gloo ranks.

Each link speed gets a private network namespace (``unshare -n``) whose loopback is set to MTU 1500 and
throttled by a ``tbf`` qdisc (10 Gb/s, 1 Gb/s, 100 Mb/s); both ranks run inside it, so every byte gloo sends
crosses the throttle. Loopback egress is the only queue: the two ranks' directions *share* the rate (a
half-duplex link of that speed), as two machines behind one slow uplink would. The qdisc's own counter is
read before and after each run and must have carried at least the bytes parallelkit counted (both ranks),
or the run is reported as not throttled.

Every method is ``python train.py model=gpt data=chars trainer.devices=2 ...`` with the same seed, model,
data, global batch, optimizer schedule and number of steps; validation (the same batches for all) every
``--steps / 10`` steps. Reported per method and link: wall time of the whole job, training time (wall clock
of rank 0 from the first step, validation excluded) until the validation loss first reached dense DDP's final
validation loss on the same link (or "not reached" with the best loss), final validation loss, bytes per step
(counted by parallelkit, per rank). ``bench/results/slow_network.png``: validation loss against training time,
one panel per link.

    python bench/slow_network.py                       # all methods, 3 links, 150 steps (as root)
    python bench/slow_network.py --steps 120 --links 100mbit,1gbit --only dense,diloco_h8,local_adaptive

Where namespaces are not allowed (not root, no ``unshare``/``tc``, a container without CAP_SYS_ADMIN) it says
why and exits 0 without numbers. This script throttles one link that all ranks share; hierarchical all-reduce
across a throttled "node" boundary (two namespaces joined by a veth pair) is ``bench/node_link.py``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
LINKS = {"10gbit": 10e9, "1gbit": 1e9, "100mbit": 100e6}


def methods(steps: int) -> dict[str, list[str]]:
    h = 8 if steps < 400 else 16  # a few dozen outer steps at this budget
    return {
        "dense": [],
        "fp16_hook": ["callbacks=[grad_compression]", "callbacks.grad_compression.method=fp16"],
        "powersgd_r1": ["callbacks=[grad_compression]", "callbacks.grad_compression.method=powersgd", "callbacks.grad_compression.powersgd_rank=1"],
        "powersgd_r4": ["callbacks=[grad_compression]", "callbacks.grad_compression.method=powersgd", "callbacks.grad_compression.powersgd_rank=4"],
        "dgc_adamw": ["callbacks=[dgc]", f"callbacks.dgc.rampup_steps={max(steps // 5, 5)}"],
        "dgc_sgd": ["optim=sgd", "callbacks=[dgc]", f"callbacks.dgc.rampup_steps={max(steps // 5, 5)}"],
        # What DGC and PowerSGD need at this step budget (docs/communication.md): the paper's local gradient clipping
        # and a final sparsity whose period 1/(1 - s) is short beside the run; PowerSGD dense for the first fifth.
        # dense_sgd is the reference of the optim=sgd rows.
        "dense_sgd": ["optim=sgd"],
        "dgc_sgd_clip_s90": ["optim=sgd", "callbacks=[dgc]", f"callbacks.dgc.rampup_steps={max(steps // 5, 5)}",
                             "callbacks.dgc.local_clip_norm=1.0", "callbacks.dgc.sparsity=[0.75,0.9]"],
        "powersgd_r4_start": ["callbacks=[grad_compression]", "callbacks.grad_compression.method=powersgd",
                              "callbacks.grad_compression.powersgd_rank=4", f"callbacks.grad_compression.start_iter={max(steps // 5, 2)}"],
        "local_k4": ["callbacks=[local_sgd]", "callbacks.local_sgd.k_steps=4"],
        "post_local_k4": ["callbacks=[local_sgd]", "callbacks.local_sgd.k_steps=4", f"callbacks.local_sgd.begin_step={steps // 10}"],
        "local_adaptive": ["callbacks=[local_sgd]", "callbacks.local_sgd.k_steps=4", "callbacks.local_sgd.adaptive=true"],
        f"diloco_h{h}": ["callbacks=[diloco]", f"callbacks.diloco.inner_steps={h}"],
        f"streaming_diloco_h{h}": ["callbacks=[diloco]", f"callbacks.diloco.inner_steps={h}", "callbacks.diloco.fragments=4",
                                   "callbacks.diloco.overlap_steps=1", "callbacks.diloco.outer_dtype=bf16"],
        f"streaming_diloco_h{h}_int8": ["callbacks=[diloco]", f"callbacks.diloco.inner_steps={h}", "callbacks.diloco.fragments=4",
                                        "callbacks.diloco.overlap_steps=1", "callbacks.diloco.outer_dtype=int8"],
    }


# ------------------------------------------------------------------------------------------- the link
def namespaces_refused() -> str | None:
    """Why a throttled private link cannot be built here (``None``: it can)."""
    if sys.platform != "linux":
        return f"network namespaces are Linux-only (this is {sys.platform})"
    missing = [tool for tool in ("unshare", "tc", "ip") if shutil.which(tool) is None]
    if missing:
        return f"missing tools: {', '.join(missing)} (util-linux, iproute2)"
    proc = subprocess.run(["unshare", "-n", "tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"'unshare -n' is not permitted here (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}"
    return None


def _in(netns: str | None) -> list[str]:
    """``ip``/``tc`` options that act in network namespace ``netns`` (``None``: this process's own)."""
    return ["-n", netns] if netns else []


def setup_link(rate_bits: float, dev: str = "lo", netns: str | None = None) -> None:
    """Inside a fresh namespace: loopback (or ``dev``, in ``netns``) up at MTU 1500, its egress limited to
    ``rate_bits`` per second."""
    rate_bytes = rate_bits / 8
    # tbf needs a bucket of at least one packet and of what a kernel tick lets through; 4 ms of bytes covers both
    burst = max(16 * 1024, int(rate_bytes * 0.004))
    subprocess.run(["ip", *_in(netns), "link", "set", dev, "mtu", "1500", "up"], check=True)
    subprocess.run(["tc", *_in(netns), "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(rate_bits)}bit",
                    "burst", str(burst), "latency", "200ms"], check=True)


def qdisc_sent_bytes(dev: str = "lo", netns: str | None = None) -> int:
    """Bytes the loopback's (or ``dev``'s, in ``netns``) root qdisc has sent (``tc -s``): what really crossed the throttle."""
    out = subprocess.run(["tc", *_in(netns), "-s", "qdisc", "show", "dev", dev], capture_output=True, text=True, check=True).stdout
    match = re.search(r"Sent (\d+) bytes", out)
    return int(match.group(1)) if match else 0


def timed_transfer(nbytes: int) -> tuple[float, int]:
    """Send ``nbytes`` over TCP on 127.0.0.1 (the throttled loopback); returns (seconds, bytes the qdisc carried).

    The clock runs from the first byte sent until the receiver has read the last one and said so.
    """
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    got = threading.Event()

    def receive() -> None:
        conn, _ = server.accept()
        left = nbytes
        while left > 0:
            left -= len(conn.recv(min(left, 1 << 20)))
        conn.sendall(b"k")
        conn.close()
        got.set()

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    client = socket.create_connection(("127.0.0.1", port))
    payload = b"\0" * (1 << 20)
    before = qdisc_sent_bytes()
    start = time.perf_counter()
    left = nbytes
    while left > 0:
        left -= client.send(payload[: min(left, len(payload))])
    client.recv(1)
    seconds = time.perf_counter() - start
    thread.join()
    client.close()
    server.close()
    return seconds, qdisc_sent_bytes() - before


# ------------------------------------------------------------------------------------------- one run
class WallClock:
    """A Lightning callback (``+callbacks.clock._target_=slow_network.WallClock``): rank 0's training time at each
    validation, validation excluded, appended to ``path`` as ``step seconds`` lines."""

    def __new__(cls, *args, **kwargs):  # a Callback subclass built lazily: the bench itself does not import Lightning
        from lightning.pytorch.callbacks import Callback

        class _WallClock(Callback):
            def __init__(self, path: str) -> None:
                self.path, self.start, self.in_validation, self.val_time, self.val_start = path, None, False, 0.0, 0.0

            def on_train_start(self, trainer, pl_module) -> None:
                self.start = time.perf_counter()

            def on_validation_start(self, trainer, pl_module) -> None:
                if self.start is not None and not trainer.sanity_checking:
                    self.val_start = time.perf_counter()
                    if trainer.global_rank == 0:
                        with open(self.path, "a") as f:
                            f.write(f"{trainer.global_step} {self.val_start - self.start - self.val_time:.4f}\n")

            def on_validation_end(self, trainer, pl_module) -> None:
                if self.start is not None and not trainer.sanity_checking:
                    self.val_time += time.perf_counter() - self.val_start

        return _WallClock(*args, **kwargs)


def job_command(name: str, extra: list[str], args: argparse.Namespace, workdir: Path, devices: int = 2) -> tuple[list[str], Path, Path]:
    """The ``train.py`` command of one method (model, data, seed, schedule, validation and the clock from ``args``),
    its run directory and its clock file."""
    run_dir, clock = workdir / name, workdir / f"{name}.clock"
    command = [
        sys.executable, str(ROOT / "train.py"), "model=gpt", "data=chars", f"trainer.devices={devices}",
        f"model.n_layer={args.n_layer}", f"model.n_head={args.n_head}", f"model.n_embd={args.n_embd}",
        f"data.seq_len={args.seq_len}", f"data.global_batch_size={args.global_batch_size}", f"seed={args.seed}",
        f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={max(args.steps // 10, 1)}", "trainer.limit_val_batches=8",
        "trainer.log_every_n_steps=10", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
        "checkpoint.every_n_steps=0", "+callbacks.clock._target_=slow_network.WallClock", f"+callbacks.clock.path={clock}",
        *extra, f"hydra.run.dir={run_dir}",
    ]
    return command, run_dir, clock


def bench_pythonpath() -> str:
    """``PYTHONPATH`` that lets the ranks import this script's callbacks (``slow_network.WallClock``)."""
    return f"{ROOT / 'bench'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"


def read_run(run_dir: Path, clock: Path) -> tuple[dict, list]:
    """A finished run's ``summary.json`` and its validation curve: (training seconds, validation loss) pairs."""
    summary = json.loads((run_dir / "summary.json").read_text())
    with open(run_dir / "metrics.csv") as f:
        val = {int(r["step"]) + 1: float(r["val_loss"]) for r in csv.DictReader(f) if r.get("val_loss")}
    times = dict(map(float, line.split()) for line in clock.read_text().split("\n") if line.strip())
    curve = [(times[s], v) for s, v in sorted(val.items()) if s in times]  # (training seconds, val loss)
    return summary, curve


def run_one(name: str, extra: list[str], args: argparse.Namespace, workdir: Path) -> dict:
    command, run_dir, clock = job_command(name, extra, args, workdir)
    env = {**os.environ, "PYTHONPATH": bench_pythonpath(), "GLOO_SOCKET_IFNAME": "lo"}
    sent_before = qdisc_sent_bytes()
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=args.timeout, env=env)
    wall = time.perf_counter() - start
    qdisc = qdisc_sent_bytes() - sent_before
    if proc.returncode != 0:
        return {"name": name, "error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
    summary, curve = read_run(run_dir, clock)
    counted = summary["comm"]["bytes_sent_per_step"]
    return {"name": name, "overrides": extra, "wall_s": wall, "train_s": curve[-1][0] if curve else None,
            "bytes_per_step": counted, "qdisc_bytes": qdisc, "throttled": qdisc >= 2 * counted * args.steps,
            "val_curve": curve, "final_val_loss": summary["val_loss"], "final_train_loss": summary["final_loss"]}


def inside(args: argparse.Namespace) -> None:
    """Runs in the namespace: builds the link, runs the methods, writes the link's results."""
    setup_link(LINKS[args.link])
    # the link itself first: a known payload must take payload / rate (TCP/IP headers: ~3 % at MTU 1500)
    probe = int(LINKS[args.link] / 8 * 0.5)  # half a second's worth
    seconds, carried = timed_transfer(probe)
    print(f"[{args.link}] link check: {probe / 2**20:.1f} MiB in {seconds:.3f} s = {probe * 8 / seconds / 1e6:,.0f} Mbit/s "
          f"(set {LINKS[args.link] / 1e6:,.0f}); qdisc carried {carried / 2**20:.1f} MiB", flush=True)
    runs = methods(args.steps)
    if args.only:
        runs = {k: v for k, v in runs.items() if k == "dense" or k in args.only.split(",")}
    results = {}
    with tempfile.TemporaryDirectory(prefix=f"slow_{args.link}_") as tmp:
        for name, extra in runs.items():
            r = run_one(name, extra, args, Path(tmp))
            if "error" in r:  # on a shared machine a run can die of its neighbours (a tree edited under it): once more
                print(f"[{args.link}] {name} failed, retrying once: {r['error'][-300:]}", flush=True)
                shutil.rmtree(Path(tmp) / name, ignore_errors=True)
                (Path(tmp) / f"{name}.clock").unlink(missing_ok=True)
                r = run_one(name, extra, args, Path(tmp))
            results[name] = r
            print(f"[{args.link}] {name}: " + (r["error"][:300] if "error" in r else
                  f"{r['wall_s']:.1f} s, val {r['final_val_loss']:.4f}, {r['bytes_per_step'] / 1024:.1f} KiB/step, "
                  f"qdisc {r['qdisc_bytes'] / 2**20:.1f} MiB"), flush=True)
    check = {"bytes": probe, "seconds": seconds, "qdisc_bytes": carried, "measured_bit_s": probe * 8 / seconds}
    Path(args.out).write_text(json.dumps({"link_check": check, "methods": results}))


# ------------------------------------------------------------------------------------------- report
def time_to(curve: list, target: float) -> float | None:
    return next((t for t, v in curve if v <= target), None)


def report(all_results: dict) -> list[str]:
    lines = ["| link | method | job wall time | training time | time to dense's final val loss (÷ dense) | to within 1 % of it "
             "| final val loss | bytes / step / rank |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for link, results in all_results.items():
        dense = results.get("dense", {})
        target = dense.get("final_val_loss")
        dense_t = time_to(dense.get("val_curve", []), target) if target else None
        for name, r in results.items():
            if "error" in r:
                lines.append(f"| {link} | {name} | failed | | | | | |")
                continue
            t = time_to(r["val_curve"], target) if target else None
            best = min(v for _, v in r["val_curve"]) if r["val_curve"] else float("nan")
            reach = (f"{t:.1f} s ({t / dense_t:.2f}×)" if t is not None and dense_t else f"not reached (best {best:.3f})")
            near = time_to(r["val_curve"], target * 1.01) if target else None
            near = f"{near:.1f} s ({near / dense_t:.2f}×)" if near is not None and dense_t else "not reached"
            flag = "" if r["throttled"] else " (qdisc counted less than sent!)"
            lines.append(f"| {link} | {name} | {r['wall_s']:.1f} s | {r['train_s']:.1f} s | {reach} | {near} | {r['final_val_loss']:.3f} | "
                         f"{r['bytes_per_step'] / 1024:,.1f} KiB{flag} |")
    return lines


def load_results() -> dict:
    results = json.loads((RESULTS / "slow_network.json").read_text())
    tuned = RESULTS / "slow_network_tuned.json"  # --tag _tuned: the settings DGC and PowerSGD need (docs/communication.md)
    if tuned.exists():
        results["tuned"] = json.loads(tuned.read_text())["results"]
    return results


def tables(results: dict) -> dict[str, str]:
    """The Markdown tables of saved results (``--table``; bench/docs_tables.py): all methods, and ``tuned``."""
    out = {"all": "\n".join(report(results["results"]))}
    if "tuned" in results:
        out["tuned"] = "\n".join(report(results["tuned"]))
    return out


def plot(all_results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(all_results), figsize=(6 * len(all_results), 5), squeeze=False)
    names = list(dict.fromkeys(n for results in all_results.values() for n in results))
    colors = {n: plt.cm.tab20(i % 20) for i, n in enumerate(names)}  # one colour per method in every panel
    for ax, (link, results) in zip(axes[0], all_results.items()):
        for name, r in results.items():
            if r.get("val_curve"):
                ax.plot([t for t, _ in r["val_curve"]], [v for _, v in r["val_curve"]], marker=".", label=name,
                        linewidth=1.1, color=colors[name])
        if "final_val_loss" in results.get("dense", {}):
            ax.axhline(results["dense"]["final_val_loss"], color="black", linewidth=0.8, linestyle="--")
        ax.set_title(f"{link} (tbf on loopback, MTU 1500)")
        ax.set_xlabel("training time, rank 0 (s)")
        ax.set_ylabel("validation loss")
        dense_curve = results.get("dense", {}).get("val_curve")
        if dense_curve:  # a diverging method must not flatten the others
            ax.set_ylim(top=min(ax.get_ylim()[1], max(v for _, v in dense_curve) + 0.3))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The defaults are the run docs/benchmarks.md's tables come from (GPT 2 x 128, 434 K parameters, 150 steps):
    # long enough for every method to pass its warm-up and for DGC's stall to show, ~20-30 min for all 3 links.
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--links", default=",".join(LINKS), help=f"comma-separated, of {list(LINKS)}")
    p.add_argument("--only", default=None, help="comma-separated methods (default: all); dense is always run")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--tag", default="", help="suffix of the results files")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--link", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--table", action="store_true", help="print the table(s) of the saved results and exit (runs nothing)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.inside:
        return inside(args)
    if args.table:
        print("\n\n".join(tables(json.loads((RESULTS / f"slow_network{args.tag}.json").read_text())).values()))
        return
    reason = namespaces_refused()
    if reason:
        print(f"slow_network: no throttled link can be built here, so no numbers: {reason}")
        return
    all_results, checks = {}, {}
    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k not in ("links", "inside", "link", "out", "table") and v is not None]
    with tempfile.TemporaryDirectory(prefix="slow_network_") as tmp:
        for link in args.links.split(","):
            out = Path(tmp) / f"{link}.json"
            subprocess.run(["unshare", "-n", "--", sys.executable, __file__, *forwarded, "--inside", "--link", link,
                            "--out", str(out)], check=True)
            data = json.loads(out.read_text())
            all_results[link], checks[link] = data["methods"], data["link_check"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"slow_network{args.tag}"
    stem.with_suffix(".json").write_text(json.dumps({"args": vars(args), "link_checks": checks, "results": all_results}, indent=1))
    plot(all_results, stem.with_suffix(".png"))
    print("\n".join(["", *report(all_results), "", f"wrote {stem}.json and .png"]))


if __name__ == "__main__":
    main()
