"""Tensor parallel traffic and memory, measured by ``python train.py strategy=tp``, against the formulas.

One GPT, several layouts, each one a ``train.py`` job: ``strategy=single`` (the reference), then tp = 2 and
tp = 4, with and without sequence parallel, and tp = 2 × dp = 2. From each ``summary.json`` it takes the
tensor-parallel collectives that ran inside transformer blocks (``comm.by_kind`` ``tp_block.*``, counted
by parallelkit from what DTensor issued, forward and backward), divided by the number of layers, and
compares the bytes with Megatron-LM's 8·b·s·h·(t−1)/t elements per layer per step (b = micro-batch
per tp group, s = sequence, h = hidden size). The bytes are what gloo writes (docs/traffic.md): its message
headers on top, and with sequence parallel 1.5× the formula, as its reduce-scatter is an all-reduce. It also shows the whole ``comm.bytes_sent_per_step``
(blocks + vocabulary-parallel embedding, output layer and loss + data parallel), and the parameter bytes
per rank against "replicated + sharded / T" (sharded = the layers the plan splits), and checks that the
losses equal ``strategy=single``'s.

    python bench/tensor_parallel.py              # 10 steps per job, ~10 min on 2 shared cores
    python bench/tensor_parallel.py --quick      # tp = 2 only, 5 steps

Writes ``bench/results/tensor_parallel.json`` (``tensor_parallel_quick.json`` with ``--quick``) and prints a
Markdown table of docs/benchmarks.md (``--table``: of the saved results; ``python bench/docs_tables.py`` writes it into the page).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (label, overrides, processes)
LAYOUTS = [
    ("tp=2", ["strategy.tp=2"], 2),
    ("tp=2, sequence parallel", ["strategy.tp=2", "strategy.sequence_parallel=true"], 2),
    ("tp=4", ["strategy.tp=4"], 4),
    ("tp=4, sequence parallel", ["strategy.tp=4", "strategy.sequence_parallel=true"], 4),
    ("tp=2 × dp=2", ["strategy.tp=2"], 4),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="tp = 2 only, 5 steps")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--table", action="store_true", help="print the table(s) of the saved results and exit (runs nothing)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps = 5
    return args


def train(args: argparse.Namespace, run_dir: Path, overrides: list[str], devices: int) -> dict:
    command = [
        sys.executable, str(ROOT / "train.py"), "model=gpt", "data=chars",
        f"model.n_layer={args.n_layer}", f"model.n_head={args.n_head}", f"model.n_embd={args.n_embd}",
        f"data.seq_len={args.seq_len}", f"data.global_batch_size={args.global_batch_size}",
        f"trainer.max_steps={args.steps}", "trainer.limit_val_batches=0", f"trainer.log_every_n_steps={args.steps}",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", f"trainer.devices={devices}",
        *overrides, f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def split_parameter_bytes(args: argparse.Namespace, vocab_size: int) -> tuple[int, int]:
    """(replicated, sharded) fp32 parameter bytes of the model under its tensor parallel plan."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from parallelkit.distributed.tensor_parallel import _expand
    from parallelkit.models.gpt import GPT
    from parallelkit.models.gpt.parallelize import tensor_parallel_plan

    model = GPT(vocab_size=vocab_size, block_size=args.seq_len, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    modules = dict(model.named_modules())
    sharded = set()
    for name, style in _expand(model, tensor_parallel_plan(model, 1).layout).items():
        if isinstance(style, ColwiseParallel):  # weight and bias split by output features
            sharded |= {f"{name}.{p}" for p, _ in modules[name].named_parameters()}
        elif isinstance(style, RowwiseParallel):  # weight split by input features / vocabulary; bias whole
            sharded.add(f"{name}.weight")
    total = {n: p.numel() * 4 for n, p in model.named_parameters()}
    split = sum(v for n, v in total.items() if n in sharded)
    return sum(total.values()) - split, split


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.table:
        print(markdown(json.loads((ROOT / "bench" / "results" / ("tensor_parallel_quick.json" if args.quick else "tensor_parallel.json")).read_text())))
        return
    layouts = LAYOUTS[:1] if args.quick else LAYOUTS
    results: dict = {"workload": {k: v for k, v in vars(args).items() if k not in ("timeout", "table")}, "layouts": []}
    with tempfile.TemporaryDirectory(prefix="pk_bench_tp_") as tmp:
        single = train(args, Path(tmp) / "single", ["strategy=single"], 1)
        for index, (label, overrides, devices) in enumerate(layouts):
            summary = train(args, Path(tmp) / f"layout{index}", ["strategy=tp", *overrides], devices)
            dims = summary["dims"]
            t, micro_batch = dims["tp"], args.global_batch_size // dims["dp"]
            blocks = {k.split(".", 1)[1]: v for k, v in summary["comm"]["by_kind"].items() if k.startswith("tp_block.")}
            block_bytes = sum(v["bytes_per_step"] for v in blocks.values()) / args.n_layer
            formula = 8 * micro_batch * args.seq_len * args.n_embd * (t - 1) / t * 4
            loss_diff = max(abs(a - b) / abs(b) for a, b in zip(summary["train_loss"], single["train_loss"]))
            results["layouts"].append({
                "layout": label,
                "dims": dims,
                "collectives_per_layer_per_step": {k: v["collectives_per_step"] / args.n_layer for k, v in blocks.items()},
                "block_bytes_per_layer_per_step": block_bytes,
                "megatron_bytes_per_layer_per_step": formula,
                "block_bytes_over_formula": block_bytes / formula,
                "bytes_sent_per_step": summary["comm"]["bytes_sent_per_step"],
                "bytes_sent_over_layers_x_formula": summary["comm"]["bytes_sent_per_step"] / (args.n_layer * formula),
                "by_kind": summary["comm"]["by_kind"],
                "params_bytes_per_rank": summary["model_state_bytes"]["params"],
                "max_rel_loss_diff_vs_single": loss_diff,
                "step_time_s_median": summary["step_time_s_median"],
            })
    vocab = (single["num_params"] - _params_without_vocab(args)) // (2 * args.n_embd)
    replicated, sharded = split_parameter_bytes(args, vocab)
    results["single"] = {"params_bytes": single["model_state_bytes"]["params"], "step_time_s_median": single["step_time_s_median"], "vocab_size": vocab}
    for row in results["layouts"]:
        row["expected_params_bytes_per_rank"] = replicated + sharded / row["dims"]["tp"]
    out = ROOT / "bench" / "results" / ("tensor_parallel_quick.json" if args.quick else "tensor_parallel.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(markdown(results))
    print(f"\nwrote {out}")


def _params_without_vocab(args: argparse.Namespace) -> int:
    """Parameters that do not scale with the vocabulary (the embedding and output layer are V × h each)."""
    from parallelkit.models.gpt import GPT

    model = GPT(vocab_size=1, block_size=args.seq_len, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    return sum(p.numel() for p in model.parameters()) - 2 * args.n_embd


def load_results() -> dict:
    return json.loads((ROOT / "bench" / "results" / "tensor_parallel.json").read_text())


def tables(results: dict) -> dict[str, str]:
    """The Markdown table of saved results, without its caption (``--table``; bench/docs_tables.py)."""
    return {"": "\n".join(line for line in markdown(results).splitlines() if line.startswith("|"))}


def markdown(results: dict) -> str:
    w = results["workload"]
    lines = [
        f"GPT n_layer={w['n_layer']} n_head={w['n_head']} n_embd={w['n_embd']}, seq_len={w['seq_len']}, global batch "
        f"{w['global_batch_size']}, vocab {results['single']['vocab_size']}, {w['steps']} steps, fp32; bytes are what "
        "each rank writes (gloo's algorithms and message headers), per step.",
        "",
        "| layout | collectives per layer per step (measured) | block bytes per layer | Megatron 8·b·s·h·(t−1)/t | ratio "
        "| all TP+DP bytes per step / (layers × formula) | params per rank | replicated + sharded / T | loss vs single |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["layouts"]:
        calls = ", ".join(f"{v:g} {k.replace('_', '-')}" for k, v in sorted(row["collectives_per_layer_per_step"].items()))
        lines.append(
            f"| {row['layout']} | {calls} | {row['block_bytes_per_layer_per_step'] / 1024:,.1f} KiB "
            f"| {row['megatron_bytes_per_layer_per_step'] / 1024:,.1f} KiB | **{row['block_bytes_over_formula']:.3f}** "
            f"| {row['bytes_sent_over_layers_x_formula']:.3f} | {row['params_bytes_per_rank'] / 1024:,.0f} KiB "
            f"| {row['expected_params_bytes_per_rank'] / 1024:,.0f} KiB | {row['max_rel_loss_diff_vs_single']:.1e} |"
        )
    lines.append(f"\n`strategy=single`: {results['single']['params_bytes'] / 1024:,.0f} KiB of parameters.")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
