"""``python -m parallelkit.verify <overrides>``: does this configuration train like one process?

The project's correctness contract (README.md, "Correctness is a contract") says that every exact strategy reproduces
``strategy=single``'s per-step ``train_loss`` with the same seed, model, data and global batch. This runs
``train.py`` twice for a few steps — once with the given overrides, once as ``strategy=single`` on one
process with everything else the same — and prints both losses per step, their relative difference and the
first step beyond ``--rtol``.

Exit codes: 0 every step within tolerance; 1 a step differs (named); 2 bad overrides (either run refused
its configuration); 3 a run failed otherwise.

The reference drops what cannot apply to one process: the strategy and its ``strategy.*`` settings, the
process count, and callbacks that refuse ``strategy=single`` (communication techniques such as
``local_sgd`` or ``dgc``, which have no traffic to change there — the comparison then shows what they
change). Validation is skipped in both runs (``trainer.limit_val_batches=0``): only training steps count.

Example::

    python -m parallelkit.verify strategy=hybrid4d strategy.tp=2 strategy.pp=2 trainer.devices=4 --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from parallelkit.errors import ConfigError
from parallelkit.planner.inputs import compose_config

# The installed entry point (the same run as train.py, the packaged configs): works from any directory.
TRAIN_COMMAND = [sys.executable, "-m", "parallelkit"]
EXIT_OK, EXIT_DIFFERS, EXIT_CONFIG_ERROR, EXIT_RUN_FAILED = 0, 1, 2, 3
# Overrides that describe the parallel layout (or where/how long to run): not part of the reference.
_LAYOUT_KEYS = ("strategy", "trainer.devices", "trainer.num_nodes", "trainer.max_steps", "hydra.run.dir")
# Set by verify for both runs (a few steps, no validation, quiet).
_RUN_KEYS = ("trainer.max_steps", "trainer.limit_val_batches", "trainer.enable_progress_bar", "trainer.enable_model_summary",
             "hydra.run.dir")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _is_layout(override: str) -> bool:
    key = _key(override)
    return key in _LAYOUT_KEYS or key.startswith("strategy.")


def single_process_callbacks(cfg: Any) -> tuple[list[str], list[str]]:
    """``(kept, dropped)`` callback names: dropped are those that refuse ``strategy=single`` before launch."""
    from hydra.utils import instantiate

    from parallelkit.distributed.parallel_dims import ParallelDims
    from parallelkit.strategies.single import SingleStrategy

    kept, dropped = [], []
    for name, node in (cfg.get("callbacks") or {}).items():
        callback = instantiate(node)
        try:
            if callable(getattr(callback, "check_strategy", None)):
                callback.check_strategy(SingleStrategy(), ParallelDims(1))
            kept.append(name)
        except ConfigError:
            dropped.append(name)
    return kept, dropped


def reference_overrides(overrides: list[str], cfg: Any) -> tuple[list[str], list[str]]:
    """The ``strategy=single`` overrides for the same workload, and the callbacks left out of it."""
    kept, dropped = single_process_callbacks(cfg)
    ref = [o for o in overrides if not _is_layout(o)]
    if dropped:
        ref = [o for o in ref if _key(o) != "callbacks" and not any(_key(o).startswith(f"callbacks.{d}.") for d in dropped)]
        ref.append(f"callbacks=[{','.join(kept)}]" if kept else "callbacks=[]")
    return [*ref, "strategy=single", "trainer.devices=1"], dropped


def run_train(overrides: list[str], run_dir: Path, steps: int, timeout: float) -> dict[str, Any]:
    """``train.py`` for ``steps`` optimizer steps in ``run_dir``; its summary.json (raises on failure)."""
    overrides = [o for o in overrides if _key(o) not in _RUN_KEYS]  # set below for both runs alike
    args = [*overrides, f"trainer.max_steps={steps}", "trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.run([*TRAIN_COMMAND, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=run_dir.parent)
    if run_dir.is_dir():  # the run's own output stays beside its summary (with --run-dir)
        (run_dir / "train.out").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RunFailed(proc.returncode, args, proc.stderr)
    return json.loads((run_dir / "summary.json").read_text())


class RunFailed(RuntimeError):
    def __init__(self, code: int, args: list[str], stderr: str) -> None:
        tail = "\n".join(stderr.strip().splitlines()[-15:])
        super().__init__(f"train.py {' '.join(args)} exited {code}:\n{tail}")
        self.code = code


def compare(reference: list[float], other: list[float], rtol: float) -> tuple[list[float], int | None]:
    """Per-step relative differences ``|other − ref| / |ref|`` and the first 1-based step beyond ``rtol``."""
    if len(reference) != len(other):
        raise ValueError(f"the runs logged {len(reference)} and {len(other)} steps")
    diffs = [abs(b - a) / max(abs(a), 1e-12) for a, b in zip(reference, other)]
    first = next((i + 1 for i, d in enumerate(diffs) if not d <= rtol), None)  # `not <=`: NaN fails too
    return diffs, first


def format_report(name: str, reference: list[float], other: list[float], diffs: list[float], rtol: float,
                  first: int | None) -> str:
    lines = [f"{'step':>4} | {'single':>12} | {name:>12} | rel. diff", *(
        f"{i:4d} | {a:12.7f} | {b:12.7f} | {d:.2e}{'  > rtol' if not d <= rtol else ''}"
        for i, (a, b, d) in enumerate(zip(reference, other, diffs), 1))]
    if first is None:
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        lines.append(f"OK: all {len(diffs)} steps within rtol={rtol:g} (largest {diffs[worst]:.2e} at step {worst + 1}).")
    else:
        bad = sum(not d <= rtol for d in diffs)
        lines.append(f"DIFFERS: step {first} is the first beyond rtol={rtol:g} (rel. diff {diffs[first - 1]:.2e}; "
                     f"{bad} of {len(diffs)} steps beyond).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallelkit.verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="train.py overrides of the configuration to check")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run (default 5)")
    parser.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance per step (default 1e-4)")
    parser.add_argument("--run-dir", type=Path, default=None, help="keep both runs here (default: a temporary directory)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run before it counts as hung")
    args = parser.parse_args(argv)
    if args.steps < 1 or not args.rtol >= 0:
        print(f"parallelkit.verify: error: --steps must be ≥ 1 and --rtol ≥ 0 (got {args.steps}, {args.rtol}).", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    held = [d for d in ("config", "single") if args.run_dir and (args.run_dir / d).is_dir() and any((args.run_dir / d).iterdir())]
    if held:
        # train.py keeps a run directory's history: it would not train again there, and this check would compare old runs.
        print(f"parallelkit.verify: error: --run-dir {args.run_dir} already holds runs ({', '.join(held)}/); give an empty "
              "or new directory.", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = compose_config(args.overrides)  # bad overrides fail here, in one message, before any run
        reference, dropped = reference_overrides(args.overrides, cfg)
        compose_config(reference)
    except (HydraException, OmegaConfBaseException, ValueError) as err:  # ConfigError is a ValueError
        print(f"parallelkit.verify: error: the overrides do not compose: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    with tempfile.TemporaryDirectory(prefix="pk_verify_") as tmp:
        base = (args.run_dir or Path(tmp)).resolve()
        base.mkdir(parents=True, exist_ok=True)
        print(f"parallelkit.verify: {' '.join(args.overrides) or '(defaults)'}  vs  strategy=single, "
              f"{args.steps} steps, rtol {args.rtol:g}" + (f" (reference without callbacks {dropped})" if dropped else ""),
              flush=True)
        try:
            other = run_train(args.overrides, base / "config", args.steps, args.timeout)
            single = run_train(reference, base / "single", args.steps, args.timeout)
        except RunFailed as err:
            print(f"parallelkit.verify: error: {err}", file=sys.stderr)
            return EXIT_CONFIG_ERROR if err.code == EXIT_CONFIG_ERROR else EXIT_RUN_FAILED
        except subprocess.TimeoutExpired as err:
            print(f"parallelkit.verify: error: a run took longer than {err.timeout:g} s: {' '.join(err.cmd[2:])}", file=sys.stderr)
            return EXIT_RUN_FAILED
    if other["global_batch_size"] != single["global_batch_size"]:
        print(f"parallelkit.verify: error: the global batches differ ({other['global_batch_size']} vs "
              f"{single['global_batch_size']}); set data.global_batch_size.", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    diffs, first = compare(single["train_loss"], other["train_loss"], args.rtol)
    name = f"{other['strategy']}×{other['world_size']}"
    print(format_report(name, single["train_loss"], other["train_loss"], diffs, args.rtol, first))
    return EXIT_OK if first is None else EXIT_DIFFERS


if __name__ == "__main__":
    sys.exit(main())
