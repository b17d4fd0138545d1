"""Hierarchical all-reduce across a throttled "node" boundary: 4 gloo ranks as 2 simulated nodes of 2 ranks.

Each node is a network namespace of its own (``ip netns add``); the two are joined by a veth pair (10.77.0.1/24
and 10.77.0.2/24, MTU 1500) with a ``tbf`` qdisc on *both* ends at the link rate (burst and latency as
``bench/slow_network.py``'s ``setup_link``), so each direction of the node boundary has the full rate, as a
full-duplex link between two machines would. Traffic inside a node goes to the node's own address and so stays
on the namespace's loopback, which is up and **not throttled** (the fast NVLink/shared-memory side of a real node).

One parallelkit job spans the two namespaces as README.md's "Several machines" says: the same
``python train.py ... strategy=ddp trainer.devices=2 trainer.num_nodes=2`` in each namespace with ``NODE_RANK``
(0, 1), ``MASTER_ADDR=10.77.0.1`` and ``MASTER_PORT`` set; each node's local rank 0 starts its other rank
(``parallelkit/launch/local_ranks.py``), and ``GLOO_SOCKET_IFNAME`` names the namespace's veth so gloo binds
the veth address. Both nodes use one run directory (a shared file system). Methods, same seed, model, data,
global batch, schedule and steps: ``dense`` (plain DDP: gloo's ring over ranks 0→1→2→3→0 crosses the boundary
on two of its four links, one per direction), ``hierarchical`` (``callbacks=[hierarchical_allreduce]
callbacks.hierarchical_allreduce.local_size=2``: reduce inside each node on its loopback, all-reduce between the
two node leaders across the link, broadcast back) and ``local_k4`` (Local SGD, k = 4: the dense ring every
fourth step only).

Reported per method and link: wall time of the job, training time (rank 0, validation excluded) to dense DDP's
final validation loss on the same link (or "not reached" with the best), final validation loss, bytes per step
parallelkit counted (``summary.json``; intra/inter-node for hierarchical), and the bytes the two veth qdiscs
carried during the run (``tc -s`` before/after, both ends) against the inter-node bytes gloo's algorithms send:
dense, a ring all-reduce of the S gradient bytes over n = 4 ranks, in which every rank sends 2(n−1)/n·S to its
successor, two of those links crossing: 2·2(n−1)/n·S = 3S per step; hierarchical, a ring all-reduce over the
G = 2 leaders, each sending 2(G−1)/G·S across: G·2(G−1)/G·S = 2S per step (S = parameters × 4 bytes; the gloo
headers, the Ethernet/IP/TCP framing, the ACKs, start-up and validation come on top). To separate the per-step
bytes from the job's fixed ones (rendezvous, DDP's first broadcast of the parameters, the end), each method also
runs ``--short-steps`` steps with as many validations, and the difference of the two runs' qdisc bytes over the
difference of their steps is set against the formula too: the framing alone makes it 1514/1448 = 1.046 (a
1448-byte TCP segment at MTU 1500 with timestamps leaves the veth as a 1514-byte frame). A row whose qdiscs
carried less than the inter-node bytes parallelkit counted is "not throttled". Where namespaces are not permitted it
says why and exits 0 without numbers.

    python bench/node_link.py                           # 3 methods × 100 Mb/s and 1 Gb/s, 150 steps, ~10 min (as root)
    python bench/node_link.py --steps 60 --links 100mbit --only hierarchical
    python bench/node_link.py --table                   # the table of bench/results/node_link.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))
import slow_network  # noqa: E402  (the link helpers, the validation clock and time_to)

ROOT = slow_network.ROOT
RESULTS = slow_network.RESULTS
LINKS = {"100mbit": 100e6, "1gbit": 1e9}
ADDRS = ("10.77.0.1", "10.77.0.2")  # node 0 (MASTER_ADDR), node 1
RANKS, LOCAL = 4, 2  # 2 nodes × 2 ranks
CROSSINGS = 2  # links of the ring 0→1→2→3→0 that cross the node boundary (1→2 and 3→0)
_EXTERNAL_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS")


def methods() -> dict[str, list[str]]:
    return {
        "dense": [],
        "hierarchical": ["callbacks=[hierarchical_allreduce]", f"callbacks.hierarchical_allreduce.local_size={LOCAL}"],
        "local_k4": ["callbacks=[local_sgd]", "callbacks.local_sgd.k_steps=4"],
    }


DEFAULT_ONLY = "hierarchical,local_k4"  # with dense, which always runs


# ------------------------------------------------------------------------------------------- the link
@dataclass(frozen=True)
class NodeLink:
    """Two namespaces (``netns``) joined by a veth pair (``devs``, addresses :data:`ADDRS`)."""

    rate_bits: float | None
    netns: tuple[str, str]
    devs: tuple[str, str]

    def exec(self, node: int) -> list[str]:
        """The command prefix that runs a program in node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.netns[node]]

    def qdisc_bytes(self) -> tuple[int, int]:
        """Bytes each veth end's root qdisc has sent: node 0 → node 1, node 1 → node 0."""
        return tuple(slow_network.qdisc_sent_bytes(dev, ns) for ns, dev in zip(self.netns, self.devs))  # type: ignore[return-value]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def node_link(rate_bits: float | None, tag: str | None = None) -> Iterator[NodeLink]:
    """Build the two namespaces and their veth pair, throttled to ``rate_bits`` per second at both ends
    (``None``: unthrottled, MTU 1500 all the same); both namespaces (and so the pair) are deleted on exit."""
    tag = tag or f"{os.getpid() % 100000}"
    netns, devs = (f"pknode{tag}a", f"pknode{tag}b"), (f"pkv{tag}a", f"pkv{tag}b")  # interface names: 15 chars at most
    try:
        for ns in netns:
            _ip("netns", "add", ns)
        _ip("link", "add", devs[0], "netns", netns[0], "type", "veth", "peer", "name", devs[1], "netns", netns[1])
        for ns, dev, addr in zip(netns, devs, ADDRS):
            _ip("-n", ns, "link", "set", "lo", "up")  # intra-node traffic: the namespace's loopback, unthrottled
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            if rate_bits:
                slow_network.setup_link(rate_bits, dev, ns)  # MTU 1500, up, tbf at the rate
            else:
                _ip("-n", ns, "link", "set", dev, "mtu", "1500", "up")
        yield NodeLink(rate_bits, netns, devs)
    finally:
        for ns in netns:  # deleting a namespace deletes its end of the pair, and so the pair
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)


def link_refused() -> str | None:
    """Why the two-namespace link cannot be built here (``None``: it can)."""
    reason = slow_network.namespaces_refused()
    if reason:
        return reason
    try:
        with node_link(100e6, tag=f"p{os.getpid() % 100000}"):
            pass
    except subprocess.CalledProcessError as e:
        return f"'{' '.join(e.cmd)}' failed (needs root, veth and sch_tbf): {(e.stderr or '').strip()}"
    return None


_RECEIVER = """
import socket, sys
nbytes = int(sys.argv[2])
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
left = nbytes
while left > 0:
    chunk = conn.recv(min(left, 1 << 20))
    if not chunk:
        raise SystemExit("the sender closed early")
    left -= len(chunk)
conn.sendall(b"k")
conn.close()
"""

_SENDER = """
import socket, sys, time
addr, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
client = socket.create_connection((addr, port))
payload = b"\\0" * (1 << 20)
print("ready", flush=True)
sys.stdin.readline()
start = time.perf_counter()
left = nbytes
while left > 0:
    left -= client.send(payload[: min(left, len(payload))])
assert client.recv(1) == b"k"
print(time.perf_counter() - start, flush=True)
"""


def timed_transfer(link: NodeLink, nbytes: int) -> tuple[float, int, int]:
    """Send ``nbytes`` over TCP from node 0 (10.77.0.1) to node 1 (10.77.0.2) across the pair.

    Returns (seconds, bytes node 0's qdisc carried, bytes node 1's carried: the ACKs). The clock runs from the
    first byte sent until the receiver has read the last one and said so.
    """
    receiver = subprocess.Popen([*link.exec(1), sys.executable, "-c", _RECEIVER, ADDRS[1], str(nbytes)],
                                stdout=subprocess.PIPE, text=True)
    try:
        port = receiver.stdout.readline().strip()
        sender = subprocess.Popen([*link.exec(0), sys.executable, "-c", _SENDER, ADDRS[1], port, str(nbytes)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert sender.stdout.readline().strip() == "ready"
            before = link.qdisc_bytes()
            sender.stdin.write("go\n")
            sender.stdin.flush()
            seconds = float(sender.stdout.readline())
            after = link.qdisc_bytes()
            sender.wait(timeout=30)
        finally:
            if sender.poll() is None:
                sender.kill()
        receiver.wait(timeout=30)
    finally:
        if receiver.poll() is None:
            receiver.kill()
    return seconds, after[0] - before[0], after[1] - before[1]


# ------------------------------------------------------------------------------------------- one run
def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def formula_inter_bytes(name: str, grad_bytes: float, summary: dict) -> float:
    """Inter-node bytes per step (both directions) that gloo's ring all-reduces send, S = ``grad_bytes``."""
    n, groups = RANKS, RANKS // LOCAL
    dense = CROSSINGS * 2 * (n - 1) / n * grad_bytes  # each rank sends 2(n-1)/n·S to its successor; 2 of 4 links cross
    if name == "hierarchical":
        return groups * 2 * (groups - 1) / groups * grad_bytes  # every leader sends 2(G-1)/G·S to the other(s)
    if "local_sgd" in summary:  # the dense ring, only on the steps that average the parameters
        return dense * summary["local_sgd"]["sync_steps"] / max(summary["steps"], 1)
    return dense


def run_one(name: str, extra: list[str], args: argparse.Namespace, link: NodeLink, workdir: Path, port: int) -> dict:
    command, run_dir, clock = slow_network.job_command(name, ["strategy=ddp", f"trainer.num_nodes={RANKS // LOCAL}", *extra],
                                                       args, workdir, devices=LOCAL)
    workdir.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if k not in _EXTERNAL_ENV}
    before = link.qdisc_bytes()
    start = time.perf_counter()
    procs, logs = [], []
    try:
        for node in range(RANKS // LOCAL):
            env = {**base, "PYTHONPATH": slow_network.bench_pythonpath(), "GLOO_SOCKET_IFNAME": link.devs[node],
                   "NODE_RANK": str(node), "MASTER_ADDR": ADDRS[0], "MASTER_PORT": str(port)}
            logs.append(workdir / f"{name}.node{node}.log")
            with open(logs[-1], "w") as log:
                procs.append(subprocess.Popen([*link.exec(node), *command], cwd=workdir, env=env, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + args.timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                break
    finally:
        for proc in procs:
            _kill_group(proc)
    wall = time.perf_counter() - start
    after = link.qdisc_bytes()
    codes = [proc.returncode for proc in procs]
    if any(codes) or not (run_dir / "summary.json").exists():
        tails = "\n".join(f"node {i} (exit {c}): {p.read_text()[-700:]}" for i, (c, p) in enumerate(zip(codes, logs)))
        return {"name": name, "error": tails}
    summary, curve = slow_network.read_run(run_dir, clock)
    steps = summary["steps"]
    counted = summary["comm"]["bytes_sent_per_step"]
    hier = summary.get("hierarchical_allreduce")
    if hier:  # only the leaders send across: the job's inter-group bytes, both leaders
        intra, inter, counted_inter = hier["intra_group_bytes_per_step"], hier["inter_group_bytes_per_step"], hier["job_inter_group_bytes_per_step"]
    else:  # a flat ring: the two crossing links each carry what one rank sends (all ranks send alike)
        intra, inter, counted_inter = None, None, CROSSINGS * counted
    grad_bytes = summary["num_params"] * 4
    formula = formula_inter_bytes(name, grad_bytes, summary)
    carried = [a - b for a, b in zip(after, before)]
    return {"name": name, "overrides": extra, "wall_s": wall, "train_s": curve[-1][0] if curve else None, "steps": steps,
            "grad_bytes": grad_bytes, "bytes_per_step": counted, "intra_bytes_per_step": intra, "inter_bytes_per_step": inter,
            "counted_inter_node_bytes_per_step": counted_inter, "formula_inter_node_bytes_per_step": formula,
            "qdisc_bytes": carried, "throttled": sum(carried) >= counted_inter * steps,
            "val_curve": curve, "final_val_loss": summary["val_loss"], "final_train_loss": summary["final_loss"]}


def _attempts(name: str, extra: list[str], args: argparse.Namespace, link: NodeLink, workdir: Path, port: int, label: str) -> dict:
    for attempt in range(2):  # on a shared machine a run can die of its neighbours: once more
        r = run_one(name, extra, args, link, workdir / f"{label}_{attempt}", port + attempt)
        if "error" not in r:
            return r
        print(f"[{label}] {name} failed{', retrying once' if attempt == 0 else ''}: {r['error'][-600:]}", flush=True)
    return r


def run_link(link_name: str, args: argparse.Namespace, workdir: Path) -> tuple[dict, dict]:
    rate = LINKS[link_name]
    with node_link(rate) as link:
        probe = int(rate / 8 * 0.5)  # half a second's worth, node 0 → node 1
        seconds, carried, acks = timed_transfer(link, probe)
        print(f"[{link_name}] link check: {probe / 2**20:.1f} MiB node 0 -> node 1 in {seconds:.3f} s = "
              f"{probe * 8 / seconds / 1e6:,.0f} Mbit/s (set {rate / 1e6:,.0f}); qdiscs carried {carried / 2**20:.2f} MiB "
              f"(+ {acks / 2**10:.0f} KiB of ACKs back)", flush=True)
        check = {"bytes": probe, "seconds": seconds, "qdisc_bytes": carried, "ack_qdisc_bytes": acks, "measured_bit_s": probe * 8 / seconds}
        only = set((args.only or DEFAULT_ONLY).split(","))
        results = {}
        short_args = argparse.Namespace(**{**vars(args), "steps": args.short_steps})
        for i, (name, extra) in enumerate((k, v) for k, v in methods().items() if k == "dense" or k in only):
            r = _attempts(name, extra, args, link, workdir, args.port + 4 * i, link_name)
            if "error" not in r and args.short_steps:
                short = _attempts(name, extra, short_args, link, workdir, args.port + 4 * i + 2, f"{link_name}_short")
                r["short"] = {k: short[k] for k in ("steps", "qdisc_bytes", "wall_s", "formula_inter_node_bytes_per_step")} if "error" not in short else short
            results[name] = r
            if "error" not in r:
                print(f"[{link_name}] {name}: {r['wall_s']:.1f} s, val {r['final_val_loss']:.4f}, "
                      f"{r['bytes_per_step'] / 1024:.1f} KiB/step/rank, qdiscs {sum(r['qdisc_bytes']) / 2**20:.1f} MiB "
                      f"(formula {r['formula_inter_node_bytes_per_step'] * r['steps'] / 2**20:.1f} MiB); per step over "
                      f"{args.short_steps}..{args.steps} steps ÷ formula: {_fmt(per_step_ratio(r))}", flush=True)
    return results, check


# ------------------------------------------------------------------------------------------- report
def _kib(x: float | None) -> str:
    return f"{x / 1024:,.1f} KiB" if x is not None else ""


def per_step_qdisc_bytes(r: dict) -> float | None:
    """Both qdiscs' bytes per step, from the difference between the run and its short run (fixed costs cancel)."""
    short = r.get("short", {})
    if "qdisc_bytes" not in short or short["steps"] == r["steps"]:
        return None
    return (sum(r["qdisc_bytes"]) - sum(short["qdisc_bytes"])) / (r["steps"] - short["steps"])


def per_step_ratio(r: dict) -> float | None:
    """The long run's qdisc bytes less the short run's, ÷ the same difference of the formula's bytes."""
    if per_step_qdisc_bytes(r) is None:
        return None
    short = r["short"]
    formula = r["formula_inter_node_bytes_per_step"] * r["steps"] - short["formula_inter_node_bytes_per_step"] * short["steps"]
    return (sum(r["qdisc_bytes"]) - sum(short["qdisc_bytes"])) / formula


def _fmt(x: float | None) -> str:
    return f"{x:.3f}" if x is not None else "—"


def report(all_results: dict) -> list[str]:
    lines = ["| link | method | job wall time | training time | time to dense's final val loss (÷ dense) | final val loss "
             "| bytes / step / rank (counted) | inter-node / step: formula (counted) | veth qdiscs / step, whole run (0→1 + 1→0) "
             "| ÷ formula | veth qdiscs / step, long − short run | ÷ formula |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for link, results in all_results.items():
        dense = results.get("dense", {})
        target = dense.get("final_val_loss")
        dense_t = slow_network.time_to(dense.get("val_curve", []), target) if target else None
        for name, r in results.items():
            if "error" in r:
                lines.append(f"| {link} | {name} | failed | | | | | | | | | |")
                continue
            t = slow_network.time_to(r["val_curve"], target) if target else None
            best = min(v for _, v in r["val_curve"]) if r["val_curve"] else float("nan")
            reach = f"{t:.1f} s ({t / dense_t:.2f}×)" if t is not None and dense_t else f"not reached (best {best:.3f})"
            sent = _kib(r["bytes_per_step"])
            if r["intra_bytes_per_step"] is not None:
                sent += f" (intra {_kib(r['intra_bytes_per_step'])}, inter {_kib(r['inter_bytes_per_step'])})"
            steps = r["steps"]
            carried = " + ".join(_kib(b / steps) for b in r["qdisc_bytes"])
            ratio = sum(r["qdisc_bytes"]) / (r["formula_inter_node_bytes_per_step"] * steps)
            ratio_s = f"{ratio:.3f}" if r["throttled"] else f"{ratio:.3f} — not throttled"
            per_step = per_step_qdisc_bytes(r)
            lines.append(f"| {link} | {name} | {r['wall_s']:.1f} s | {r['train_s']:.1f} s | {reach} | {r['final_val_loss']:.3f} | {sent} "
                         f"| {_kib(r['formula_inter_node_bytes_per_step'])} ({_kib(r['counted_inter_node_bytes_per_step'])}) | {carried} "
                         f"| {ratio_s} | {_kib(per_step) or '—'} | {_fmt(per_step_ratio(r))} |")
    return lines


def load_results(tag: str = "") -> dict:
    return json.loads((RESULTS / f"node_link{tag}.json").read_text())


def tables(results: dict) -> dict[str, str]:
    """The Markdown table of saved results (``--table``; bench/docs_tables.py)."""
    return {"": "\n".join(report(results["results"]))}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--links", default=",".join(LINKS), help=f"comma-separated, of {list(LINKS)}")
    p.add_argument("--only", default=None, help=f"comma-separated methods of {list(methods())} (default: {DEFAULT_ONLY}); dense always runs")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--short-steps", type=int, default=10,
                   help="steps of each method's second, short run (0: none); 10 validates as often as a multiple of 10 does")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--port", type=int, default=29611, help="first MASTER_PORT (one per run, inside the namespaces)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--tag", default="", help="suffix of the results file")
    p.add_argument("--table", action="store_true", help="print the table of the saved results and exit (runs nothing)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.table:
        print(tables(load_results(args.tag))[""])
        return
    reason = link_refused()
    if reason:
        print(f"node_link: no two-namespace link can be built here, so no numbers: {reason}")
        return
    all_results, checks = {}, {}
    with tempfile.TemporaryDirectory(prefix="node_link_") as tmp:
        for link_name in args.links.split(","):
            all_results[link_name], checks[link_name] = run_link(link_name, args, Path(tmp))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"node_link{args.tag}.json"
    out.write_text(json.dumps({"args": vars(args), "date": time.strftime("%Y-%m-%d"), "link_checks": checks, "results": all_results}, indent=1))
    print("\n".join(["", *report(all_results), "", f"wrote {out}"]))


if __name__ == "__main__":
    main()
