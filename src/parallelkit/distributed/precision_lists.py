"""Per-module precision overrides on top of autocast's op lists (PaddlePaddle's custom white/black lists).

Autocast decides per op: matmuls in half precision, softmax/norms/losses in fp32. Users sometimes need a
whole module pinned: a numerically touchy block kept in fp32 (black list), or a module forced into half
precision even where autocast would promote it (white list). Both are applied by wrapping the module's
``forward`` (names and structure unchanged, so tensor-parallel plans and FSDP units still find it):

* black list: autocast is disabled inside, floating inputs are cast to fp32 — the module computes in fp32;
* white list: autocast is disabled inside, floating inputs *and parameters* are cast to the half dtype
  (parameters through ``functional_call``, so gradients still reach the fp32 master weights) — every op
  of the module computes in half precision, even those autocast keeps in fp32.

An entry matches a module by qualified name (``layers.0.mlp``), class name (``LayerNorm``) or full class
path (``torch.nn.LayerNorm``).
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

import torch
from torch.func import functional_call

from parallelkit.errors import ConfigError


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


def _matches(name: str, module: torch.nn.Module, entry: str) -> bool:
    cls = type(module)
    return entry in (name, cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def matching_modules(model: torch.nn.Module, entries: Iterable[str]) -> dict[str, list[str]]:
    """``entry → [qualified names]``; an entry that matches nothing is an error (a typo must not pass)."""
    found: dict[str, list[str]] = {}
    for entry in entries:
        names = [n for n, m in model.named_modules() if n and _matches(n, m, entry)]
        if not names:
            raise ConfigError(
                f"callbacks.amp list entry {entry!r} matches no module of the model. Use a qualified module name "
                f"(e.g. {next((n for n, _ in model.named_modules() if n), '')!r}), a class name (e.g. 'LayerNorm') or a class path."
            )
        found[entry] = names
    return found


def _pin(module: torch.nn.Module, device_type: str, dtype: torch.dtype, cast_params: bool) -> None:
    original = module.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, enabled=False):
            args, kwargs = _cast(args, dtype), _cast(kwargs, dtype)
            if not cast_params:
                return original(*args, **kwargs)
            params = {n: p.to(dtype) for n, p in module.named_parameters()}
            # functional_call runs module.forward with substituted tensors; call the original one.
            module.forward = original
            try:
                return functional_call(module, params, args, kwargs)
            finally:
                module.forward = forward

    module.forward = forward


def apply_precision_lists(
    model: torch.nn.Module, device_type: str, half: torch.dtype, white: Iterable[str] = (), black: Iterable[str] = ()
) -> dict[str, list[str]]:
    """Pin the listed modules of ``model`` (see the module docstring); returns what each entry matched."""
    white, black = list(white), list(black)
    both = set(white) & set(black)
    if both:
        raise ConfigError(f"callbacks.amp: {sorted(both)} are in both custom_white_list and custom_black_list; keep each in one.")
    white_found = matching_modules(model, white)
    black_found = matching_modules(model, black)
    modules = dict(model.named_modules())
    for names in white_found.values():
        for name in names:
            _pin(modules[name], device_type, half, cast_params=True)
    for names in black_found.values():
        for name in names:
            _pin(modules[name], device_type, torch.float32, cast_params=False)
    return {"white": sorted({n for v in white_found.values() for n in v}), "black": sorted({n for v in black_found.values() for n in v})}
