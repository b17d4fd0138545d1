"""``python -m parallelkit.plan``: the command line of the planner and of the per-rank dry run.

    python -m parallelkit.plan strategy=auto trainer.devices=8 trainer.num_nodes=2048 strategy.hardware=h100_80gb_8x \\
        model=hf model.config=llama3_405b.json data.seq_len=8192 data.global_batch_size=2048 --json plan.json
    python -m parallelkit.plan strategy=hybrid4d strategy.tp=2 strategy.pp=2 trainer.devices=64 --png grid.png
    python -m parallelkit.plan --calibrate trainer.devices=8 --out hardware_myhost.yaml

With ``strategy=auto`` the ranking is computed without torch (arithmetic over analytic shapes), printed, and written
whole with ``--json``; the per-rank dry run of the chosen layout follows for worlds up to ``--ranks-limit`` ranks
(default 512). With any other strategy, the dry run as before; ``--hardware NAME|PATH`` adds the cost model's
estimate of that fixed layout. Bad input: one ``Error:`` paragraph on stderr, exit code 2.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from parallelkit.errors import ConfigError

AUTO_TARGET = "parallelkit.strategies.auto.AutoStrategy"
FLAGS = {"--png": str, "--json": str, "--top": int, "--out": str, "--hardware": str, "--ranks-limit": int}


def parse(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """Split ``argv`` into Hydra overrides and the planner's own flags."""
    overrides, flags = [], {"calibrate": False}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--calibrate":
            flags["calibrate"] = True
        elif arg in FLAGS:
            if i + 1 >= len(argv):
                raise ConfigError(f"{arg} needs a value.")
            try:
                flags[arg[2:].replace("-", "_")] = FLAGS[arg](argv[i + 1])
            except ValueError:
                raise ConfigError(f"{arg} takes an integer; got {argv[i + 1]!r}.") from None
            i += 1
        elif arg.startswith("--"):
            raise ConfigError(f"Unknown option {arg}; python -m parallelkit.plan takes overrides and {', '.join(['--calibrate', *FLAGS])}.")
        else:
            overrides.append(arg)
        i += 1
    return overrides, flags


def auto_plan_from_config(cfg: Any) -> Any:
    """What ``strategy=auto`` would rank for this config, without instantiating the strategy (no torch, no Lightning)."""
    from parallelkit.auto_plan import choose_layout, resolve_hardware
    from parallelkit.planner.hardware import host_memory_per_rank

    strategy = dict(cfg.strategy)
    devices = cfg.trainer.get("devices") or 2
    nodes = cfg.trainer.get("num_nodes") or 1
    accelerator = "gpu" if cfg.trainer.get("accelerator") == "gpu" else "cpu"
    hardware = resolve_hardware(strategy.get("hardware"), accelerator=accelerator, devices_per_node=devices,
                                memory_default=host_memory_per_rank(devices) if accelerator == "cpu" else None)
    own = ("_target_", "hardware", "max_microbatches", "search_accumulate", "allow_tp_across_nodes", "allow_ep_across_nodes", "top")
    kwargs = {k: v for k, v in strategy.items() if k not in own}
    return choose_layout(cfg, devices * nodes, hardware, max_microbatches=strategy.get("max_microbatches"),
                         strategy_kwargs=kwargs, search_accumulate=strategy.get("search_accumulate", True),
                         allow_tp_across_nodes=bool(strategy.get("allow_tp_across_nodes", False)),
                         allow_ep_across_nodes=bool(strategy.get("allow_ep_across_nodes", False)))


def estimate_fixed_layout(cfg: Any, hardware_spec: str) -> str:
    """The cost model's estimate of the layout a fixed ``strategy=hybrid4d`` config trains with."""
    from parallelkit.auto_plan import workload_of
    from parallelkit.planner.hardware import load_profile
    from parallelkit.planner.layout import Layout
    from parallelkit.planner.report import format_ranking
    from parallelkit.planner.search import AutoPlan, evaluate

    hw = load_profile(hardware_spec)
    s = cfg.strategy
    world = (cfg.trainer.get("devices") or 2) * (cfg.trainer.get("num_nodes") or 1)
    from parallelkit.distributed.parallel_dims import ParallelDims

    dims = ParallelDims.from_degrees(world, dp=s.get("dp", -1), sharding=s.get("sharding", 1), tp=s.get("tp", 1),
                                     pp=s.get("pp", 1), ep=s.get("ep", 1))
    w = workload_of(cfg, dict(s))
    batch = w.global_batch // dims.data_parallel_size
    m = s.get("microbatches", 1) if dims.pp > 1 else 1
    accumulate = cfg.trainer.get("accumulate_grad_batches", 1) if dims.pp == 1 else 1
    layout = Layout(dims.dp, dims.sharding, dims.tp, dims.pp, dims.ep, zero_stage=3 if dims.sharding > 1 else 0,
                    micro_batch=batch // (m * accumulate), microbatches=m, accumulate=accumulate,
                    schedule=s.get("schedule", "1f1b"), virtual_stages=s.get("virtual_stages") or (2 if s.get("schedule") in ("interleaved_1f1b", "zero_bubble", "zbv") and dims.pp > 1 else 1),
                    reshard_after_forward=dims.pp == 1 if s.get("reshard_after_forward") is None else bool(s.get("reshard_after_forward")))
    candidate = evaluate(w, hw, layout)
    text = format_ranking(AutoPlan(world, hw, w, [candidate]), top=1)
    return text.replace("strategy=auto:", "the cost model's estimate of this layout:", 1).replace("chosen: ", "estimate: ")


def chosen_as_hybrid4d(overrides: list[str], layout: Any) -> list[str]:
    """The overrides that train ``layout`` with ``strategy=hybrid4d`` (what ``strategy=auto`` resolves to)."""
    kept = [o for o in overrides if not o.lstrip("+~").startswith("strategy")]
    chosen = ["strategy=hybrid4d", *(f"strategy.{axis}={degree}" for axis, degree in layout.degrees.items()),
              f"strategy.mesh_order=[{','.join(layout.mesh_order)}]"]
    if layout.pp > 1:
        chosen += [f"strategy.microbatches={layout.microbatches}", f"strategy.schedule={layout.schedule}"]
        if layout.virtual_stages > 1:
            chosen.append(f"strategy.virtual_stages={layout.virtual_stages}")
    else:
        kept = [o for o in kept if not o.startswith("trainer.accumulate_grad_batches")]
        chosen.append(f"trainer.accumulate_grad_batches={layout.accumulate}")
    return [*kept, *chosen]


def main(argv: list[str]) -> int:
    try:
        overrides, flags = parse(argv)
        if flags["calibrate"]:
            return run_calibration(overrides, flags)
        from parallelkit.plan import compose_config

        cfg = compose_config(overrides)
        if cfg.strategy.get("_target_") == AUTO_TARGET:
            start = time.perf_counter()
            plan = auto_plan_from_config(cfg)
            seconds = time.perf_counter() - start
            from parallelkit.planner.report import format_ranking, write_json

            print(format_ranking(plan, flags.get("top", 8)))
            print(f"planned {len(plan.candidates):,} candidates ({plan.invalid_layouts} degree sets pruned before costing) in {seconds:.2f} s")
            if flags.get("json"):
                print(f"every candidate written to {write_json(plan, Path(flags['json']))}")
            if plan.world_size > flags.get("ranks_limit", 512):
                print(f"(per-rank listing skipped above {flags.get('ranks_limit', 512)} ranks; --ranks-limit N raises the limit)")
                return 0
            overrides = chosen_as_hybrid4d(overrides, plan.chosen.layout)  # the dry run of the choice, not a second search
        elif flags.get("json"):
            raise ConfigError("--json writes the planner's ranking of every candidate layout: it needs strategy=auto "
                              f"(this command has strategy={cfg.strategy.get('_target_', '?').rsplit('.', 1)[-1]}, one fixed layout).")
        elif flags.get("hardware"):
            print(estimate_fixed_layout(cfg, flags["hardware"]))
        from parallelkit.plan import build_plan, draw_plan, format_plan

        plan = build_plan(overrides)
    except ConfigError as err:
        print(f"Error: {err}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    out = draw_plan(plan, Path(flags["png"]) if flags.get("png") else default_png(plan.dims, flags.get("json")))
    print(f"rank grid drawn to {out}")
    return 0


def default_png(dims: Any, json_path: str | None) -> Path:
    """Where the rank grid goes without ``--png``: beside the ``--json`` output when there is one (else the current
    directory), named by the layout (``plan_dp1_sharding2_tp2_pp2_ep1.png``), so two layouts never overwrite one
    picture."""
    name = "plan_" + "_".join(f"{axis}{degree}" for axis, degree in dims.as_dict().items()) + ".png"
    return (Path(json_path).parent if json_path else Path(".")) / name


def run_calibration(overrides: list[str], flags: dict[str, Any]) -> int:
    from parallelkit.auto_plan import workload_of
    from parallelkit.plan import compose_config
    from parallelkit.planner.calibrate import calibrate
    from parallelkit.planner.hardware import save_profile

    cfg = compose_config(overrides)
    world = cfg.trainer.get("devices") or 2
    start = time.perf_counter()
    profile = calibrate(workload_of(cfg), world)
    out = Path(flags.get("out") or f"hardware_{profile.name}.yaml")
    save_profile(profile, out, header=f"# {profile.sources[0]}\n# overrides: {' '.join(overrides) or '(none)'}")
    print(f"calibrated {world} processes in {time.perf_counter() - start:.0f} s: matmul {profile.matmul_flops['fp32'] / 1e9:.3g} GFLOP/s "
          f"(fp32), memory {profile.memory_bandwidth / 1e9:.3g} GB/s, {profile.compute_units_per_node:.2f} compute units per node, "
          f"all-reduce over {world}: {profile.intra_node.bandwidth / 1e9:.3g} GB/s")
    print(f"profile written to {out}; use it with strategy.hardware={out}")
    return 0
