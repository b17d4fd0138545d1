"""Parameter-server bridge: pull/push rows per second and bytes per step for 1/2 servers × 1/2 workers, a 10^5- vs
a 10^7-row id space per field (the bytes must not change), and sync / async / geo side by side (samples/s, AUC).

    python bench/parameter_server.py            # 10 training jobs × 60 steps + the RPC micro-benchmark, ~5 min on 2 shared cores
    python bench/parameter_server.py --quick    # 3 jobs × 20 steps + a short micro-benchmark, a smoke run

Two measurements of the pull/push path:

- **In training.** Every job is ``python train.py strategy=ps model=ctr data=ctr optim=adagrad
  trainer.devices=SERVERS+WORKERS ...`` in a subprocess; the numbers come from its ``summary.json``. Rows per
  second are worker 0's rows pulled (pushed) divided by the wall time it spent inside its pulls (pushes): all
  servers' requests in flight at once, so the slowest server's latency, and in sync mode a pull also waits
  there until every worker's push completed the previous step (the 2-worker rows include that wait).
- **The RPC path alone** (``--rpc-only`` runs just this): C client processes pull and push batches of U unique
  ids (async mode, no step barrier, rows already created) against S server processes, over TensorPipe on one
  host (its shared-memory transport), for about 1.5 s per batch size; rows per second per client and for all clients together.

Bytes per step are the tensor payloads a worker sends and receives per training step (pull: ids out, rows
back; push: ids and gradient rows out), against ``U·(8 + 4·D)·2`` with ``U`` the unique ids of the worker's
batch; RPC framing is not counted. The two id spaces use the same samples (``data.values_per_field=10^5``
values per field, placed without collisions into a 10^5- or 10^7-row slice), so any difference in bytes would
come from the table size. A dense table of the id space would hold ``8 · rows_per_field · D · 4`` bytes of
values alone. Everything runs on the CPU cores this machine has (2, shared): 4 processes on 2 cores measure
contention as much as the design.

Writes ``bench/results/parameter_server.json`` (``parameter_server_quick.json`` with ``--quick``) and prints
markdown tables.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIM = 16  # conf/model/ctr.yaml's embedding_dim
FIELDS = 8
VALUES = 10**5  # distinct values per field: the same samples for both id spaces
LAYOUTS = [(1, 1), (1, 2), (2, 1), (2, 2)]  # servers × workers
SPACES = [10**5, 10**7]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 jobs × 20 steps and a short micro-benchmark")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rpc-only", action="store_true", help="only the RPC micro-benchmark (prints, writes nothing)")
    parser.add_argument("--rpc-seconds", type=float, default=1.5, help="timed pulls (and pushes) per batch size and layout")
    parser.add_argument("--table", action="store_true", help="print the table(s) of the saved results and exit (runs nothing)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rpc_seconds = 20, 0.3
    return args


# ---------------------------------------------------------------------------------------------- training jobs
def run_job(run_dir: Path, steps: int, rows_per_field: int, mode: str = "sync", servers: int = 1, workers: int = 2) -> dict:
    cmd = [
        sys.executable, str(ROOT / "train.py"), "strategy=ps", f"strategy.mode={mode}", f"strategy.servers={servers}",
        "strategy.geo_k_steps=5", "model=ctr", "data=ctr", "optim=adagrad", f"trainer.devices={servers + workers}",
        f"data.rows_per_field={rows_per_field}", f"data.values_per_field={VALUES}", f"data.num_fields={FIELDS}",
        f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(cmd, cwd=run_dir.parent, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    ps, table = summary["ps"], summary["ps"]["tables"]["embedding"]
    return {
        "mode": mode, "servers": servers, "workers": workers, "rows_per_field": rows_per_field, "values_per_field": VALUES, "steps": summary["steps"],
        "bytes_per_step": ps["bytes_per_step"], "formula_bytes_per_step": ps["formula_bytes_per_step"], "bytes_ratio": ps["bytes_ratio"],
        "unique_ids_per_step": ps["rows_pulled"] / summary["steps"],
        "pull_rows_per_s": ps["pull_rows_per_s"], "push_rows_per_s": ps["push_rows_per_s"], "pull_s": ps["pull_s"], "push_s": ps["push_s"],
        "server_rows": table["rows"], "unique_ids_touched": table["unique_ids_touched"], "server_row_bytes": table["row_bytes"],
        "server_allocated_bytes": table["allocated_bytes"], "dense_table_bytes": FIELDS * rows_per_field * DIM * 4,
        "peak_rss_bytes": summary["peak_rss_bytes"], "server_peak_rss_bytes": ps["server_peak_rss_bytes"],
        "samples_per_s": summary["samples_per_s"], "step_time_s_median": summary["step_time_s_median"],
        "val_auc": summary["val_auc"], "bayes_auc": summary["data"]["bayes_auc"], "final_loss": summary["final_loss"],
    }


def training_jobs(quick: bool) -> list[tuple[int, str, int, int]]:
    """(rows_per_field, mode, servers, workers): the layouts × id spaces in sync mode, then async and geo."""
    if quick:
        return [(10**5, "sync", 1, 2), (10**7, "sync", 1, 2), (10**7, "async", 1, 2)]
    return [(space, "sync", s, w) for s, w in LAYOUTS for space in SPACES] + [(10**7, "async", 1, 2), (10**7, "geo", 1, 2)]


# ---------------------------------------------------------------------------------------------- RPC micro-benchmark
def _rpc_rank(rank: int, world: int, clients: int, store: str, batch_sizes: list[int], seconds: float, queue) -> None:
    import torch
    import torch.distributed.rpc as rpc

    from parallelkit.ps import PSClient, TableSpec, init_rpc, rpc_name
    from parallelkit.ps import server as srv

    torch.set_num_threads(1)
    if rank >= clients:  # a server: serve until every client said it is done
        server = srv.start_server(clients, "async", wait_timeout_s=120)
        init_rpc(rank, world, store, num_threads=8, timeout_s=120)
        server.wait_until_done(idle_timeout_s=120)
        rpc.shutdown()
        queue.put((rank, None))
        return
    init_rpc(rank, world, store, num_threads=8, timeout_s=120)
    client = PSClient([rpc_name(r) for r in range(clients, world)], rank, clients, "async")
    client.create_table(TableSpec("bench", DIM, "adagrad"))
    g = torch.Generator().manual_seed(rank)
    pool = torch.unique(torch.randint(0, FIELDS * 10**7, (1 << 17,), generator=g))  # this client's ids, as in a 10^7 space
    for chunk in pool.split(1 << 14):
        client.pull("bench", chunk)  # create the rows: what follows measures the steady state
    results = []
    for size in batch_sizes:
        batches = [torch.sort(pool[torch.randperm(len(pool), generator=g)[:size]]).values for _ in range(8)]
        grads = torch.full((size, DIM), 1e-3)
        client.rows_pulled = client.rows_pushed = 0
        client.pull_s = client.push_s = 0.0
        start, n = time.time(), 0
        while n < 5 or time.time() - start < seconds:
            ids = batches[n % len(batches)]
            client.pull("bench", ids)
            client.push("bench", ids, grads, lr=0.01)
            n += 1
        results.append({
            "batch": size, "requests": n, "start": start, "end": time.time(),
            "rows_pulled": client.rows_pulled, "pull_s": client.pull_s, "rows_pushed": client.rows_pushed, "push_s": client.push_s,
        })
    client.done()
    rpc.shutdown()
    queue.put((rank, results))


def rpc_benchmark(servers: int, clients: int, batch_sizes: list[int], seconds: float) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    world = servers + clients
    with tempfile.TemporaryDirectory(prefix="bench_ps_rpc_") as tmp:
        store = f"file://{tmp}/store"
        procs = [ctx.Process(target=_rpc_rank, args=(r, world, clients, store, batch_sizes, seconds, queue)) for r in range(world)]
        for p in procs:
            p.start()
        got = dict(queue.get(timeout=600) for _ in procs)
        for p in procs:
            p.join(timeout=60)
            if p.exitcode != 0:
                raise RuntimeError(f"micro-benchmark rank exited {p.exitcode}")
    rows = []
    for i, size in enumerate(batch_sizes):
        per_client = [got[c][i] for c in range(clients)]
        span = max(r["end"] for r in per_client) - min(r["start"] for r in per_client)
        pulled = sum(r["rows_pulled"] for r in per_client)
        pushed = sum(r["rows_pushed"] for r in per_client)
        rows.append({
            "servers": servers, "clients": clients, "batch": size, "requests_per_client": [r["requests"] for r in per_client],
            # Per client: rows per second of its time inside pulls (pushes); all clients: rows per second of wall time.
            "pull_rows_per_s_per_client": sum(r["rows_pulled"] / r["pull_s"] for r in per_client) / clients,
            "push_rows_per_s_per_client": sum(r["rows_pushed"] / r["push_s"] for r in per_client) / clients,
            "rows_per_s_all_clients": (pulled + pushed) / span,
            "pull_ms_per_request": 1e3 * sum(r["pull_s"] / r["requests"] for r in per_client) / clients,
            "push_ms_per_request": 1e3 * sum(r["push_s"] / r["requests"] for r in per_client) / clients,
            "bytes_per_pull": size * (8 + 4 * DIM),
        })
    return rows


# ---------------------------------------------------------------------------------------------- tables
def load_results() -> dict:
    return json.loads((ROOT / "bench" / "results" / "parameter_server.json").read_text())


def tables(result: dict) -> dict[str, str]:
    """The Markdown tables of saved results: ``training`` and ``rpc`` (``--table``; bench/docs_tables.py)."""
    out = {}
    if result["training"]:
        lines = [
            "| mode | servers × workers | ids / field | bytes/step/worker | ÷ U·(8+4D)·2 | U / step | pull rows/s | push rows/s | server rows = touched "
            "| table MiB on servers (dense MiB) | samples/s | val AUC (Bayes) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
        ]
        for r in result["training"]:
            mode = "geo (k=5)" if r["mode"] == "geo" else r["mode"]
            lines.append(
                f"| {mode} | {r['servers']} × {r['workers']} | 10^{len(str(r['rows_per_field'])) - 1} | {r['bytes_per_step'] / 1024:,.1f} KiB "
                f"| {r['bytes_ratio']:.3f} "
                f"| {r['unique_ids_per_step']:,.0f} | {r['pull_rows_per_s']:,.0f} | {r['push_rows_per_s']:,.0f} "
                f"| {r['server_rows']:,} = {r['unique_ids_touched']:,} | {r['server_allocated_bytes'] / 2**20:.1f} ({r['dense_table_bytes'] / 2**20:,.0f}) "
                f"| {r['samples_per_s']:,.0f} | {r['val_auc']:.4f} ({r['bayes_auc']:.4f}) |"
            )
        out["training"] = "\n".join(lines)
    if result["rpc"]:
        lines = [
            "| servers × clients | ids / request | pull rows/s per client | push rows/s per client | rows/s all clients (pull + push) | pull ms / request "
            "| push ms / request |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in result["rpc"]:
            lines.append(
                f"| {r['servers']} × {r['clients']} | {r['batch']:,} | {r['pull_rows_per_s_per_client']:,.0f} | {r['push_rows_per_s_per_client']:,.0f} "
                f"| {r['rows_per_s_all_clients']:,.0f} | {r['pull_ms_per_request']:.2f} | {r['push_ms_per_request']:.2f} |"
            )
        out["rpc"] = "\n".join(lines)
    return out


def print_tables(result: dict) -> None:
    captions = {"training": "In training (sync unless stated; worker 0's pulls and pushes; 10^5 and 10^7 rows per field, same samples):",
                "rpc": "The RPC path alone (async, rows created beforehand, TensorPipe on one host):"}
    for name, table in tables(result).items():
        print(f"\n{captions[name]}\n\n{table}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.table:
        print_tables(json.loads((ROOT / "bench" / "results" / ("parameter_server_quick.json" if args.quick else "parameter_server.json")).read_text()))
        return
    result: dict = {
        "steps": args.steps,
        "global_batch_size": 256,
        "embedding_dim": DIM,
        "num_fields": FIELDS,
        "values_per_field": VALUES,
        "training": [],
        "rpc": [],
    }
    if not args.rpc_only:
        with tempfile.TemporaryDirectory(prefix="bench_ps_") as tmp:
            for i, (space, mode, servers, workers) in enumerate(training_jobs(args.quick)):
                result["training"].append(run_job(Path(tmp) / f"job{i}", args.steps, space, mode, servers, workers))
                print(f"done: {mode} {servers} × {workers} rows_per_field={space:.0e}", file=sys.stderr, flush=True)
    batch_sizes = [1024, 16384]
    for servers, clients in ([(1, 1), (2, 1)] if args.quick else LAYOUTS):
        result["rpc"].extend(rpc_benchmark(servers, clients, batch_sizes, args.rpc_seconds))
        print(f"done: RPC {servers} × {clients}", file=sys.stderr, flush=True)
    print_tables(result)
    if not args.rpc_only:
        out = ROOT / "bench" / "results" / ("parameter_server_quick.json" if args.quick else "parameter_server.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
