"""A DeepSpeed checkpoint directory read as parallelkit's canonical training state, so that a ``strategy=deepspeed``
run continues under any other layout (single, ddp, ZeRO 1-3, tp, pp, hybrid4d...).

DeepSpeed writes ``<dir>/<tag>/``: the module and Lightning's state in ``*model_states.pt`` (one file up to stage 2,
one per rank at stage 3) and each data-parallel rank's ZeRO partition in ``*optim_states.pt``: flat fp32 buffers, one
per optimizer group, and Adam's moments laid out as those buffers. The layouts (DeepSpeed 0.19, as its own
``zero_to_fp32`` reads them):

* stages 1-2: a group's flat buffer is cut into ``partition_count`` equal pieces in rank order; the parameters lie
  back to back in ``param_shapes`` order (padding only at the end);
* stage 3: every parameter is cut on its own into ``ceil(numel / ranks)`` elements per rank; a rank's flat buffer
  holds its piece of each parameter, back to back in ``param_shapes`` order.

The result has the layout of a sharded directory loaded whole (:func:`parallelkit.distributed.checkpoint_io.load_unsharded`):
``state_dict`` (the fp32 master weights, not the module's possibly half-precision copy), ``optimizer_<i>`` keyed by
parameter name, and Lightning's entries (loops, callbacks, schedulers, the data position). DeepSpeed's loss scaler
stays behind (parallelkit's ``callbacks=[amp]`` keeps its own, in the callbacks' state).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from parallelkit.errors import ConfigError

# Entries of DeepSpeed's model-states file that are DeepSpeed's own bookkeeping, not Lightning's checkpoint.
DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments",
    "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps", "global_samples", "dp_world_size",
    "mp_world_size", "checkpoint_parallel_dimensions", "ds_config", "ds_version",
})


def deepspeed_tag(path: str | Path) -> Path | None:
    """The tag directory of a DeepSpeed checkpoint directory (the one holding ``*model_states.pt``), or None."""
    path = Path(path)
    if not path.is_dir():
        return None
    states = sorted(path.glob("*/*model_states.pt"))
    return states[0].parent if states else None


def is_deepspeed_checkpoint(path: str | Path) -> bool:
    return deepspeed_tag(path) is not None


def _load(file: Path) -> Any:
    return torch.load(file, map_location="cpu", weights_only=False)


def deepspeed_param_shapes(path: str | Path) -> dict[str, torch.Size]:
    """Every parameter's and buffer's full shape, from the model-states file alone (no partition is read)."""
    states = _load(min(deepspeed_tag(path).glob("*model_states.pt")))
    module = states.get("module") or {}
    shapes = {name: module[name].shape for name in states.get("buffer_names") or [] if name in module}
    for group in states["param_shapes"]:
        shapes.update(group)
    shapes.update(states.get("frozen_param_shapes") or {})
    for alias, source in (states.get("shared_params") or {}).items():
        shapes[alias] = shapes[source]
    return shapes


def deepspeed_layout(path: str | Path) -> tuple[int, int]:
    """``(ZeRO stage, data-parallel ranks)`` a DeepSpeed checkpoint directory was written with."""
    states = _load(min(deepspeed_tag(path).glob("*model_states.pt")))
    return int((states["ds_config"].get("zero_optimization") or {}).get("stage", 0)), int(states["dp_world_size"])


def _ranks_files(tag: Path) -> list[Path]:
    def rank_of(file: Path) -> int:
        return int(file.name.split("_rank_")[1].split("_")[0])  # zero_pp_rank_<r>_mp_rank_00_optim_states.pt

    files = sorted(tag.glob("*optim_states.pt"), key=rank_of)
    if [rank_of(f) for f in files] != list(range(len(files))) or not files:
        raise ConfigError(f"{tag.parent} is an incomplete DeepSpeed checkpoint (ZeRO partition files {[f.name for f in files]}): "
                          "its writer died. Use an earlier checkpoint.")
    return files


def _unflatten(flats: list[torch.Tensor], shapes: dict[str, torch.Size], stage: int) -> dict[str, torch.Tensor]:
    """Full tensors of one optimizer group from its per-rank flat pieces (``flats``, in rank order)."""
    out: dict[str, torch.Tensor] = {}
    if stage < 3:
        whole, offset = torch.cat(flats), 0
        for name, shape in shapes.items():
            n = math.prod(shape)
            out[name] = whole[offset:offset + n].view(shape).clone()
            offset += n
        return out
    ranks, offset = len(flats), 0
    for name, shape in shapes.items():
        n = math.prod(shape)
        piece = math.ceil(n / ranks)
        out[name] = torch.cat([flat[offset:offset + piece] for flat in flats])[:n].view(shape).clone()
        offset += piece
    return out


def load_deepspeed_unsharded(path: str | Path) -> dict[str, Any]:
    """The whole training state of a DeepSpeed checkpoint directory in this process (see the module's docstring)."""
    tag = deepspeed_tag(path)
    if tag is None:
        raise ConfigError(f"{path} is not a DeepSpeed checkpoint directory (no <tag>/*model_states.pt in it).")
    model_states = _load(min(tag.glob("*model_states.pt")))
    partitions = [_load(f)["optimizer_state_dict"] for f in _ranks_files(tag)]
    stage = int(partitions[0]["zero_stage"])
    if stage == 0:
        raise ConfigError(f"{path} is a DeepSpeed stage-0 checkpoint: its optimizer state is not partitioned and not supported here.")
    if stage == 3 and model_states.get("frozen_param_shapes"):
        raise ConfigError(f"{path}: frozen parameters of a DeepSpeed stage-3 checkpoint are not supported (train them, or continue with strategy=deepspeed).")
    flat_key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    base_key = "optimizer_state_dict" if stage == 3 else "base_optimizer_state"

    module = model_states.get("module") or {}
    state_dict = {name: module[name] for name in model_states.get("buffer_names") or [] if name in module}
    state_dict.update({name: module[name] for name in model_states.get("frozen_param_shapes") or {}})
    optimizer_state: dict[str, dict[str, torch.Tensor]] = {}
    groups = []
    for g, shapes in enumerate(model_states["param_shapes"]):
        state_dict.update(_unflatten([p[flat_key][g] for p in partitions], shapes, stage))
        states = [p[base_key]["state"][g] for p in partitions]
        moments = {key: _unflatten([s[key] for s in states], shapes, stage) for key in states[0] if key != "step"}
        for name in shapes:
            optimizer_state[name] = {"step": states[0]["step"].clone(), **{key: moments[key][name] for key in moments}}
        group = {k: v for k, v in partitions[0][base_key]["param_groups"][g].items() if k != "params"}
        groups.append({**group, "params": list(shapes)})
    for alias, source in (model_states.get("shared_params") or {}).items():
        state_dict[alias] = state_dict[source]
    lightning = {k: v for k, v in model_states.items() if k not in DEEPSPEED_KEYS}
    return {**lightning, "state_dict": state_dict, "optimizer_0": {"state": optimizer_state, "param_groups": groups}}


# ------------------------------------------------------------------ the other way: any checkpoint into an engine


def _rank_piece(full: torch.Tensor, piece: int, rank: int) -> torch.Tensor:
    flat = full.detach().reshape(-1)
    flat = torch.cat([flat, flat.new_zeros(max(0, piece * (rank + 1) - flat.numel()))])
    return flat[piece * rank:piece * (rank + 1)]


def _rank_flat(tensors: list[torch.Tensor], params: list[torch.nn.Parameter], stage: int, rank: int, size: int) -> torch.Tensor:
    """This rank's flat piece of one group (``size`` elements), laid out as the engine holds it (module docstring)."""
    if stage < 3:
        return _rank_piece(torch.cat([t.detach().reshape(-1) for t in tensors]), size, rank)
    return torch.cat([_rank_piece(t, p.ds_tensor.numel(), rank) for t, p in zip(tensors, params)])


def load_into_deepspeed_engine(engine: Any, state_dict: dict[str, torch.Tensor], optimizer_state: dict[str, Any]) -> None:
    """Put a canonical training state (full tensors by name; the optimizer state in the FQN layout) into a DeepSpeed
    ZeRO 1-3 ``engine``: each rank keeps its piece of the fp32 master weights and of the optimizer's moments, and its
    module weights (whole up to stage 2, its partition at stage 3). Scalar state (Adam's step) is the same for every
    parameter of a group and is taken from the first."""
    opt = engine.optimizer
    stage = engine.zero_optimization_stage()
    names = {id(p): name for name, p in engine.module.named_parameters()}
    buffers = dict(engine.module.named_buffers())
    for name, buffer in buffers.items():
        if name in state_dict:
            buffer.data.copy_(state_dict[name])
    if stage == 0:
        raise ConfigError("strategy=deepspeed strategy.stage=0 continues only from its own checkpoints; use stage 1-3, or strategy=ddp.")
    if stage < 3:
        groups, flats = opt.round_robin_bit16_groups, opt.single_partition_of_fp32_groups
        rank = torch.distributed.get_rank(group=opt.real_dp_process_group[0])
    else:
        if any(f is None for f in opt.fp16_partitioned_groups_flat):  # parameters swapped out to NVMe: no host buffer
            raise ConfigError("strategy=deepspeed with parameters offloaded to NVMe continues only from its own checkpoints "
                              "(its partitions live in swap files); offload to the host (strategy.offload=params) or continue without it.")
        groups, flats = opt.fp16_groups, opt.fp32_partitioned_groups_flat
        rank = torch.distributed.get_rank(group=opt.dp_process_group)
    for g, (params, flat) in enumerate(zip(groups, flats)):
        group_names = [names[id(p)] for p in params]
        missing = [n for n in group_names if n not in state_dict]
        if missing:
            raise ConfigError(f"the checkpoint lacks parameters this model holds: {missing[:4]}. Use the model settings it was trained with.")
        size = flat.numel()
        weights = _rank_flat([state_dict[n] for n in group_names], params, stage, rank, size)
        flat.data.copy_(weights)
        if stage < 3:
            for p, n in zip(params, group_names):
                p.data.copy_(state_dict[n])
        else:
            opt.fp16_partitioned_groups_flat[g].data.copy_(weights)
        per_param = [optimizer_state.get(n, {}) for n in group_names]
        if not any(per_param):
            continue  # a parameter never stepped: the optimizer starts it fresh, as in the uninterrupted run
        state = {}
        for key, first in per_param[0].items():
            if isinstance(first, torch.Tensor) and first.dim() > 0:  # laid out as the parameter (moments)
                state[key] = _rank_flat([s[key] for s in per_param], params, stage, rank, size).to(flat.dtype).clone()
            else:
                state[key] = first.clone() if isinstance(first, torch.Tensor) else first
        opt.optimizer.state[flat] = state
