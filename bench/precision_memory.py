"""Mixed precision, recomputation and compilation on ``model=gpt``: loss, saved activations, step time.

1. Final loss after ``--steps`` steps of ``train.py`` on 2 ranks (ddp) in fp32, bf16 and fp16 (dynamic loss
   scaling): the ratio to fp32 (target: within 2 %).
2. Saved activation bytes per training step with ``recompute=none|selective|full``, measured with autograd's
   saved-tensor hooks (deterministic), and the fwd+bwd time ratio to no recompute (target ≤ 1.4× for
   full), in one process, the contenders interleaved so machine noise hits them alike.
3. Eager vs ``compile=true`` (per-block ``torch.compile``) fwd+bwd time in one process, after warm-up.

    python bench/precision_memory.py      # writes bench/results/precision_memory.json, prints the tables
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO / "src"))

from parallelkit.distributed.compile import apply_compile  # noqa: E402
from parallelkit.distributed.recompute import apply_recompute  # noqa: E402
from parallelkit.models.gpt.model import GPT  # noqa: E402


def final_losses(steps: int) -> dict[str, float]:
    variants = {"fp32": [], "bf16": ["callbacks=[amp]", "callbacks.amp.dtype=bf16"], "fp16": ["callbacks=[amp]", "callbacks.amp.dtype=fp16"]}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in variants.items():
            run_dir = Path(tmp) / name
            args = [
                "strategy=ddp",
                "trainer.devices=2",
                f"trainer.max_steps={steps}",
                "trainer.enable_progress_bar=false",
                "checkpoint.every_n_steps=0",
                f"hydra.run.dir={run_dir}",
                *extra,
            ]
            proc = subprocess.run([sys.executable, str(REPO / "train.py"), *args], capture_output=True, text=True, timeout=3600)
            if proc.returncode:
                raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
            summary = json.loads((run_dir / "summary.json").read_text())
            out[name] = {"final_loss": summary["final_loss"], "val_loss": summary["val_loss"], **({"amp": summary["amp"]} if "amp" in summary else {})}
            print(f"{name}: final loss {summary['final_loss']:.4f}, val {summary['val_loss']}", flush=True)
    return out


def _model(mode: str = "none", compiled: bool = False) -> GPT:
    torch.manual_seed(0)
    model = GPT(vocab_size=128, block_size=64)  # conf/model/gpt.yaml's size, the chars vocabulary
    apply_recompute(model, mode)
    if compiled:
        apply_compile(model)
    return model


def _batch(batch: int) -> torch.Tensor:
    return torch.randint(0, 128, (batch, 64), generator=torch.Generator().manual_seed(1))


def saved_bytes(model: GPT, idx: torch.Tensor) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model.loss(model(idx), torch.roll(idx, -1, 1))
    loss.backward()
    return total


def step_time(model: GPT, idx: torch.Tensor) -> float:
    start = time.perf_counter()
    model.loss(model(idx), torch.roll(idx, -1, 1)).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def interleaved_times(models: dict[str, GPT], idx: torch.Tensor, rounds: int) -> dict[str, float]:
    for model in models.values():  # warm-up (and compilation)
        for _ in range(3):
            step_time(model, idx)
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(rounds):
        for name, model in models.items():
            times[name].append(step_time(model, idx))
    return {k: statistics.median(v) for k, v in times.items()}


PRECISION_LABELS = {"fp32": "fp32", "bf16": "`amp` bf16", "fp16": "`amp` fp16 (dynamic loss scaling)"}


def load_results() -> dict:
    return json.loads((RESULTS / "precision_memory.json").read_text())


def tables(result: dict) -> dict[str, str]:
    """The Markdown tables of saved results: ``precision`` (when trained) and ``recompute`` (``--table``;
    bench/docs_tables.py)."""
    out = {}
    if "precision" in result:
        lines = ["| precision | final train loss | vs fp32 | val loss |", "|---|---:|---:|---:|"]
        for name, r in result["precision"].items():
            lines.append(f"| {PRECISION_LABELS.get(name, name)} | {r['final_loss']:.4f} | {r['ratio_to_fp32']:.3f} | {r['val_loss']:.4f} |")
        out["precision"] = "\n".join(lines)
    lines = ["| recompute | saved activations per step | vs none | fwd+bwd time vs none |", "|---|---:|---:|---:|"]
    for mode, r in result["recompute"].items():
        lines.append(f"| {mode} | {r['saved_bytes'] / 2**20:.2f} MiB | {r['saved_ratio']:.2f} | {r['time_ratio']:.2f} |")
    out["recompute"] = "\n".join(lines)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps for the loss comparison")
    parser.add_argument("--batch", type=int, default=16, help="micro-batch of the in-process measurements")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--table", action="store_true", help="print the table(s) of the saved results and exit (runs nothing)")
    args = parser.parse_args(argv)
    if args.table:
        print("\n\n".join(tables(load_results()).values()))
        return
    torch.set_num_threads(1)
    idx = _batch(args.batch)
    result: dict = {"config": {k: v for k, v in vars(args).items() if k != "table"}}

    recompute = {mode: _model(mode) for mode in ("none", "selective", "full")}
    result["recompute"] = {mode: {"saved_bytes": saved_bytes(m, idx)} for mode, m in recompute.items()}
    times = interleaved_times(recompute, idx, args.rounds)
    for mode in recompute:
        result["recompute"][mode].update(
            step_s=times[mode],
            time_ratio=times[mode] / times["none"],
            saved_ratio=result["recompute"][mode]["saved_bytes"] / result["recompute"]["none"]["saved_bytes"],
        )

    compile_start = time.perf_counter()
    compiled = _model(compiled=True)
    step_time(compiled, idx)
    compile_s = time.perf_counter() - compile_start
    times = interleaved_times({"eager": _model(), "compiled": compiled}, idx, args.rounds)
    result["compile"] = {
        "eager_step_s": times["eager"],
        "compiled_step_s": times["compiled"],
        "speedup": times["eager"] / times["compiled"],
        "first_step_with_compile_s": compile_s,
    }

    if not args.skip_training:
        losses = final_losses(args.steps)
        for name in losses:
            losses[name]["ratio_to_fp32"] = losses[name]["final_loss"] / losses["fp32"]["final_loss"]
        result["precision"] = losses

    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "precision_memory.json").write_text(json.dumps(result, indent=2))
    print("\n" + "\n\n".join(tables(result).values()))
    c = result["compile"]
    print(
        f"\n| eager | compiled | speed-up | first step incl. compile |\n|---|---|---|---|\n| {c['eager_step_s'] * 1e3:.1f} ms "
        f"| {c['compiled_step_s'] * 1e3:.1f} ms | {c['speedup']:.2f}× | {c['first_step_with_compile_s']:.0f} s |"
    )


if __name__ == "__main__":
    main()
