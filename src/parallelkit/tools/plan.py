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
from parallelkit.planner.auto import auto_plan_from_config, estimate_fixed_layout, workload_of
from parallelkit.planner.calibrate import calibrate
from parallelkit.planner.dry_run import build_plan, format_plan
from parallelkit.planner.hardware import save_profile
from parallelkit.planner.inputs import compose_config
from parallelkit.planner.report import format_ranking, write_json

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


def chosen_as_hybrid4d(overrides: list[str], layout: Any) -> list[str]:
    """The overrides that train ``layout`` with ``strategy=hybrid4d`` (what ``strategy=auto`` resolves to)."""
    kept = [o for o in overrides if not o.lstrip("+~").startswith("strategy")]
    dims = layout.dims
    chosen = ["strategy=hybrid4d", *(f"strategy.{axis}={degree}" for axis, degree in dims.as_dict().items()),
              f"strategy.mesh_order=[{','.join(dims.mesh_order)}]", f"strategy.sequence_parallel={str(layout.sequence_parallel).lower()}"]
    if dims.cp > 1:
        chosen.append(f"strategy.cp_mode={layout.cp_mode}")
    if layout.pp > 1:
        chosen += [f"strategy.microbatches={layout.microbatches}", f"strategy.schedule={layout.schedule}"]
        if layout.virtual_stages > 1:
            chosen.append(f"strategy.virtual_stages={layout.virtual_stages}")
    else:
        kept = [o for o in kept if not o.startswith("trainer.accumulate_grad_batches")]
        chosen.append(f"trainer.accumulate_grad_batches={layout.accumulate}")
    return [*kept, *chosen]


def main(argv: list[str] | None = None) -> int:
    """``python -m parallelkit.plan [overrides] [--png PATH] [--json PATH] [--top N] [--hardware NAME|PATH]
    [--ranks-limit N] [--calibrate [--out PATH]]``: exit code 0, or 2 on bad input."""
    try:
        overrides, flags = parse(list(sys.argv[1:] if argv is None else argv))
        if flags["calibrate"]:
            return run_calibration(overrides, flags)
        cfg = compose_config(overrides)
        if cfg.strategy.get("_target_") == AUTO_TARGET:
            start = time.perf_counter()
            plan = auto_plan_from_config(cfg)
            seconds = time.perf_counter() - start
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
        plan = build_plan(overrides)
        if cfg.strategy.get("_target_") != AUTO_TARGET and flags.get("hardware"):
            print(estimate_fixed_layout(cfg, flags["hardware"], plan.dims))  # the degrees the strategy resolved
    except ConfigError as err:
        print(f"Error: {err}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    from parallelkit.planner.plot import draw_plan  # matplotlib: only when drawing

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
