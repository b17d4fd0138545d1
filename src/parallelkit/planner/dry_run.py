"""The per-rank dry run of a parallel layout (``python -m parallelkit.plan strategy=hybrid4d strategy.tp=2 ...``).

From the composed config (:mod:`~parallelkit.planner.inputs`), it resolves the strategy's :class:`ParallelDims`
for the world size, builds the named :class:`DeviceMesh` in *this one process* on torch's ``fake`` process-group
backend (so 64 or 1024 ranks cost nothing), builds the model on the ``meta`` device, and computes without
training:

- every rank's ``(dp, sharding, cp, tp, pp, ep)`` coordinates and the ranks of its group on every mesh axis;
- per-rank parameter / gradient / optimizer-state bytes: TP divides the layers its plan shards by ``tp``,
  PP keeps the stage's modules (the model's real ``pipeline_stages`` cut, applied to a meta copy), EP keeps
  ``1/ep`` of the experts, sharding divides by ``sharding`` per ZeRO stage (1: optimizer, 2: + grads,
  3 / FSDP2: + params; FSDP2 shards over ``sharding × cp``: cp ranks hold the same parameters);
- estimated bytes each rank sends per optimizer step, per axis (ring convention, as ``CommStats`` counts):
  dp/sharding gradient all-reduce or reduce-scatter + parameter all-gather, TP Megatron ``8·b·s·h·(t−1)/t``
  elements per layer, PP ``b·s·h`` activations (forward) and gradients (backward) per stage boundary (``/tp``
  under sequence parallelism: the stage output is a sequence shard) and, for a weight the first and the last
  stage both hold (tied embeddings), the all-reduce of its gradient between them; EP dispatch + combine all-to-alls;
  CP (each rank's ``s/cp`` tokens in all of the above, the gradient all-reduce over ``dp × cp``): ring attention's
  ``(3·cp − 2)·2·|k_local|`` per layer (``ring_payload_bytes``), or all-to-all's 8 exchanges of ``(cp − 1)/cp`` of q,
  k, v and the output.

Unlike the cost model it reads the real model (its plans, on the meta device), so it needs torch; the command
line is :mod:`parallelkit.tools.plan`, the rank-grid drawing :mod:`parallelkit.planner.plot`.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from parallelkit.distributed.parallel_dims import CP, DP, EP, PP, SHARDING, TP, ParallelDims
from parallelkit.planner.inputs import block_names, build_workload, compose_config, model_shape
from parallelkit.planner.workload import optimizer_slots  # one definition, shared with the cost model

if TYPE_CHECKING:
    import torch

AXES = (DP, SHARDING, CP, TP, PP, EP)


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


def rank_state_bytes(model, dims, coords, options) -> tuple[dict[str, int], int, int, int]:
    """``({params, grads, optimizer} bytes, unsharded local param bytes, of which expert bytes, of which outside
    the repeated blocks)`` of one rank (the last: ZeRO-3's root unit, embeddings and head)."""
    keep = options["stage_names"][coords[PP]]
    tp_split, experts = options["tp_split"], options["experts"]
    blocks = tuple(f"{b}." for b in options["blocks"])
    local = expert = root = 0.0
    for name, p in model.named_parameters():
        if name not in keep:
            continue
        size = p.numel() * p.element_size() / tp_split.get(name, 1)
        if name in experts:
            size /= dims.ep
            expert += size
        if not name.startswith(blocks):
            root += size
        local += size
    stage, s = options["zero_stage"], dims.sharding * dims.cp if dims.sharding > 1 else 1  # FSDP2 over sharding × cp
    params = local / s if stage >= 3 else local
    grads = local / s if stage >= 2 else local
    opt = options["slots"] * local / (s if stage >= 1 else 1)  # fp32 state: slots × the fp32 parameters
    return {"params": int(params), "grads": int(grads), "optimizer": int(opt)}, int(local), int(expert), int(root)


# ------------------------------------------------------------------------------------ traffic
def rank_comm_bytes(dims, coords, local_bytes, options, expert_bytes: int = 0, root_bytes: int = 0) -> dict[str, int]:
    """Estimated bytes this rank sends per optimizer step, per axis (``root_bytes``: of ``local_bytes``, those
    outside the repeated blocks: ZeRO-3's root unit, which stays gathered from forward into backward)."""
    # cp ranks hold the same parameters: FSDP2 shards over sharding × cp; without sharding the all-reduce spans dp × cp.
    cp, t = dims.cp, dims.tp
    dp, s = (dims.dp, dims.sharding * cp) if dims.sharding > 1 else (dims.dp * cp, 1)
    stage, cfg = options["zero_stage"], options["model_cfg"]
    b, seq, h, elem = options["rank_batch"], cfg["seq_len"] / cp, cfg["n_embd"], 4  # seq: this rank's s/cp tokens
    comm = {axis: 0.0 for axis in AXES}
    n = local_bytes
    if s > 1:  # reduce-scatter of gradients + all-gather of parameters (the blocks twice under ZeRO-3 with reshard)
        gathered = 2 * n - root_bytes if stage >= 3 and options["reshard_after_forward"] else n
        comm[SHARDING] = (n + gathered) * (s - 1) / s
        comm[DP] = 2 * (n / s) * (dp - 1) / dp  # HSDP: replicas all-reduce their shard
    else:  # dense gradients over all dp ranks; experts only over the dp / ep ranks holding the same ones
        g = dp // dims.ep
        comm[DP] = 2 * (n - expert_bytes) * (dp - 1) / dp + 2 * expert_bytes * (g - 1) / g
    layers = options["layers_per_pp_rank"][coords[PP]]
    comm[TP] = 8 * b * seq * h * (t - 1) / t * elem * layers
    shard = t if options.get("sequence_parallel") else 1  # sequence parallel: each tp rank sends its sequence shard
    for sid in options["stage_ids"][coords[PP]]:
        comm[PP] += b * seq * h * elem / shard * ((sid < options["num_stages"] - 1) + (sid > 0))
    shared = options.get("shared_stage_bytes", {}).get(coords[PP], 0)  # 2-rank all-reduce: 1× the gradient, as held
    comm[PP] += shared / (s if stage >= 2 else 1)
    if dims.ep > 1:  # dispatch + combine, forward and backward, top_k copies of each token
        comm[EP] = 4 * b * seq * h * elem * cfg["top_k"] * (dims.ep - 1) / dims.ep * options["moe_layers_per_pp_rank"][coords[PP]]
    if cp > 1:
        head_dim = h / cfg["n_head"]
        k_local = b * seq * cfg.get("n_kv_head", cfg["n_head"]) * head_dim / t * elem
        if options.get("cp_mode", "ring") == "ring":  # (cp − 1) hops of k and v forward, (2·cp − 1) backward
            grad = k_local * 4 / elem  # the gradients' cp hops in fp32
            comm[CP] = 2 * ((2 * cp - 2) * k_local + cp * grad) * layers
        else:  # q, k, v, out forward and their gradients backward (key/value heads repeated up to cp)
            q = b * seq * h / t * elem
            kv = k_local * max(1.0, cp / max(cfg.get("n_kv_head", cfg["n_head"]) / t, 1))
            comm[CP] = 2 * (2 * q + 2 * kv) * (cp - 1) / cp * layers
    return {axis: int(v) for axis, v in comm.items()}


# ------------------------------------------------------------------------------------ the plan
def plan_options(model: torch.nn.Module, dims: ParallelDims, *, shape: dict[str, int], rank_batch: int, slots: int,
                 zero_stage: int, reshard_after_forward: bool = True, schedule: str = "1f1b", virtual_stages: int = 1,
                 split: list[int] | None = None, sequence_parallel: bool = False, plan_source: Any = None,
                 cache: dict | None = None, cp_mode: str = "ring") -> dict[str, Any]:
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
        "plan_source": plan_source, "cp_mode": cp_mode,
    }
    key = ("tp", dims.tp, sequence_parallel)
    if key not in cache:
        cache[key] = tp_divisors(model, dims.tp, sequence_parallel, plan_source)
    options["tp_split"] = cache[key]
    options["blocks"] = cache.setdefault("blocks", block_names(model))
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
    options["sequence_parallel"] = bool(sequence_parallel) and dims.tp > 1
    options["shared_stage_bytes"] = shared_stage_bytes(model, options) if dims.pp > 1 else {}
    return options


def shared_stage_bytes(model: torch.nn.Module, options: dict[str, Any]) -> dict[int, float]:
    """Pipeline rank → gradient bytes it all-reduces with another stage per step: the parameters the ranks holding the
    first and the last stage both keep (tied input and output embeddings: Megatron's embedding group)."""
    holder = {sid: r for r, ids in options["stage_ids"].items() for sid in ids}
    first, last = holder[0], holder[options["num_stages"] - 1]
    if first == last:
        return {}
    shared = options["stage_names"][first] & options["stage_names"][last]
    split = options["tp_split"]
    size = sum(p.numel() * p.element_size() / split.get(name, 1) for name, p in model.named_parameters() if name in shared)
    return {first: size, last: size} if size else {}


def strategy_options(strategy: Any, dims: ParallelDims) -> dict[str, Any]:
    """The options of the composition a strategy runs (its ``ParallelOptions``), or a strategy's own attributes
    (``deepspeed``), or the defaults."""
    opts = getattr(strategy, "options", None)
    if opts is not None:
        return dict(zero_stage=opts.zero_stage, reshard_after_forward=opts.reshard(dims.pp), schedule=opts.schedule, virtual_stages=opts.virtual_stages,
                    split=list(opts.split) if opts.split else None, sequence_parallel=opts.sequence_parallel,
                    cp_mode=getattr(opts, "cp_mode", "ring"))
    return dict(zero_stage=getattr(strategy, "stage", 3), reshard_after_forward=getattr(strategy, "reshard_after_forward", True),
                schedule=getattr(strategy, "schedule", "1f1b"), virtual_stages=getattr(strategy, "virtual_stages", 1) or 1,
                split=getattr(strategy, "split", None), sequence_parallel=getattr(strategy, "sequence_parallel", False))


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
        slots=optimizer_slots(cfg.optim.optimizer._target_), plan_source=getattr(strategy, "plan_source", None),
        **strategy_options(strategy, dims),
    )
    groups = mesh_groups(dims)
    plan = Plan(strategy.strategy_name, dims,
                sum(p.numel() for p in model.parameters()))
    for rank in range(dims.world_size):
        coords = dims.coordinates(rank)
        state, local, expert, root = rank_state_bytes(model, dims, coords, options)
        mine = {axis: next(g for g in axis_groups if rank in g) for axis, axis_groups in groups.items()}
        plan.ranks.append(RankPlan(rank, coords, mine, state, rank_comm_bytes(dims, coords, local, options, expert, root)))
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
             "rank | dp sh cp tp pp ep | params grads optim (bytes) | sent/step dp sharding cp tp pp ep | groups pp / dp / sharding / cp / tp / ep"]
    for r in plan.ranks:
        c, s, m = r.coords, r.state_bytes, r.comm_bytes
        lines.append(
            f"{r.rank:4d} | {c[DP]:2d} {c[SHARDING]:2d} {c[CP]:2d} {c[TP]:2d} {c[PP]:2d} {c[EP]:2d} | "
            f"{_mb(s['params'])} {_mb(s['grads'])} {_mb(s['optimizer'])} | "
            + " ".join(_mb(m[a]) for a in AXES) + " | "
            + " / ".join(",".join(map(str, r.groups[a])) for a in (PP, DP, SHARDING, CP, TP, EP))
        )
    return "\n".join(lines)
