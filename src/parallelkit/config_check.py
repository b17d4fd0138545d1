"""Every key of the composed config is read by some code, or the run is refused: ``+optim.lr=-1`` (Hydra's own
suggestion once ``optim.lr=-1`` is rejected) must not train at the default learning rate with exit code 0.

Who reads what, found generically (so that keys other modules add, ``strategy.cp`` or ``callbacks.diloco.*``,
need no list here):

- a node with ``_target_`` is read by its constructor: its keys are the constructor's arguments (a
  ``**kwargs`` constructor hands them on, so its base classes' arguments count too; one that hands them
  nowhere in sight takes anything);
- ``trainer`` is read by ``lightning.pytorch.Trainer`` (parallelkit passes it on);
- any other node is read key by key by parallelkit's code, which reads the keys the config files define:
  its valid keys are those of the same config composed without the command line's key additions
  (``+a.b=...``). A new node with its own ``_target_`` (``+callbacks.mine._target_=...``) is a plugin, valid
  wherever it goes.

A key no code reads is one paragraph naming it and the nearest valid key, with the override that works.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from typing import Any

from omegaconf import DictConfig

from parallelkit.errors import ConfigError

_HYDRA_ARGS = ("_target_", "_partial_", "_convert_", "_recursive_", "_args_")
# Plain nodes that code hands on whole, as keyword arguments (run.py: pl.Trainer(**trainer)).
_HANDED_ON = {"trainer": "lightning.pytorch.Trainer"}
# ...less the Trainer arguments parallelkit sets itself (strategy=, logger=, callbacks=: their own groups).
_SET_BY_PARALLELKIT = {"strategy", "logger", "callbacks", "plugins", "default_root_dir", "use_distributed_sampler"}


def _import(dotted: str) -> Any:
    module, _, attr = dotted.rpartition(".")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def accepted_arguments(target: Any) -> list[str] | None:
    """The keyword arguments ``target`` (a class or function, or its dotted name) reads, in order; None: any."""
    try:
        obj = _import(target) if isinstance(target, str) else target
    except Exception:  # noqa: BLE001 - a target that does not import is reported when it is built
        return None
    if not inspect.isclass(obj):
        try:
            params = inspect.signature(obj).parameters.values()
        except (TypeError, ValueError):
            return None
        names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        return None if any(p.kind == p.VAR_KEYWORD for p in params) else names
    ordered: dict[str, None] = {}  # an ordered set: the message lists arguments as the constructors do
    for cls in obj.__mro__:  # **kwargs hands arguments to the next __init__ up the hierarchy
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        if cls is object:
            return None  # handed on to object: nothing in sight says what is read
        try:
            params = list(inspect.signature(init).parameters.values())[1:]
        except (TypeError, ValueError):
            return None
        ordered.update(dict.fromkeys(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)))
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            return list(ordered)
    return None


def _is_plugin(node: Any) -> bool:
    return isinstance(node, DictConfig) and isinstance(node.get("_target_"), str)


def _holds_plugins(node: Any) -> bool:
    """A plugin, or a node of plugins only (``callbacks`` made by ``+callbacks.mine._target_=...`` alone)."""
    return _is_plugin(node) or (isinstance(node, DictConfig) and len(node) > 0 and all(_is_plugin(node._get_node(k)) for k in node))


def unread_keys(cfg: DictConfig, schema: DictConfig | None) -> list[tuple[str, list[str]]]:
    """``(dotted key, the valid keys beside it)`` for each key of ``cfg`` that no code reads."""
    found: list[tuple[str, list[str]]] = []

    def walk(node: DictConfig, shape: Any, path: str) -> None:
        if _is_plugin(node):
            valid = accepted_arguments(node._target_)
        else:
            valid = list(shape.keys()) if isinstance(shape, DictConfig) and len(shape) else None  # {}: free-form
            if valid is not None and path in _HANDED_ON:
                valid += [a for a in accepted_arguments(_HANDED_ON[path]) or [] if a not in _SET_BY_PARALLELKIT and a not in valid]
        for key in node.keys():
            if key in _HYDRA_ARGS:
                continue
            child = node._get_node(key)  # unresolved: a leaf's interpolation is not this check's business
            where = f"{path}.{key}" if path else str(key)
            if valid is not None and key not in valid and not _holds_plugins(child):
                found.append((where, list(valid)))
                continue
            if isinstance(child, DictConfig):
                sub_shape = shape.get(key) if isinstance(shape, DictConfig) and key in shape else None
                if _holds_plugins(child) or (not _is_plugin(node) and sub_shape is not None):
                    walk(child, sub_shape, where)

    walk(cfg, schema, "")
    return found


def nearest(key: str, valid_paths: list[str]) -> str | None:
    """The valid key closest to ``key``: the same name elsewhere (``optim.lr`` → ``optim.optimizer.lr``), else the
    sibling, else any key, whose name is closest (``checkpoint.every_n_step`` → ``checkpoint.every_n_steps``)."""
    parent, _, last = key.rpartition(".")
    same_name = [p for p in valid_paths if p.rpartition(".")[2] == last]
    if same_name:
        return max(same_name, key=lambda p: difflib.SequenceMatcher(None, key, p).ratio())
    siblings = {p.rpartition(".")[2]: p for p in valid_paths if p.rpartition(".")[0] == parent}
    close = difflib.get_close_matches(last, list(siblings), n=1, cutoff=0.6)
    if close:
        return siblings[close[0]]
    anywhere = {p.rpartition(".")[2]: p for p in valid_paths}
    close = difflib.get_close_matches(last, list(anywhere), n=1, cutoff=0.6) or difflib.get_close_matches(last, list(siblings), n=1, cutoff=0.0)
    return (anywhere.get(close[0]) if close[0] in anywhere and close[0] not in siblings else siblings.get(close[0])) if close else None


def valid_paths(cfg: DictConfig, schema: DictConfig | None) -> list[str]:
    """Every key of ``cfg`` that code reads, dotted, plus the arguments its plugins take but the config leaves out."""
    out: list[str] = []
    unread = {k for k, _ in unread_keys(cfg, schema)}

    def walk(node: DictConfig, path: str) -> None:
        keys = set(node.keys()) - set(_HYDRA_ARGS)
        if _is_plugin(node):
            keys |= set(accepted_arguments(node._target_) or [])
        for key in sorted(keys):
            where = f"{path}.{key}" if path else str(key)
            if where in unread:
                continue
            out.append(where)
            child = node._get_node(key) if key in node else None
            if isinstance(child, DictConfig):
                walk(child, where)

    walk(cfg, "")
    return out


def check_every_key_is_read(cfg: DictConfig, schema: DictConfig | None, overrides: list[str]) -> None:
    """Raise one :class:`ConfigError` naming each key no code reads, the nearest valid one and the override that works."""
    unread = unread_keys(cfg, schema)
    if not unread:
        return
    paths = valid_paths(cfg, schema)
    lines = []
    for key, beside in unread:
        given = next((o for o in overrides if o.lstrip("+").split("=", 1)[0] == key), None)
        parent = key.rsplit(".", 1)[0] if "." in key else "the config"
        line = f"{given or key} sets {key}, which no code reads: {parent} has no key {key.rsplit('.', 1)[-1]}"
        if beside:
            line += f" (its keys: {', '.join(beside[:12])}{', ...' if len(beside) > 12 else ''})"
        best = nearest(key, paths)
        if best:
            value = given.split("=", 1)[1] if given and "=" in given else "..."
            line += f". The nearest valid key is {best}: {best}={value}"
        lines.append(line + ".")
    raise ConfigError(" ".join(lines) + " (A key added with + must be one that some code reads; Hydra's + only adds keys.)")


def schema_for(overrides_task: list[str], overrides_hydra: list[str], config_name: str, groups: Any = ()) -> DictConfig | None:
    """The same config without the command line's key additions (``+a.b=v``, ``++a.b=v``): what the config files
    define for this run's choices. None when it cannot be composed (then only the plugins' keys are checked)."""
    from hydra import compose

    def adds_a_key(override: str) -> bool:  # +a.b=v, ++seedd=3; not +experiment=smoke (a group: ``groups``)
        key = override.lstrip("+").split("=", 1)[0]
        return override.startswith("+") and key not in groups and key.split("/")[0] not in groups

    kept = [o for o in overrides_task if not adds_a_key(o)]
    kept += [o for o in overrides_hydra if o.startswith("hydra.searchpath")]
    try:
        return compose(config_name, overrides=kept)
    except Exception:  # noqa: BLE001 - outside a Hydra app (a user's script) or a search path compose cannot see
        return None


def check_run_config(cfg: DictConfig) -> None:
    """:func:`check_every_key_is_read` for the job Hydra is running (no-op outside Hydra: a user's own script)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    hc = HydraConfig.get()
    schema = schema_for(list(hc.overrides.task), list(hc.overrides.hydra), hc.job.config_name or "train", set(hc.runtime.choices))
    check_every_key_is_read(cfg, schema, list(hc.overrides.task))
