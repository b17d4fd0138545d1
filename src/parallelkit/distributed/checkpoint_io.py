"""Read any parallelkit checkpoint in the unsharded, per-parameter layout, whatever wrote it.

Strategies that shard on a mesh save with ``torch.distributed.checkpoint`` (a directory: one file per
rank plus Lightning's ``meta.pt``); their optimizer state is keyed by parameter name ("FQN"), the layout
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` produces. Single-process and DDP runs
save one file whose optimizer state is keyed by parameter index. These helpers load either into full
tensors in this process and convert between the two optimizer layouts, so a checkpoint written at N ranks
resumes at M ranks or in one process.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

META_FILE = "meta.pt"  # Lightning's ModelParallelStrategy writes the non-tensor state here


def is_sharded_checkpoint(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / META_FILE).is_file()


def load_unsharded(path: str | Path) -> dict[str, Any]:
    """The whole checkpoint in this process: ``state_dict``, the optimizer states, loops, callbacks...

    For a sharded directory (and a DeepSpeed one) the optimizer states come back as ``optimizer_0, optimizer_1, ...``
    in the FQN layout; for a file, as Lightning's ``optimizer_states`` list in the index layout.
    """
    from parallelkit.distributed.deepspeed_checkpoint import is_deepspeed_checkpoint, load_deepspeed_unsharded

    path = Path(path)
    if is_deepspeed_checkpoint(path):
        return load_deepspeed_unsharded(path)  # optimizer states as a sharded directory's: FQN layout
    if not is_sharded_checkpoint(path):
        return torch.load(path, map_location="cpu", weights_only=False)
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        tensors = _load_state_dict_from_keys(checkpoint_id=str(path))
    meta = torch.load(path / META_FILE, map_location="cpu", weights_only=False)
    return {**meta, **tensors}


def fqn_optimizer_states(checkpoint: dict[str, Any], names: list[str]) -> list[dict[str, Any]]:
    """The optimizer states of ``checkpoint`` in the FQN layout (``names``: parameter names, in index order)."""
    if "optimizer_states" in checkpoint:
        return [index_to_fqn(state, names) for state in checkpoint["optimizer_states"]]
    keys = sorted((k for k in checkpoint if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    return [merge_rank_keyed_groups(checkpoint[k], names) for k in keys]


#: the prefix of a checkpoint's per-rank optimizer groups (pipeline stages, expert shards: MeshStrategy.param_groups_key).
PARAM_GROUPS = "param_groups"


def merge_rank_keyed_groups(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """One FQN-layout optimizer state whose ``param_groups`` list every parameter, from a checkpoint whose ranks
    saved their groups under their own keys (``param_groups_stages_0``, ``param_groups_stages_1``, ...: ranks that hold
    different parameters). Group ``i`` keeps the hyperparameters of the first key that has it (every rank's group
    ``i`` is built by the same ``configure_optimizers``) and the parameters of all, in model order (``names``)."""
    keyed = sorted(k for k in state if k.startswith(PARAM_GROUPS + "_"))
    if PARAM_GROUPS in state or not keyed:
        return state
    order = {name: i for i, name in enumerate(names)}
    groups: list[dict[str, Any]] = []
    for key in keyed:
        for i, group in enumerate(state[key]):
            if i == len(groups):
                groups.append({**group, "params": []})
            groups[i]["params"] += [p for p in group["params"] if p not in groups[i]["params"]]
    for group in groups:
        group["params"].sort(key=lambda p: order.get(p, len(order)))
    return {"state": state.get("state", {}), PARAM_GROUPS: groups}


def index_to_fqn(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {names[i]: v for i, v in state["state"].items()}, "param_groups": groups}


def fqn_to_index(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    index = {name: i for i, name in enumerate(names)}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]
    return {"state": {index[n]: v for n, v in state["state"].items() if n in index}, "param_groups": groups}


def load_into_single_process(path: str | Path, module: torch.nn.Module) -> dict[str, Any]:
    """A Lightning checkpoint dict (index layout) for a one-process run, from a file or a sharded directory."""
    checkpoint = load_unsharded(path)
    if "optimizer_states" in checkpoint:
        return checkpoint
    names = [name for name, _ in module.named_parameters()]
    states = fqn_optimizer_states(checkpoint, names)
    for key in [k for k in checkpoint if k.startswith("optimizer_")]:
        del checkpoint[key]
    checkpoint["optimizer_states"] = [fqn_to_index(s, names) for s in states]
    return checkpoint


def check_compatible(path: str | Path, expected: dict[str, torch.Size]) -> None:
    """Before any process starts: the checkpoint exists, is complete and readable, and its parameters have
    the shapes of the model about to be trained (``expected``: name → shape, full/unsharded)."""
    from parallelkit.errors import ConfigError

    from parallelkit.distributed.deepspeed_checkpoint import deepspeed_param_shapes, is_deepspeed_checkpoint

    path = Path(path)
    if not path.exists():
        raise ConfigError(f"ckpt_path={path} does not exist. Give a checkpoint file or directory (e.g. outputs/RUN/checkpoints/last.ckpt), or ckpt_path=last.")
    if is_deepspeed_checkpoint(path):
        found = deepspeed_param_shapes(path)
    elif path.is_dir():
        if not (path / META_FILE).is_file():
            raise ConfigError(
                f"ckpt_path={path} is an incomplete sharded checkpoint (no {META_FILE}, which is written last): its writer died. Use an earlier checkpoint."
            )
        try:
            from torch.distributed.checkpoint import FileSystemReader

            metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        except Exception as err:  # noqa: BLE001 - any unreadable metadata is the same user problem
            raise ConfigError(f"ckpt_path={path} is not a readable sharded checkpoint ({type(err).__name__}: {err}).") from None
        prefix = "state_dict."
        found = {k[len(prefix):]: getattr(v, "size", None) for k, v in metadata.items() if k.startswith(prefix)}
    else:
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except Exception as err:  # noqa: BLE001
            raise ConfigError(f"ckpt_path={path} is corrupt or truncated: torch.load failed ({type(err).__name__}: {err}).") from None
        found = {k: v.shape for k, v in checkpoint.get("state_dict", {}).items() if isinstance(v, torch.Tensor)}
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = [
        (k, tuple(found[k]), tuple(expected[k])) for k in sorted(set(found) & set(expected)) if found[k] is not None and tuple(found[k]) != tuple(expected[k])
    ]
    if missing or unexpected or wrong:
        parts = []
        if wrong:
            parts.append("shape mismatch: " + ", ".join(f"{k} is {a} in the checkpoint but {b} in this model" for k, a, b in wrong[:4]))
        if missing:
            parts.append(f"missing from the checkpoint: {missing[:4]}{' ...' if len(missing) > 4 else ''}")
        if unexpected:
            parts.append(f"not in this model: {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}")
        raise ConfigError(f"ckpt_path={path} was saved from a different model ({'; '.join(parts)}). Use the model settings it was trained with.")
