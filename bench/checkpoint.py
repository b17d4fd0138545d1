"""What a checkpoint costs, per layout: training stall (synchronous vs ``checkpoint.async_save=true``), save and load
time, and peak memory per rank during a save, against ``torch.distributed.checkpoint`` used directly.

Every contender is a ``train.py`` job (the real path: the strategy's own checkpoint, ``PeriodicCheckpoint``) training
a GPT big enough that a save takes measurable time (default ``n_layer=4 n_embd=512``: 12.7 M parameters, 153 MB of
parameters and AdamW moments) at 2 and 4 gloo ranks, for ``ddp``, ``zero`` (stage 3, FSDP2), ``tp`` and
``hybrid4d`` (2 ranks: ``pp=2``; 4 ranks: ``tp=2 × pp=2``). Two jobs per layout and world size:

- **stall**: the same run twice, synchronous and asynchronous saves, ``checkpoint.every_n_steps=K`` with
  ``save_top_k=0`` (``last.ckpt`` only: one write per save in both). Per periodic save (the final one excluded):
  the time training stood still on rank 0 (``PeriodicCheckpoint.save_records``: for async the wait for a previous
  save, the loggers and the staging copy), the time until it was on disk, and the extra step time of the steps
  that overlapped the background write (median step time outside saves as the base). The first asynchronous save
  allocates the staging buffers (their pages are faulted in): it is reported apart.
- **controlled** (in the synchronous job, after the last step, every rank in step, one measurement at a time):
  the strategy's synchronous save (``trainer.save_checkpoint``: a sharded DCP directory or rank 0's file) and its
  load (``strategy.load_checkpoint`` + the model/optimizer state applied); a hand-written ``dcp.save`` / ``dcp.load``
  of the same model and optimizer state (``get_model_state_dict`` / ``get_optimizer_state_dict``); and the
  asynchronous writer (``parallelkit.distributed.async_checkpoint``) run cold and warm, each waited for. Peak memory
  is the process's RSS high-water mark during the operation (``VmHWM``, reset through ``/proc/self/clear_refs``)
  minus its RSS just before, per rank (glibc's mmap threshold fixed at 128 KiB, so that freed tensors leave the
  RSS and the next operation's allocations show); it is set against the rank's model-state bytes (parameters + gradients +
  optimizer state it holds) plus its largest tensor.

    python bench/checkpoint.py              # 2 and 4 ranks × 4 layouts, ~10-15 min on 2 cores
    python bench/checkpoint.py --quick      # 2 ranks, ddp and zero only, a smaller model

Writes ``bench/results/checkpoint.json`` and prints the Markdown table of docs/benchmarks.md
(``--table``: the tables of the saved results; ``python bench/docs_tables.py`` writes them into the page).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
# A fixed mmap threshold: every tensor above 128 KiB is its own mapping, given back to the system when freed, so that
# an RSS high-water mark measures what an operation allocated (with glibc's adaptive threshold, memory freed earlier
# stays in the heap and hides later allocations).
ENV = {"OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
LAYOUTS = {
    "ddp": {2: ["strategy=ddp"], 4: ["strategy=ddp"]},
    "zero3": {2: ["strategy=zero", "strategy.stage=3"], 4: ["strategy=zero", "strategy.stage=3"]},
    "tp": {2: ["strategy=tp", "strategy.tp=2"], 4: ["strategy=tp", "strategy.tp=2"]},
    "hybrid4d": {2: ["strategy=hybrid4d", "strategy.tp=1", "strategy.pp=2", "strategy.microbatches=2"],
                 4: ["strategy=hybrid4d", "strategy.tp=2", "strategy.pp=2", "strategy.microbatches=2"]},
}


# ---------------------------------------------------------------------------------------------------- in the job
def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _measured(strategy, fn) -> dict:
    """Run ``fn`` on every rank, in step; its wall time here and the RSS high-water mark it added to this process."""
    gc.collect()
    strategy.barrier("bench.checkpoint")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    began = time.perf_counter()
    extra = fn() or {}
    seconds = time.perf_counter() - began
    peak = _status_kib("VmHWM")
    strategy.barrier("bench.checkpoint")
    return {"s": seconds, "peak_delta_bytes": (peak - before) * 1024, **extra}


def _largest_tensor_bytes(module, optimizers) -> int:
    import torch

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    sizes = [local(p).numel() * p.element_size() for p in module.parameters()]
    for opt in optimizers:
        for state in getattr(opt, "state", {}).values():
            sizes += [local(v).numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor)]
    return max(sizes)


class SaveMeter(Callback):
    """Records step ends and ``PeriodicCheckpoint.save_records``; with ``controlled``, measures the saves and loads
    above after the last step. Writes ``rank<R>.json`` to ``out``.

    Example::

        python train.py ... '+callbacks.meter={_target_:bench.checkpoint.SaveMeter,out:/tmp/m,controlled:true}'
    """

    def __init__(self, out: str, controlled: bool = False) -> None:
        self.out = Path(out)
        self.controlled = controlled
        self.step_ends: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.step_ends.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module) -> None:
        from parallelkit.callbacks.periodic_checkpoint import PeriodicCheckpoint

        periodic = next(cb for cb in trainer.callbacks if isinstance(cb, PeriodicCheckpoint))
        periodic.on_train_end(trainer, pl_module)  # the final save written (and waited for) before anything is measured
        strategy = trainer.strategy
        result = {"rank": trainer.global_rank, "step_ends": self.step_ends, "save_records": periodic.save_records,
                  "model_state_bytes": strategy.model_state_bytes(),
                  "largest_tensor_bytes": _largest_tensor_bytes(pl_module, trainer.optimizers)}
        if self.controlled:
            result["controlled"] = self._controlled(trainer, pl_module, Path(strategy.broadcast(str(self.out / "ckpt"))))
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))

    def _controlled(self, trainer, pl_module, where: Path) -> dict:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from parallelkit.distributed.async_checkpoint import AsyncCheckpointWriter, checkpoint_layout

        strategy, found = trainer.strategy, {}
        module = strategy.model  # what the strategy wraps or parallelized in place
        optimizer = trainer.optimizers[0]
        found["sync_save"] = _measured(strategy, lambda: trainer.save_checkpoint(where / "sync.ckpt"))

        def load_sync():
            checkpoint = strategy.load_checkpoint(where / "sync.ckpt")
            if "state_dict" in checkpoint:  # a one-file checkpoint: applied as Lightning's resume applies it
                strategy.load_model_state_dict(checkpoint)
                strategy.load_optimizer_state_dict(checkpoint)

        found["sync_load"] = _measured(strategy, load_sync)

        def state():
            return {"model": get_model_state_dict(module), "optim": get_optimizer_state_dict(module, optimizer)}

        try:
            found["dcp_save"] = _measured(strategy, lambda: dcp.save(state(), checkpoint_id=str(where / "dcp")) and None)

            def load_dcp():
                loaded = state()
                dcp.load(loaded, checkpoint_id=str(where / "dcp"))
                set_model_state_dict(module, loaded["model"])
                set_optimizer_state_dict(module, optimizer, loaded["optim"])

            found["dcp_load"] = _measured(strategy, load_dcp)
            # torch's own asynchronous save of the same state (its default stager, reused: cold, then warm): the stall
            # a hand-written DCP loop would have, against the writer's (async_cold / async_warm below).
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            stager = DefaultStager(StagingOptions(False, False, False, False))
            for label in ("dcp_async_cold", "dcp_async_warm"):
                def run_dcp_async(label: str = label) -> dict:
                    began = time.perf_counter()
                    future = dcp.async_save(state(), checkpoint_id=str(where / label), async_stager=stager)
                    stall = time.perf_counter() - began
                    future.result()
                    return {"stall_s": stall}

                found[label] = _measured(strategy, run_dcp_async)
            stager.close()
        except Exception as err:  # noqa: BLE001 - a layout torch's helpers do not take (recorded, the rest measured)
            found["dcp_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        writer = AsyncCheckpointWriter(checkpoint_layout(strategy), timeout_s=getattr(strategy, "timeout_s", 600))
        writer.setup(strategy)
        for label in ("async_cold", "async_warm"):
            def run():
                record = writer.start(trainer, [where / "async.ckpt"])
                stall = record.stall_s
                writer.wait()
                if record.error is not None:
                    raise record.error
                return {"stall_s": stall, "write_s": record.write_s}

            found[label] = _measured(strategy, run)
        writer.close()
        return found


# ---------------------------------------------------------------------------------------------------- the driver
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=4, help="global batch")
    p.add_argument("--steps", type=int, default=16)  # saves at 3, 6, ..., 15: the cold first one and 4 warm ones (their median is the stall)
    p.add_argument("--every", type=int, default=3, help="checkpoint.every_n_steps")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    p.add_argument("--quick", action="store_true", help="2 ranks, ddp and zero3, n_embd 256")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--table", action="store_true", help="print the table(s) of the saved results and exit (runs nothing)")
    args = p.parse_args(argv)
    if args.quick:
        args.worlds, args.layouts, args.n_embd = [2], ["ddp", "zero3"], 256
    return args


def train(args: argparse.Namespace, run_dir: Path, layout: list[str], devices: int, async_save: bool, controlled: bool) -> list[dict]:
    command = [
        sys.executable, str(ROOT / "train.py"), "model=gpt", "data=chars", f"model.n_layer={args.n_layer}",
        f"model.n_embd={args.n_embd}", f"model.n_head={args.n_head}", "model.dropout=0", f"data.seq_len={args.seq_len}",
        f"data.global_batch_size={args.batch}", f"trainer.max_steps={args.steps}", "trainer.limit_val_batches=0",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", f"trainer.devices={devices}",
        f"checkpoint.every_n_steps={args.every}", "checkpoint.save_top_k=0", f"checkpoint.async_save={str(async_save).lower()}",
        *layout, f"+callbacks.meter={{_target_:bench.checkpoint.SaveMeter,out:{run_dir / 'meter'},controlled:{str(controlled).lower()}}}",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout,
                          env={**os.environ, **ENV, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return [json.loads((run_dir / "meter" / f"rank{r}.json").read_text()) for r in range(devices)]


def stalls(rank0: dict, steps: int) -> dict:
    """Per periodic save of rank 0 (the final one excluded): stall, write time, and the extra step time of the
    steps that overlapped the write."""
    ends = rank0["step_ends"]
    durations = [(ends[i - 1], ends[i]) for i in range(1, len(ends))]
    saves = [r for r in rank0["save_records"] if r["step"] < steps]
    windows = [(r["began"], r["began"] + (r["write_s"] or r["stall_s"])) for r in saves]

    def overlaps(a, b, w):
        return a < w[1] and b > w[0]

    quiet = [b - a for a, b in durations if not any(overlaps(a, b, w) for w in windows)]
    base = statistics.median(quiet) if quiet else float("nan")
    rows, previous_end = [], float("-inf")
    for r, w in zip(saves, windows):
        excess = sum((b - a) - base for a, b in durations if overlaps(a, b, w))
        waited = max(0.0, min(previous_end, w[0] + r["stall_s"]) - w[0])  # for the previous save's write (one in flight)
        rows.append({"step": r["step"], "stall_s": r["stall_s"], "waited_s": waited, "write_s": r["write_s"], "step_time_excess_s": excess,
                     # of an async stall: Lightning's checkpoint dump (the strategy's state dicts) and the staging/planning after it
                     "dump_s": r.get("dump_s"), "stage_s": r.get("stage_s"),
                     # of an async stall: the wait, before the next optimizer step, for the copy of the parameters and moments
                     "staged_wait_s": r.get("staged_wait_s")})
        previous_end = w[1]
    return {"median_step_s": base, "saves": rows}


def measure(args: argparse.Namespace, tmp: Path) -> list[dict]:
    rows = []
    for devices in args.worlds:
        for name in args.layouts:
            layout = LAYOUTS[name][devices]
            print(f"{name} × {devices}: synchronous ...", file=sys.stderr, flush=True)
            sync = train(args, tmp / f"{name}{devices}_sync", layout, devices, async_save=False, controlled=True)
            print(f"{name} × {devices}: asynchronous ...", file=sys.stderr, flush=True)
            asyn = train(args, tmp / f"{name}{devices}_async", layout, devices, async_save=True, controlled=False)
            rows.append({"layout": name, "world": devices, "overrides": layout, "sync": stalls(sync[0], args.steps),
                         "async": stalls(asyn[0], args.steps),
                         "ranks": [{k: r[k] for k in ("rank", "model_state_bytes", "largest_tensor_bytes", "controlled")} for r in sync]})
            print(json.dumps(summarize(rows[-1])), file=sys.stderr, flush=True)
    return rows


def _median_of(saves: list[dict], key: str) -> float | None:
    values = [s[key] for s in saves if s.get(key) is not None]
    return statistics.median(values) if values else None


def summarize(row: dict) -> dict:
    sync_saves = [s["stall_s"] for s in row["sync"]["saves"]]
    async_saves = row["async"]["saves"]
    warm = [s["stall_s"] for s in async_saves[1:]] or [s["stall_s"] for s in async_saves]
    ranks = row["ranks"]

    def worst(key, field="s"):
        values = [r["controlled"][key][field] for r in ranks if key in r["controlled"]]
        return max(values) if values else None

    bound = max(sum(r["model_state_bytes"].values()) + r["largest_tensor_bytes"] for r in ranks)
    return {
        "layout": row["layout"], "world": row["world"],
        "sync_save_s": statistics.median(sync_saves),
        "async_stall_first_s": async_saves[0]["stall_s"],
        "async_stall_s": statistics.median(warm),
        # where the warm stall goes (None in results written before these were recorded)
        "async_dump_s": _median_of(async_saves[1:] or async_saves, "dump_s"),
        "async_stage_s": _median_of(async_saves[1:] or async_saves, "stage_s"),
        "async_staged_wait_s": _median_of(async_saves[1:] or async_saves, "staged_wait_s"),
        "stall_ratio": statistics.median(warm) / statistics.median(sync_saves),
        "async_write_s": statistics.median([s["write_s"] for s in async_saves]),
        "async_step_excess_s": statistics.median([s["step_time_excess_s"] for s in async_saves]),
        "save_s": worst("sync_save"), "load_s": worst("sync_load"), "dcp_save_s": worst("dcp_save"), "dcp_load_s": worst("dcp_load"),
        "sync_peak_bytes": worst("sync_save", "peak_delta_bytes"), "async_peak_bytes": worst("async_cold", "peak_delta_bytes"),
        "dcp_peak_bytes": worst("dcp_save", "peak_delta_bytes"), "load_peak_bytes": worst("sync_load", "peak_delta_bytes"),
        # controlled, after training, the same state: the writer's warm stall against torch's dcp.async_save's (max rank)
        "controlled_async_stall_s": worst("async_warm", "stall_s"), "dcp_async_stall_s": worst("dcp_async_warm", "stall_s"),
        "bound_bytes": bound,
        "model_state_bytes": max(sum(r["model_state_bytes"].values()) for r in ranks),
    }


def markdown(rows: list[dict]) -> str:
    def ms(v):
        return "–" if v is None else f"{1000 * v:.0f} ms"

    def mib(v):
        return "–" if v is None else f"{v / 2**20:.0f}"

    lines = [
        "| layout | ranks | sync save (stall) | async stall, first / later | stall ratio | async write | step-time excess during write | "
        "save / load (controlled, max rank) | DCP direct save / load | async stall, controlled: parallelkit / torch's `dcp.async_save` | "
        "peak MiB during save: sync / async / DCP (bound) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        s = summarize(row)
        lines.append(
            f"| {s['layout']} | {s['world']} | {ms(s['sync_save_s'])} | {ms(s['async_stall_first_s'])} / {ms(s['async_stall_s'])} | "
            f"**{s['stall_ratio']:.2f}** | {ms(s['async_write_s'])} | {ms(s['async_step_excess_s'])} | {ms(s['save_s'])} / {ms(s['load_s'])} | "
            f"{ms(s['dcp_save_s'])} / {ms(s['dcp_load_s'])} | {ms(s.get('controlled_async_stall_s'))} / {ms(s.get('dcp_async_stall_s'))} | "
            f"{mib(s['sync_peak_bytes'])} / {mib(s['async_peak_bytes'])} / "
            f"{mib(s['dcp_peak_bytes'])} ({mib(s['bound_bytes'])}) |"
        )
    return "\n".join(lines)


def load_results() -> dict:
    return json.loads((RESULTS / "checkpoint.json").read_text())


def save_load_markdown(rows: list[dict]) -> str:
    """The short table (the README's "Changing the layout"): save and load time, and the stall of an async save."""
    def ms(v):
        return "–" if v is None else f"{1000 * v:.0f} ms"

    lines = ["| layout | ranks | save / load (max rank) | DCP direct save / load | async save's stall ÷ sync save |", "|---|---:|---:|---:|---:|"]
    for row in rows:
        s = summarize(row)
        lines.append(f"| {s['layout']} | {s['world']} | {ms(s['save_s'])} / {ms(s['load_s'])} | {ms(s['dcp_save_s'])} / {ms(s['dcp_load_s'])} | "
                     f"{s['stall_ratio']:.2f} |")
    return "\n".join(lines)


def tables(results: dict) -> dict[str, str]:
    """The Markdown tables of saved results: ``full`` and ``save_load`` (``--table``; bench/docs_tables.py)."""
    return {"full": markdown(results["rows"]), "save_load": save_load_markdown(results["rows"])}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table:
        print("\n\n".join(tables(json.loads((RESULTS / ("checkpoint_quick.json" if args.quick else "checkpoint.json")).read_text())).values()))
        return 0
    import torch

    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pk_bench_ckpt_") as tmp:
        rows = measure(args, Path(tmp))
    results = {"workload": {k: v for k, v in vars(args).items() if k != "timeout"}, "cores": os.cpu_count(), "torch": torch.__version__,
               "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "wall_s": time.perf_counter() - began,
               "rows": rows, "summary": [summarize(r) for r in rows]}
    out = RESULTS / ("checkpoint_quick.json" if args.quick else "checkpoint.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(markdown(rows))
    print(f"\n{out} ({results['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
