"""Dry run of a parallel layout: ``python -m parallelkit.plan strategy=hybrid4d strategy.tp=2 trainer.devices=64``.

Composes the same config as ``train.py`` (Hydra's compose API on ``conf/``), resolves the strategy's
:class:`ParallelDims` for the world size, builds the named :class:`DeviceMesh` in *this one process* on
torch's ``fake`` process-group backend (so 64 or 1024 ranks cost nothing), builds the model on the
``meta`` device, and prints without training:

- every rank's ``(dp, sharding, tp, pp, ep)`` coordinates and the ranks of its group on every mesh axis;
- per-rank parameter / gradient / optimizer-state bytes: TP divides the layers its plan shards by ``tp``,
  PP keeps the stage's modules (the model's real ``pipeline_stages`` cut, applied to a meta copy), EP keeps
  ``1/ep`` of the experts, sharding divides by ``sharding`` per ZeRO stage (1: optimizer, 2: + grads,
  3 / FSDP2: + params);
- estimated bytes each rank sends per optimizer step, per axis (ring convention, as ``CommStats`` counts):
  dp/sharding gradient all-reduce or reduce-scatter + parameter all-gather, TP Megatron ``8·b·s·h·(t−1)/t``
  elements per layer, PP ``b·s·h`` activations (forward) and gradients (backward) per stage boundary, EP
  dispatch + combine all-to-alls.

It also writes a PNG drawing the rank grid coloured by each axis (``--png PATH``). With ``strategy=auto`` it first
prints the automatic planner's ranking (``--json PATH`` writes every candidate); ``--calibrate`` measures this
machine into a hardware profile instead (:mod:`parallelkit.planner.cli`). torch is imported only by the per-rank
dry run, so that a plan of thousands of ranks is arithmetic.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parallelkit.distributed.parallel_dims import DP, EP, PP, SHARDING, TP, ParallelDims
from parallelkit.planner.workload import optimizer_slots  # one definition, shared with the planner

if TYPE_CHECKING:
    import torch

AXES = (DP, SHARDING, TP, PP, EP)


@dataclass
class RankPlan:
    rank: int
    coords: dict[str, int]
    groups: dict[str, list[int]]
    state_bytes: dict[str, int]
    comm_bytes: dict[str, int]


@dataclass
class Plan:
    strategy: str
    dims: ParallelDims
    num_params: int
    ranks: list[RankPlan] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------ config
def compose_config(overrides: list[str]) -> Any:
    """The ``train`` config composed with ``overrides``, as ``train.py`` and the ``parallelkit`` command see it
    (the configs parallelkit carries, ``parallelkit.conf``: the checkout's ``conf/`` in an editable install)."""
    from hydra import compose, initialize_config_module

    from parallelkit.launch.cli import register_resolvers

    register_resolvers()
    with initialize_config_module(config_module="parallelkit.conf", version_base="1.3"):
        return compose("train", overrides=list(overrides))


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    """A default process group of ``world_size`` ranks on the ``fake`` backend (no communication), torn down after."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("parallelkit.plan needs to create its own fake process group; one is already initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def mesh_groups(dims: ParallelDims) -> dict[str, list[list[int]]]:
    """For every mesh axis, its process groups (lists of global ranks), read from the real DeviceMesh."""
    with fake_world(dims.world_size):
        mesh = dims.build_mesh("cpu")
        layout = mesh.mesh  # global ranks, shaped like the mesh
        groups = {}
        for i, axis in enumerate(mesh.mesh_dim_names):
            moved = layout.movedim(i, -1).reshape(-1, layout.shape[i])
            groups[axis] = [row.tolist() for row in moved]
    groups[EP] = dims.expert_parallel_groups()
    return groups


# ------------------------------------------------------------------------------------ model state
def tp_divisors(model: torch.nn.Module, tp: int, sequence_parallel: bool = False, plan_source: Any = None) -> dict[str, int]:
    """Parameter name → how many ways TP splits it (the model's plan: column-parallel weight and bias,
    row-parallel weight; row-parallel biases and everything else stay whole)."""
    if tp == 1:
        return {}
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from parallelkit.models.plans import model_plans

    plan = model_plans(model, plan_source).tensor_parallel_plan(tp, sequence_parallel=sequence_parallel, who=f"tp={tp}")
    split: dict[str, int] = {}
    for name, module in model.named_modules():
        style = next((s for pattern, s in plan.layout.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if isinstance(style, (ColwiseParallel, RowwiseParallel)):
            for pname, _ in module.named_parameters(recurse=False):
                if isinstance(style, ColwiseParallel) or pname == "weight":
                    split[f"{name}.{pname}"] = tp
    return split


def stage_param_names(model: torch.nn.Module, dims: ParallelDims, pp_rank: int, options: dict[str, Any]) -> set[str]:
    """Names of the parameters pipeline rank ``pp_rank`` keeps: the model's own cut, on a meta copy."""
    names = {n for n, _ in model.named_parameters()}
    if dims.pp == 1:
        return names
    from parallelkit.distributed.pipeline_parallel import stage_blocks, stage_ids_for_rank
    from parallelkit.models.plans import model_plans

    num_stages = dims.pp * options["virtual_stages"]
    blocks = stage_blocks(model_plans(model, options["plan_source"]).pipeline_blocks(who=f"pp={dims.pp}"), num_stages, options["split"])
    stage_ids = stage_ids_for_rank(pp_rank, dims.pp, options["virtual_stages"], options["schedule"])
    cut = copy.deepcopy(model)
    model_plans(cut, options["plan_source"]).pipeline_stages(blocks, stage_ids)
    return {n for n, _ in cut.named_parameters()}


def expert_param_names(model: torch.nn.Module, plan_source: Any = None) -> set[str]:
    from parallelkit.models.plans import model_plans

    ids = {id(p) for site in model_plans(model, plan_source).expert_parallel_plan(who="ep > 1").sites for p in site.experts_dict.parameters()}
    return {n for n, p in model.named_parameters() if id(p) in ids}




def rank_state_bytes(model, dims, coords, options) -> tuple[dict[str, int], int, int]:
    """``({params, grads, optimizer} bytes, unsharded local param bytes, of which expert bytes)`` of one rank."""
    keep = options["stage_names"][coords[PP]]
    tp_split, experts = options["tp_split"], options["experts"]
    local = expert = 0.0
    for name, p in model.named_parameters():
        if name not in keep:
            continue
        size = p.numel() * p.element_size() / tp_split.get(name, 1)
        if name in experts:
            size /= dims.ep
            expert += size
        local += size
    stage, s = options["zero_stage"], dims.sharding
    params = local / s if stage >= 3 else local
    grads = local / s if stage >= 2 else local
    opt = options["slots"] * local / (s if stage >= 1 else 1)  # fp32 state: slots × the fp32 parameters
    return {"params": int(params), "grads": int(grads), "optimizer": int(opt)}, int(local), int(expert)


# ------------------------------------------------------------------------------------ traffic
def rank_comm_bytes(dims, coords, local_bytes, options, expert_bytes: int = 0) -> dict[str, int]:
    """Estimated bytes this rank sends per optimizer step, per axis."""
    dp, s, t = dims.dp, dims.sharding, dims.tp
    stage, cfg = options["zero_stage"], options["model_cfg"]
    b, seq, h, elem = options["rank_batch"], cfg["seq_len"], cfg["n_embd"], 4
    comm = {axis: 0.0 for axis in AXES}
    n = local_bytes
    if s > 1:  # reduce-scatter of gradients + all-gather of parameters (twice under ZeRO-3 with reshard)
        gathers = 2 if stage >= 3 and options["reshard_after_forward"] else 1
        comm[SHARDING] = (1 + gathers) * n * (s - 1) / s
        comm[DP] = 2 * (n / s) * (dp - 1) / dp  # HSDP: replicas all-reduce their shard
    else:  # dense gradients over all dp ranks; experts only over the dp / ep ranks holding the same ones
        g = dp // dims.ep
        comm[DP] = 2 * (n - expert_bytes) * (dp - 1) / dp + 2 * expert_bytes * (g - 1) / g
    layers = options["layers_per_pp_rank"][coords[PP]]
    comm[TP] = 8 * b * seq * h * (t - 1) / t * elem * layers
    for sid in options["stage_ids"][coords[PP]]:
        comm[PP] += b * seq * h * elem * ((sid < options["num_stages"] - 1) + (sid > 0))
    if dims.ep > 1:  # dispatch + combine, forward and backward, top_k copies of each token
        comm[EP] = 4 * b * seq * h * elem * cfg["top_k"] * (dims.ep - 1) / dims.ep * options["moe_layers_per_pp_rank"][coords[PP]]
    return {axis: int(v) for axis, v in comm.items()}


# ------------------------------------------------------------------------------------ the plan
def build_workload(cfg: Any, data_parallel_size: int = 1) -> tuple[Any, torch.nn.Module]:
    """The composed run's data module, configured for ``data_parallel_size`` (the data sets decide the
    vocabulary), and its model on the ``meta`` device (no memory)."""
    import torch
    from hydra.utils import instantiate

    datamodule = instantiate(cfg.data)
    datamodule.configure(data_parallel_size, cfg.trainer.get("accumulate_grad_batches", 1))
    with torch.device("meta"):
        model = instantiate(cfg.model, **datamodule.model_kwargs())
    return datamodule, model


def model_shape(model: torch.nn.Module, datamodule: Any) -> dict[str, int]:
    """The sizes the estimates need: sequence length, width, heads, layers, vocabulary, MoE top-k."""
    config = getattr(model, "config", None)
    kwargs = datamodule.model_kwargs()

    def size(*names: str, default: int) -> int:  # parallelkit's GPT config, or a transformers config's names
        return next((int(getattr(config, n)) for n in names if getattr(config, n, None) is not None), default)

    return {"seq_len": kwargs.get("block_size", 1), "n_embd": size("n_embd", "hidden_size", default=0),
            "n_head": size("n_head", "num_attention_heads", default=1), "n_layer": size("n_layer", "num_hidden_layers", default=0),
            "vocab_size": kwargs.get("vocab_size", 0), "top_k": getattr(model, "top_k", None) or size("num_experts_per_tok", default=1)}


def plan_options(model: torch.nn.Module, dims: ParallelDims, *, shape: dict[str, int], rank_batch: int, slots: int,
                 zero_stage: int, reshard_after_forward: bool = True, schedule: str = "1f1b", virtual_stages: int = 1,
                 split: list[int] | None = None, sequence_parallel: bool = False, plan_source: Any = None,
                 cache: dict | None = None) -> dict[str, Any]:
    """What :func:`rank_state_bytes` and :func:`rank_comm_bytes` need for ``dims`` (``plan_source``: the
    strategy's ``plan``, where the model's plans are; :mod:`parallelkit.models.plans`).

    ``cache`` (a dict the caller keeps) reuses the TP split and pipeline cuts across layouts that share
    ``tp`` or ``pp``: the automatic planner evaluates dozens of layouts of one model.
    """
    from parallelkit.distributed.pipeline_parallel import stage_ids_for_rank

    cache = {} if cache is None else cache
    vs = virtual_stages if dims.pp > 1 else 1
    options: dict[str, Any] = {
        "virtual_stages": vs, "split": split, "schedule": schedule,
        "zero_stage": zero_stage if dims.sharding > 1 else 0, "reshard_after_forward": reshard_after_forward,
        "slots": slots, "model_cfg": shape, "rank_batch": rank_batch, "num_stages": dims.pp * vs,
        "plan_source": plan_source,
    }
    key = ("tp", dims.tp, sequence_parallel)
    if key not in cache:
        cache[key] = tp_divisors(model, dims.tp, sequence_parallel, plan_source)
    options["tp_split"] = cache[key]
    if dims.ep > 1:
        options["experts"] = cache.setdefault("experts", expert_param_names(model, plan_source))
    else:
        options["experts"] = set()
    key = ("pp", dims.pp, vs, schedule, tuple(split or ()))
    if key not in cache:
        stage_names = {r: stage_param_names(model, dims, r, options) for r in range(dims.pp)}
        stage_ids = {r: stage_ids_for_rank(r, dims.pp, vs, schedule) if dims.pp > 1 else [0] for r in range(dims.pp)}
        blocks = block_names(model)
        moe = set(getattr(model, "moe_layers", dict)())
        layers = {r: sum(1 for b in blocks if any(n.startswith(f"{b}.") for n in names)) for r, names in stage_names.items()}
        moe_layers = {r: sum(1 for m in moe if any(n.startswith(m + ".") for n in names)) for r, names in stage_names.items()}
        cache[key] = (stage_names, stage_ids, layers, moe_layers)
    (options["stage_names"], options["stage_ids"], options["layers_per_pp_rank"],
     options["moe_layers_per_pp_rank"]) = cache[key]
    return options


def block_names(model: torch.nn.Module) -> list[str]:
    """Qualified names of the model's repeated blocks (``layers.0``, ``hf.model.layers.0``: the units FSDP2 shards)."""
    from parallelkit.distributed.blocks import repeated_blocks

    ids = {id(b) for b in repeated_blocks(model)}
    return [name for name, module in model.named_modules() if id(module) in ids]


def build_plan(overrides: list[str]) -> Plan:
    from hydra.utils import instantiate

    from parallelkit.strategy_protocol import as_protocol

    cfg = compose_config(overrides)
    strategy = as_protocol(instantiate(cfg.strategy))
    devices = cfg.trainer.get("devices") or strategy.default_devices("cpu")
    strategy = strategy.resolve(cfg, devices, cfg.trainer.get("num_nodes") or 1)  # strategy=auto: the layout it would choose
    dims = strategy.plan(devices * (cfg.trainer.get("num_nodes") or 1))
    datamodule, model = build_workload(cfg, dims.data_parallel_size)
    batch = datamodule.plan
    options = plan_options(
        model, dims, shape=model_shape(model, datamodule), rank_batch=batch.global_batch_size // dims.data_parallel_size,
        slots=optimizer_slots(cfg.optim.optimizer._target_), zero_stage=getattr(strategy, "stage", 3),
        reshard_after_forward=getattr(strategy, "reshard_after_forward", True),
        schedule=getattr(strategy, "schedule", "1f1b"), virtual_stages=getattr(strategy, "virtual_stages", 1) or 1,
        split=getattr(strategy, "split", None), sequence_parallel=getattr(strategy, "sequence_parallel", False),
        plan_source=getattr(strategy, "plan_source", None),
    )
    groups = mesh_groups(dims)
    plan = Plan(strategy.strategy_name, dims,
                sum(p.numel() for p in model.parameters()))
    for rank in range(dims.world_size):
        coords = dims.coordinates(rank)
        state, local, expert = rank_state_bytes(model, dims, coords, options)
        mine = {axis: next(g for g in axis_groups if rank in g) for axis, axis_groups in groups.items()}
        plan.ranks.append(RankPlan(rank, coords, mine, state, rank_comm_bytes(dims, coords, local, options, expert)))
    mcfg = options["model_cfg"]
    plan.notes.append(f"per-rank batch {options['rank_batch']} × seq {mcfg['seq_len']} × hidden {mcfg['n_embd']}; "
                      f"ZeRO stage {options['zero_stage']}; optimizer slots {options['slots']}")
    return plan


# ------------------------------------------------------------------------------------ output
def _mb(n: int) -> str:
    """Bytes in the largest unit that keeps the number ≥ 1 (B, K, M, G = 2**10 steps)."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


def format_plan(plan: Plan) -> str:
    d = plan.dims
    lines = [f"strategy={plan.strategy} world={d.world_size} dims={d.as_dict()} mesh_order={list(d.mesh_order)} "
             f"params={plan.num_params:,}", *plan.notes,
             "rank | dp sh tp pp ep | params grads optim (bytes) | sent/step dp sharding tp pp ep | groups pp / dp / sharding / tp / ep"]
    for r in plan.ranks:
        c, s, m = r.coords, r.state_bytes, r.comm_bytes
        lines.append(
            f"{r.rank:4d} | {c[DP]:2d} {c[SHARDING]:2d} {c[TP]:2d} {c[PP]:2d} {c[EP]:2d} | "
            f"{_mb(s['params'])} {_mb(s['grads'])} {_mb(s['optimizer'])} | "
            + " ".join(_mb(m[a]) for a in AXES) + " | "
            + " / ".join(",".join(map(str, r.groups[a])) for a in (PP, DP, SHARDING, TP, EP))
        )
    return "\n".join(lines)


def draw_plan(plan: Plan, path: Path) -> Path:
    """One panel per axis: the rank grid, each cell coloured by the rank's index on that axis, labelled
    with its rank."""
    import matplotlib
    import torch

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = plan.dims
    # A near-square grid whose rows hold whole innermost (tp) groups: rank = row · cols + col.
    fits = [c for c in range(d.mesh_shape[-1], d.world_size + 1, d.mesh_shape[-1]) if d.world_size % c == 0]
    cols = min(fits, key=lambda c: abs(c - math.sqrt(d.world_size)))
    rows = d.world_size // cols
    fig, axes = plt.subplots(1, 5, figsize=(4 * 5, 4 * rows / cols + 1.2), squeeze=False)
    for ax, axis in zip(axes[0], (PP, DP, SHARDING, TP, EP)):
        grid = torch.zeros(rows, cols)
        for r in plan.ranks:
            grid[r.rank // cols, r.rank % cols] = r.coords[axis]
        degree = d.as_dict()[axis]
        # Distinct colours per index: qualitative maps up to 20, a continuous one beyond.
        cmap, top = ("tab10", 9) if degree <= 10 else ("tab20", 19) if degree <= 20 else ("turbo", degree - 1)
        ax.imshow(grid.numpy(), cmap=cmap, vmin=0, vmax=top, aspect="auto")
        for r in plan.ranks:
            ax.text(r.rank % cols, r.rank // cols, str(r.rank), ha="center", va="center", fontsize=6)
        ax.set_title(f"{axis} (degree {d.as_dict()[axis]})")
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(f"{plan.strategy}: {d.world_size} ranks, {d.as_dict()}, mesh {'×'.join(d.mesh_order)}; colour = index on the axis")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m parallelkit.plan [overrides] [--png PATH] [--json PATH] [--top N] [--calibrate [--out PATH]]``."""
    from parallelkit.planner.cli import main as planner_main

    return planner_main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
