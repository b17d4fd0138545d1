"""Context parallelism, measured by ``python train.py strategy=hybrid4d strategy.cp=N``: activation memory per rank,
key/value traffic and step time against one process and tensor parallelism; the longest sequence under a memory cap.

    python bench/context_parallel.py            # cp = 2 and 4, seq 2048, and the memory-cap search: ~12 min on 2 shared cores
    python bench/context_parallel.py --quick    # cp = 2 only, seq 512, batch 1, one search probe each for single and ring: ~3 min

Every contender is a ``train.py`` job (the real path: ``ParallelDims`` → ``parallelize`` → ``apply_cp``, the
strategy's batch cut, Lightning's loop) on the same GPT, data, seed and AdamW, fp32:

* **Activation memory**, measured: :class:`SavedActivations`, a callback passed with ``+callbacks.cpmem=...``, meters
  every tensor autograd saves for backward during each training step's forward (``saved_tensors_hooks``;
  :class:`~parallelkit.distributed.pipeline_measure.SavedActivationMeter`: a storage counted once however many
  saved tensors view it, parameters excluded), per rank. Divided by ``strategy=single``'s and by the ideal
  ``1/cp``: the goal (issue 32) is ≤ 1/cp + 10 %, read here as ``ratio × cp ≤ 1.10``. The process's peak RSS
  (``summary.json``, max rank; start-up, parameters and optimizer included) is the secondary column.
* **Traffic**: ``comm.by_kind`` ``cp_ring_p2p`` / ``cp_all_to_all`` per step (what each rank writes to the
  wire, counted as for every strategy) against the formula: ring ``layers × ring_payload_bytes(|k|, cp)`` plus gloo's
  per-message overheads (``(3·cp − 2)`` messages per layer, each ``GLOO_SEND_OVERHEAD + GLOO_RECV_OVERHEAD``);
  all-to-all 8 exchanges per layer of ``(cp − 1)/cp·|q|`` plus ``cp − 1`` messages each.
* **Step time**: ``summary.json`` ``step_time_s_median`` against ``strategy=single`` and against
  ``strategy.tp=2`` on the same 2 ranks. Every process runs one intra-op thread (``--threads``): a rank stands for
  one device, and on a loaded 2-core machine two OpenMP threads in one process measured 2.7× slower than one
  (spinning on a busy core), which would decide the comparison. cp = 4 runs 4 processes on 2 cores: its step time
  is not comparable.
* **Losses**: each step's loss against ``strategy=single``'s (max relative difference).
* **Longest sequence under a memory cap**: each process of a job runs under ``RLIMIT_AS`` (``ulimit -v``, set
  before ``train.py`` starts and inherited by the ranks it starts), batch 1, ``--search-steps`` steps. The cap is
  the same *budget* (``--budget-mib``) above each layout's own footprint, the peak address space (``VmPeak``, max
  process) of the same job at sequence 512: a rank of a 2-process job maps ~0.5 GiB more address space than one
  process at the same RSS (gloo's threads and their malloc arenas), so one absolute cap would charge that to cp.
  The sequence length doubles from ``--search-start`` until a run fails for memory, then bisects (multiples of
  512) until the bracket is within 1/8. A failure that is not a memory error stops the bench.

Writes ``bench/results/context_parallel.json`` (``context_parallel_quick.json`` with ``--quick``) and prints the
Markdown tables of docs/benchmarks.md (``--table``: of the saved results; ``python bench/docs_tables.py`` writes them into the page).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
HYBRID = ["strategy=hybrid4d", "strategy.tp=1", "strategy.pp=1", "strategy.timeout_s=60"]
# (label, overrides, processes)
LAYOUTS = [
    ("single", ["strategy=single"], 1),
    ("cp=2 ring", [*HYBRID, "strategy.cp=2"], 2),
    ("cp=2 ulysses", [*HYBRID, "strategy.cp=2", "strategy.cp_mode=ulysses"], 2),
    ("tp=2", ["strategy=hybrid4d", "strategy.tp=2", "strategy.pp=1", "strategy.timeout_s=60"], 2),
    ("cp=4 ring", [*HYBRID, "strategy.cp=4"], 4),
    ("cp=4 ulysses", [*HYBRID, "strategy.cp=4", "strategy.cp_mode=ulysses"], 4),
]
SEARCHED = ["single", "cp=2 ring", "cp=2 ulysses"]
# What a process that ran out of its address space says (the allocator, C++ new, Python), or how it died.
OUT_OF_MEMORY = ("can't allocate memory", "Cannot allocate memory", "std::bad_alloc", "MemoryError", "out of memory",
                 "Resource temporarily unavailable")
GRANULE = 512  # searched sequence lengths: multiples of this (divisible by 2·cp)
# The chars corpus (465 k characters) holds one training and one validation sequence of up to 116 k tokens only with half
# of it for validation (validation is off in these runs).
SEARCH_DATA = ("data.val_fraction=0.5",)


class SavedActivations(Callback):
    """Per training step, the peak bytes of tensors autograd saved for backward during its forward, on this rank.

    Writes ``rank<R>.json`` (``{"saved_bytes": [per step], "vm_peak_kib", "vm_hwm_kib"}``) to ``out`` at the end of
    training.

    Args:
        out: the directory the per-rank files go to.

    Example::

        python train.py ... '+callbacks.cpmem={_target_:bench.context_parallel.SavedActivations,out:/tmp/mem}'
    """

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.saved_bytes: list[int] = []
        self._meter = None
        self._hooks = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from parallelkit.distributed.pipeline_measure import SavedActivationMeter

        self._meter = SavedActivationMeter(list(pl_module.parameters()))
        self._hooks = self._meter.hooks()
        self._hooks.__enter__()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        # Forward is over: every activation backward needs has been saved (and none released yet).
        self._hooks.__exit__(None, None, None)
        self._hooks = None
        self.saved_bytes.append(self._meter.peak)

    def on_train_end(self, trainer, pl_module) -> None:
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps({
            "saved_bytes": self.saved_bytes,
            "vm_peak_kib": int(status["VmPeak"].split()[0]), "vm_hwm_kib": int(status["VmHWM"].split()[0]),
        }))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6, help="steps per job of the main table")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2, help="global batch (every cp rank reads all of it)")
    p.add_argument("--budget-mib", type=float, default=256, help="search: RLIMIT_AS = the layout's VmPeak at seq 512 + this")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process (OMP_NUM_THREADS)")
    p.add_argument("--search-start", type=int, default=4096)
    p.add_argument("--search-max", type=int, default=65536)
    p.add_argument("--search-steps", type=int, default=2)
    p.add_argument("--max-probes", type=int, default=7, help="search runs per contender at most")
    p.add_argument("--no-search", action="store_true")
    p.add_argument("--quick", action="store_true", help="cp = 2 only, seq 512, 4 steps, two search probes each for single and ring")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--table", action="store_true", help="print the table(s) of the saved results and exit (runs nothing)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.seq_len, args.batch, args.max_probes, args.search_start = 3, GRANULE, 1, 1, 2048
    return args


def train(args: argparse.Namespace, run_dir: Path, overrides: list[str], devices: int, *, seq_len: int, batch: int,
          steps: int, cap_bytes: int | None = None, extra: tuple[str, ...] = ()) -> tuple[dict | None, str]:
    """One ``train.py`` job; (its summary with the per-rank meter files under ``"meter"``, "ok"), or, under a memory
    cap, (None, why) when it ran out of memory."""
    command = [
        sys.executable, str(ROOT / "train.py"), "model=gpt", "data=chars",
        f"model.n_layer={args.n_layer}", f"model.n_head={args.n_head}", f"model.n_embd={args.n_embd}",
        f"data.seq_len={seq_len}", f"data.global_batch_size={batch}", f"trainer.max_steps={steps}",
        "trainer.limit_val_batches=0", f"trainer.log_every_n_steps={steps}", "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false", "checkpoint.every_n_steps=0", f"trainer.devices={devices}", *overrides, *extra,
        f"+callbacks.cpmem={{_target_:bench.context_parallel.SavedActivations,out:{run_dir / 'meter'}}}",
        f"hydra.run.dir={run_dir}",
    ]

    def limit() -> None:  # in the child before exec: train.py and the ranks it starts inherit it
        resource.setrlimit(resource.RLIMIT_AS, (cap_bytes, cap_bytes))

    try:
        proc = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout,
                              env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}, preexec_fn=limit if cap_bytes else None)
    except subprocess.TimeoutExpired:
        if cap_bytes:
            return None, "timed out"
        raise
    if proc.returncode != 0:
        found = next((m for m in OUT_OF_MEMORY if m in proc.stderr or m in proc.stdout), None)
        if cap_bytes and found:
            return None, f"exit {proc.returncode}: {found}"
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["meter"] = [json.loads((run_dir / "meter" / f"rank{r}.json").read_text()) for r in range(devices)]
    return summary, "ok"


def formula_bytes(mode: str, cp: int, layers: int, q_bytes: int) -> tuple[int, int]:
    """(payload, payload + gloo's per-message overheads) one rank sends per step for context-parallel attention."""
    from parallelkit.distributed.comm_stats import (
        GLOO_RECV_OVERHEAD,
        GLOO_SEND_OVERHEAD,
    )
    from parallelkit.distributed.context_parallel import ring_payload_bytes

    per_message = GLOO_SEND_OVERHEAD + GLOO_RECV_OVERHEAD
    if mode == "ring":  # k has q's size here (no GQA): (3·cp − 2) messages of 2·|k| per layer
        payload = layers * ring_payload_bytes(q_bytes, cp)
        return payload, payload + layers * (3 * cp - 2) * per_message
    payload = layers * 8 * (cp - 1) * q_bytes // cp  # q, k, v, out forward; their gradients backward
    return payload, payload + layers * 8 * (cp - 1) * per_message


def measure_layouts(args: argparse.Namespace, tmp: Path) -> list[dict]:
    layouts = [layout for layout in LAYOUTS if not (args.quick and layout[2] > 2)]
    rows, single = [], None
    for index, (label, overrides, devices) in enumerate(layouts):
        started = time.perf_counter()
        summary, _ = train(args, tmp / f"layout{index}", overrides, devices, seq_len=args.seq_len, batch=args.batch, steps=args.steps)
        single = single or summary
        dims = summary["dims"]
        saved = max(max(m["saved_bytes"]) for m in summary["meter"])
        row = {
            "layout": label, "dims": dims, "processes": devices,
            "saved_activation_bytes_per_rank": [max(m["saved_bytes"]) for m in summary["meter"]],
            "saved_activation_bytes": saved,
            "peak_rss_bytes": summary["peak_rss_bytes"],
            "vm_peak_kib": max(m["vm_peak_kib"] for m in summary["meter"]),
            "step_time_s_median": summary["step_time_s_median"],
            "max_rel_loss_diff_vs_single": max(abs(a - b) / abs(b) for a, b in zip(summary["train_loss"], single["train_loss"])),
            "train_loss": summary["train_loss"],
            "by_kind": summary["comm"]["by_kind"],
        }
        if dims["cp"] > 1:
            cp, mode = dims["cp"], summary["context_parallel"]["mode"]
            kind = "cp_ring_p2p" if mode == "ring" else "cp_all_to_all"
            q_bytes = args.batch * (args.seq_len // cp) * args.n_embd * 4
            payload, wire = formula_bytes(mode, cp, args.n_layer, q_bytes)
            row.update(mode=mode, context_parallel=summary["context_parallel"], kv_kind=kind,
                       kv_bytes_counted=summary["comm"]["by_kind"][kind]["bytes_per_step"], kv_payload_formula=payload,
                       kv_bytes_formula=wire)
        rows.append(row)
        print(f"{label}: saved activations {saved / 2**20:.2f} MiB per rank, step {row['step_time_s_median'] * 1e3:.0f} ms, "
              f"loss Δ {row['max_rel_loss_diff_vs_single']:.1e} ({time.perf_counter() - started:.0f} s)", flush=True)
    base = rows[0]
    tp2 = next((r for r in rows if r["layout"] == "tp=2"), None)
    for row in rows:
        cp = row["dims"]["cp"] * row["dims"]["tp"]  # the ranks one sequence is spread over (tp: ideal 1/tp as well)
        row["saved_over_single"] = row["saved_activation_bytes"] / base["saved_activation_bytes"]
        row["saved_over_ideal"] = row["saved_over_single"] * cp
        row["rss_over_single"] = row["peak_rss_bytes"] / base["peak_rss_bytes"]
        row["step_over_single"] = row["step_time_s_median"] / base["step_time_s_median"]
        if tp2 is not None and row["processes"] == 2:
            row["step_over_tp2"] = row["step_time_s_median"] / tp2["step_time_s_median"]
    return rows


def search(args: argparse.Namespace, tmp: Path, label: str, rows: list[dict]) -> dict:
    """The longest sequence ``label`` trains under its cap: double from ``--search-start``, then bisect."""
    overrides, devices = next((o, d) for name, o, d in LAYOUTS if name == label)
    tag = label.replace(" ", "_").replace("=", "")
    row = next((r for r in rows if r["layout"] == label and (args.seq_len, args.batch) == (GRANULE, 1)), None)
    if row is None:  # the footprint: this layout's job at sequence 512, batch 1, uncapped
        summary, _ = train(args, tmp / f"footprint_{tag}", overrides, devices, seq_len=GRANULE, batch=1, steps=args.search_steps,
                           extra=SEARCH_DATA)
        footprint_kib = max(m["vm_peak_kib"] for m in summary["meter"])
    else:
        footprint_kib = row["vm_peak_kib"]
    cap = footprint_kib * 1024 + int(args.budget_mib * 2**20)
    probes: list[dict] = []

    def fits(seq: int) -> bool:
        started = time.perf_counter()
        summary, outcome = train(args, tmp / f"search_{tag}_{seq}", overrides, devices, seq_len=seq, batch=1,
                                 steps=args.search_steps, cap_bytes=cap, extra=SEARCH_DATA)
        probes.append({"seq_len": seq, "trained": summary is not None, "outcome": outcome,
                       "seconds": round(time.perf_counter() - started, 1),
                       "peak_rss_bytes": summary["peak_rss_bytes"] if summary else None,
                       "vm_peak_kib": max(m["vm_peak_kib"] for m in summary["meter"]) if summary else None,
                       "saved_activation_bytes": max(max(m["saved_bytes"]) for m in summary["meter"]) if summary else None})
        print(f"  {label} seq {seq}: {outcome} ({probes[-1]['seconds']:.0f} s)", flush=True)
        return summary is not None

    lo, hi, seq = 0, None, args.search_start
    while len(probes) < args.max_probes and seq <= args.search_max:  # doubling
        if not fits(seq):
            hi = seq
            break
        lo, seq = seq, seq * 2
    while hi is not None and len(probes) < args.max_probes and hi - lo > max(GRANULE, lo // 8):  # bisection
        mid = (lo + hi) // 2 // GRANULE * GRANULE
        if mid <= lo:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return {"layout": label, "processes": devices, "footprint_vm_peak_kib": footprint_kib, "cap_bytes": cap,
            "longest_trained": lo, "first_failed": hi, "probes": probes}


def markdown(results: dict) -> str:
    w = results["workload"]

    def mib(v: float) -> str:
        return f"{v / 2**20:,.2f} MiB"

    lines = [
        (f"GPT n_layer={w['n_layer']} n_head={w['n_head']} n_embd={w['n_embd']}, seq_len={w['seq_len']}, global batch "
         f"{w['batch']}, fp32, {w['steps']} steps per job; saved activations = bytes autograd keeps for backward after one "
         "step's forward, max over ranks and steps."),
        "",
        ("| layout | saved activations per rank | ÷ single | × ideal (1/cp; tp: 1/tp) | peak RSS (max rank) | ÷ single "
         "| K/V bytes per step, counted | formula (payload + gloo headers) | counted / formula | step time (median) "
         "| × single | × tp=2 | max rel. Δ loss vs single |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["layouts"]:
        kv = (f"{mib(r['kv_bytes_counted'])} | {mib(r['kv_bytes_formula'])} | {r['kv_bytes_counted'] / r['kv_bytes_formula']:.6f}"
              if "kv_bytes_counted" in r else "– | – | –")
        over_tp = f"{r['step_over_tp2']:.2f}" if "step_over_tp2" in r else "–"
        lines.append(
            f"| {r['layout']} | {mib(r['saved_activation_bytes'])} | {r['saved_over_single']:.3f} | **{r['saved_over_ideal']:.3f}** "
            f"| {mib(r['peak_rss_bytes'])} | {r['rss_over_single']:.2f} | {kv} | {r['step_time_s_median'] * 1e3:,.0f} ms "
            f"| {r['step_over_single']:.2f} | {over_tp} | {r['max_rel_loss_diff_vs_single']:.1e} |")
    if results.get("search"):
        lines += [
            "",
            (f"Longest sequence under a per-process memory cap (`RLIMIT_AS` = the layout's peak address space at sequence "
             f"{GRANULE} + {w['budget_mib']:g} MiB, batch 1, {w['search_steps']} steps; doubling from {w['search_start']}, "
             "then bisection):"),
            "",
            "| layout | processes | footprint (VmPeak at 512) | cap per process | longest trained | first that ran out | probes (seq: outcome) |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        for s in results["search"]:
            if "error" in s:
                lines.append(f"| {s['layout']} | failed: {s['error'].splitlines()[-1][:200]} | | | | | |")
                continue
            probes = ", ".join(f"{p['seq_len']}: {'ok' if p['trained'] else 'OOM'}" for p in s["probes"])
            lines.append(f"| {s['layout']} | {s['processes']} | {s['footprint_vm_peak_kib'] / 1024:,.0f} MiB | "
                         f"{s['cap_bytes'] / 2**20:,.0f} MiB | {s['longest_trained']:,} | "
                         f"{'–' if s['first_failed'] is None else format(s['first_failed'], ',')} | {probes} |")
    return "\n".join(lines)


def load_results() -> dict:
    return json.loads((RESULTS / "context_parallel.json").read_text())


def tables(results: dict) -> dict[str, str]:
    """The Markdown tables of saved results, without their captions: ``layouts`` and (if searched) ``search``
    (``--table``; bench/docs_tables.py)."""
    blocks = ["\n".join(line for line in block.splitlines() if line.startswith("|"))
              for block in markdown(results).split("\n\n")]
    return dict(zip(("layouts", "search"), [b for b in blocks if b]))


def save(args: argparse.Namespace, results: dict) -> Path:
    import torch

    results["torch"] = torch.__version__
    out = RESULTS / ("context_parallel_quick.json" if args.quick else "context_parallel.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table:
        print(markdown(json.loads((RESULTS / ("context_parallel_quick.json" if args.quick else "context_parallel.json")).read_text())))
        return 0
    started = time.perf_counter()
    results: dict = {"workload": {k: v for k, v in vars(args).items() if k not in ("timeout", "table")}, "cores": os.cpu_count(),
                     "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with tempfile.TemporaryDirectory(prefix="pk_bench_cp_") as tmp:
        results["layouts"] = measure_layouts(args, Path(tmp))
        save(args, results)  # the search takes longest: what is measured so far is kept if it fails
        if not args.no_search:
            results["search"] = []
            for label in SEARCHED if not args.quick else SEARCHED[:2]:
                try:
                    results["search"].append(search(args, Path(tmp), label, results["layouts"]))
                except SystemExit as error:  # a failure other than memory: recorded, and the other searches still run
                    results["search"].append({"layout": label, "error": str(error)[-2000:]})
                    print(f"  {label}: {str(error)[-500:]}", flush=True)
                save(args, results)
    results["seconds"] = round(time.perf_counter() - started)
    out = save(args, results)
    print("\n" + markdown(results))
    missed = [r for r in results["layouts"] if r["dims"]["cp"] > 1 and r["saved_over_ideal"] > 1.10]
    wrong = [r for r in results["layouts"] if r["max_rel_loss_diff_vs_single"] > 1e-5]
    print(f"\nGoal (issue 32): saved activations per rank ≤ 1/cp + 10 % — met by "
          f"{sum(r['dims']['cp'] > 1 for r in results['layouts']) - len(missed)} of {sum(r['dims']['cp'] > 1 for r in results['layouts'])} cp rows"
          + (": missed by " + ", ".join(f"{r['layout']} (×{r['saved_over_ideal']:.3f})" for r in missed) if missed else "")
          + f". Losses within 1e-5 of single: {'all' if not wrong else 'not ' + ', '.join(r['layout'] for r in wrong)}.")
    print(f"wrote {out} ({results['seconds']} s)")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
