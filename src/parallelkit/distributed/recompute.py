"""Activation recomputation (checkpointing): drop activations in forward, recompute them in backward.

``full`` recomputes each block (the model's repeated blocks, or its top-level children if it has none:
:func:`~parallelkit.distributed.blocks.blocks_or_children`) from its input, so only block inputs stay alive
between forward and backward; ``selective`` recomputes only the compute-heavy children of each block
(attention, MLP), keeping the cheap ones' (norms) activations. The
module's ``forward`` is wrapped in place — names and structure are unchanged, so tensor-parallel plans,
FSDP units and pipeline stages built later still find every module. Applied before those (the order
TP → EP → recompute → FSDP/DDP → PP only constrains wrappers that rename modules; this one does not).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from parallelkit.distributed.blocks import blocks_or_children
from parallelkit.errors import ConfigError

MODES = ("none", "full", "selective")


def _is_norm(module: torch.nn.Module) -> bool:
    return "Norm" in type(module).__name__


def recompute_units(model: torch.nn.Module, mode: str) -> list[torch.nn.Module]:
    """The modules whose forward is recomputed for ``mode`` (``model.recompute_units(mode)`` if it says)."""
    if callable(getattr(model, "recompute_units", None)):
        return list(model.recompute_units(mode))
    blocks = blocks_or_children(model)
    if mode == "full":
        return blocks
    return [child for block in blocks for child in block.children() if not _is_norm(child) and any(True for _ in child.parameters())]


def _checkpointed(module: torch.nn.Module) -> None:
    original = module.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # validation: nothing to save, nothing to recompute
            return original(*args, **kwargs)
        return checkpoint(original, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def apply_recompute(model: torch.nn.Module, mode: str) -> list[torch.nn.Module]:
    """Recompute the activations of ``model``'s units in backward; returns the wrapped modules."""
    if mode not in MODES:
        raise ConfigError(f"recompute must be one of {', '.join(MODES)}. Got {mode!r}.")
    if mode == "none":
        return []
    units = recompute_units(model, mode)
    if not units:
        what = (
            "sub-modules with parameters"
            if mode == "full"
            else "blocks with sub-layers (attention, MLP) to recompute selectively; recompute=full recomputes whole blocks"
        )
        raise ConfigError(f"recompute={mode}: {type(model).__name__} has no {what} (or define recompute_units(mode) on it).")
    for unit in units:
        _checkpointed(unit)
    return units
