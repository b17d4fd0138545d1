"""The workload arguments every contender of ``bench/overhead.py`` takes, defined once (argparse only:
``ddp_loop.py`` must start its second rank before anything heavy is imported)."""

from __future__ import annotations

import argparse


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Steps, seed, GPT size and batch, and the warm-up + cosine schedule of conf/optim/adamw.yaml."""
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--decay-steps", type=int, default=None, help="default: --steps (conf: ${trainer.max_steps})")
