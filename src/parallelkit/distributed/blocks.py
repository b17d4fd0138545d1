"""Which sub-modules of a model are its *units*: what ZeRO-3 shards, recomputation checkpoints and
compilation compiles one at a time.

Techniques that work block by block need to find the blocks of a model they have never seen. The policies,
shared by :mod:`~parallelkit.distributed.fsdp`, :mod:`~parallelkit.distributed.recompute` and
:mod:`~parallelkit.distributed.compile`:

- **repeated blocks** (the default, as FSDP's wrap policies find them): ``model.sharding_units()`` if the
  model names its units, else every child of an ``nn.ModuleList`` / ``nn.ModuleDict`` that is not inside another
  one (a transformer's layers, not the experts of a layer's MoE block);
- **by class** (``strategy.shard_modules=[Block, ...]``): every module of a listed class or a subclass of
  one (its name, or ``module.QualifiedName``) — FSDP's ``ModuleWrapPolicy``;
- **by size** (``strategy.shard_min_params=N``): bottom-up, every module holding at least ``N`` parameters not
  already in a smaller unit — FSDP's ``size_based_auto_wrap_policy``. Containers (``ModuleList``,
  ``ModuleDict``) are never units: they have no ``forward`` around which to gather.

Units are returned children first (post-order), the order ``fully_shard`` must be applied in when units nest.
The model itself is never a unit here: the caller decides what happens at the root.
"""

from __future__ import annotations

import torch

from parallelkit.errors import ConfigError


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model.sharding_units()`` if defined, else the children of every ``ModuleList``/``ModuleDict`` that no other
    such child contains (a transformer's layers, not the experts inside a layer's MoE block)."""
    if callable(getattr(model, "sharding_units", None)):
        return list(model.sharding_units())
    units: list[torch.nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():  # pre-order: an outer block comes before what it contains
        if id(module) in inside:
            continue
        if isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            for child in module.children():
                units.append(child)
                inside.update(id(m) for m in child.modules())
    return units


def blocks_or_children(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks; for a model without any, its top-level children that hold parameters (each then
    counts as a block: recomputing or compiling the model piece by piece still works)."""
    return repeated_blocks(model) or [child for child in model.children() if any(True for _ in child.parameters())]


def _class_names(module: torch.nn.Module) -> set[str]:
    """The names a policy may use for ``module``'s class: of its class or any base (as FSDP's
    ``ModuleWrapPolicy`` matches with ``isinstance``), short or ``module.QualifiedName``."""
    names: set[str] = set()
    for cls in type(module).__mro__:
        if cls in (torch.nn.Module, object):
            break
        names |= {cls.__name__, f"{cls.__module__}.{cls.__qualname__}"}
    return names


def modules_by_class(model: torch.nn.Module, names: list[str], setting: str = "strategy.shard_modules") -> list[torch.nn.Module]:
    """Every module below ``model`` whose class is named in ``names`` (post-order).

    Raises :class:`ConfigError` naming the classes the model does have if a name matches nothing.
    """
    wanted = set(names)
    containers = wanted & {"ModuleList", "ModuleDict", "torch.nn.ModuleList", "torch.nn.ModuleDict",
                           "torch.nn.modules.container.ModuleList", "torch.nn.modules.container.ModuleDict"}
    if containers:
        raise ConfigError(
            f"{setting} names {sorted(containers)}, but a ModuleList has no forward: a unit gathers its parameters when "
            "it runs. Name the class of the blocks it holds (their default: every child of a ModuleList is a unit)."
        )
    found: list[torch.nn.Module] = []
    matched: set[str] = set()
    for module in list(model.modules())[1:]:
        hits = _class_names(module) & wanted
        if hits:
            found.append(module)
            matched |= hits
    missing = sorted(wanted - matched)
    if missing:
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(
            f"{setting} names {missing}, but no module of {type(model).__name__} has that class. Its module classes are: "
            f"{', '.join(classes)}. Name one of them (or its module.ClassName path)."
        )
    return list(reversed(found))


def modules_by_size(model: torch.nn.Module, min_params: int) -> list[torch.nn.Module]:
    """Bottom-up: every module below ``model`` whose parameters not yet in a unit number at least ``min_params``."""
    units: list[torch.nn.Module] = []
    claimed: set[int] = set()

    def visit(module: torch.nn.Module, is_root: bool) -> None:
        for child in module.children():
            visit(child, False)
        if is_root or isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):  # no forward: never a unit
            return
        free = [p for p in module.parameters() if id(p) not in claimed]
        if sum(p.numel() for p in free) >= min_params:
            units.append(module)
            claimed.update(id(p) for p in free)

    visit(model, True)
    return units


def select_units(model: torch.nn.Module, *, shard_modules: list[str] | None = None, min_params: int | None = None) -> list[torch.nn.Module]:
    """The units of ``model`` by the policy the arguments choose (see the module docstring)."""
    if shard_modules:
        return modules_by_class(model, list(shard_modules))
    if min_params is not None:
        return modules_by_size(model, min_params)
    return repeated_blocks(model)
