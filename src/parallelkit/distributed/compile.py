"""Compute op fusion: ``torch.compile`` per block (regional compilation).

Compiling each transformer block rather than the whole model keeps compile time small: the blocks are
identical, so the first one's graph is reused by the others, and the code between blocks (embedding,
head, the strategy's hooks) stays eager. Compilation is lazy — it happens at the first forward, after the
strategy has applied tensor parallelism or sharding — so the compiled graphs include those. On CPU the
inductor backend generates C++ and needs a compiler on the machine.
"""

from __future__ import annotations

import shutil

import torch

from parallelkit.distributed.blocks import blocks_or_children
from parallelkit.errors import ConfigError


def apply_compile(model: torch.nn.Module, device_type: str = "cpu") -> list[torch.nn.Module]:
    """``torch.compile`` every block of ``model`` in place; returns the compiled blocks."""
    if device_type == "cpu" and not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
        raise ConfigError("compile=true on CPU needs a C++ compiler (inductor generates C++): install g++ or set compile=false.")
    blocks = blocks_or_children(model)
    if not blocks:
        raise ConfigError("compile=true compiles per block, but the model has no sub-modules with parameters to compile.")
    for block in blocks:
        block.compile()
    return blocks
