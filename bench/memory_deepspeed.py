"""Per-rank model-state bytes (and traffic) of ``strategy=deepspeed`` stages 0-3 against the ZeRO paper's formulas.

For N = 2 and 4 ranks it runs ``train.py strategy=deepspeed strategy.stage=K`` (``model=gpt``, the default
size, fp32 AdamW) and reads ``summary.json``:

* memory: ``model_state_bytes`` — everything DeepSpeed keeps per rank, found by walking its ZeRO optimizer
  (flat parameter buffers, fp32 master partitions, gradient partitions, reduce buckets, Adam moments),
  maximum over ranks and over the measured points of the first steps — beside the formula for fp32 Adam
  with Ψ parameters (DP 16Ψ, stage 1 8Ψ+8Ψ/N, stage 2 4Ψ+12Ψ/N, stage 3 16Ψ/N);
* traffic: bytes per step and rank counted at DeepSpeed's communication backend, beside the theory (stage 0
  and stages 1-2: 2(N−1)/N·4Ψ; stage 3: 1.5× that) and the bytes each process handed to the kernel's
  write calls (``os_bytes_written``, difference of a long and a short run; see ``bench/memory.py``).

Rows have the schema of ``bench/memory.py``, which merges ``bench/results/memory_deepspeed.json`` into its table.

    python bench/memory_deepspeed.py                 # N = 2 and 4, stages 0-3; ~10 min on 2 cores
    python bench/memory_deepspeed.py --ranks 2 --stages 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
LOOPBACK = Path("/sys/class/net/lo/statistics/tx_bytes")


def formula_bytes(stage: int, psi: int, n: int) -> float:
    """ZeRO paper, fp32 Adam: 4 bytes parameter + 4 gradient + 8 moments per parameter, sharded by stage."""
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]


def theory_sent(stage: int, psi: int, n: int) -> float:
    ring = 2 * (n - 1) / n * 4 * psi  # an all-reduce, or a reduce-scatter plus an all-gather, of 4Ψ
    return 1.5 * ring if stage == 3 else ring  # stage 3 gathers the parameters again in backward


def _loopback() -> int | None:
    try:
        return int(LOOPBACK.read_text())
    except OSError:
        return None


def run_deepspeed(stage: int, n: int, steps: int, workdir: Path, extra: list[str] | None = None) -> tuple[dict, int | None]:
    """One ``train.py`` run; returns its summary and the loopback bytes sent meanwhile."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"ds{stage}_n{n}_s{steps}_", dir=workdir))
    args = [
        "strategy=deepspeed", f"strategy.stage={stage}", "model=gpt", *(extra or []),
        f"trainer.devices={n}", f"trainer.max_steps={steps}", "trainer.limit_val_batches=0",
        "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
        "checkpoint.every_n_steps=0", f"hydra.run.dir={run_dir}",
    ]
    before = _loopback()
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True, timeout=900)
    after = _loopback()
    if proc.returncode != 0:
        raise RuntimeError(f"train.py {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    lo = after - before if before is not None and after is not None else None
    return json.loads((run_dir / "summary.json").read_text()), lo


def measure_deepspeed_memory(ranks: tuple[int, ...] = (2, 4), stages: tuple[int, ...] = (0, 1, 2, 3), steps: tuple[int, int] = (2, 7)) -> list[dict]:
    """Rows of per-rank model-state bytes and traffic, one per (stage, N), in ``bench/memory.py``'s schema."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in ranks:
            for stage in stages:
                short, lo_short = run_deepspeed(stage, n, steps[0], Path(tmp))
                long, lo_long = run_deepspeed(stage, n, steps[1], Path(tmp))
                psi = long["num_params"]
                state = long["model_state_bytes"]
                total = sum(state.values())
                formula = formula_bytes(stage, psi, n)
                counted = long["comm"]["bytes_sent_per_step"] - long["comm"]["by_kind"].get("metrics", {}).get("bytes_per_step", 0)
                wire = (lo_long - lo_short) / (steps[1] - steps[0]) / n if lo_short is not None and lo_long is not None else None
                written = (long["os_bytes_written"] - short["os_bytes_written"]) / (steps[1] - steps[0])  # per process
                rows.append({
                    "contender": f"deepspeed stage {stage}", "backend": "deepspeed", "ranks": n, "stage": stage,
                    "num_params": psi, **state, "total": total, "formula": formula, "ratio": total / formula,
                    "sent_counted": counted, "sent_theory": theory_sent(stage, psi, n), "sent_loopback": wire,
                    "sent_written": written,
                    "by_buffer": long["deepspeed"]["state_bytes_by_buffer"],
                })
                print(f"N={n} deepspeed stage {stage}: {total / 2**20:.2f} MiB (×{total / formula:.3f} of formula), "
                      f"sent {counted / 2**20:.2f} MiB/step (theory {rows[-1]['sent_theory'] / 2**20:.2f}, loopback "
                      f"{'-' if wire is None else f'{wire / 2**20:.2f}'})", flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    def mib(v: float | None) -> str:
        return "-" if v is None else f"{v / 2**20:.2f}"

    lines = [
        "| N | stage | params | grads | optimizer | total MiB | formula MiB | measured / formula | sent MiB/step (counted) | theory | loopback |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['ranks']} | {r['stage']} | {mib(r['params'])} | {mib(r['grads'])} | {mib(r['optimizer'])} | {mib(r['total'])} | "
            f"{mib(r['formula'])} | {r['ratio']:.3f} | {mib(r['sent_counted'])} | {mib(r['sent_theory'])} | {mib(r['sent_loopback'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, nargs=2, default=[2, 7], help="short and long run (loopback difference)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = measure_deepspeed_memory(tuple(args.ranks), tuple(args.stages), tuple(args.steps))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "memory_deepspeed.json").write_text(json.dumps({"rows": rows}, indent=2))
    print(markdown(rows))


if __name__ == "__main__":
    main()
