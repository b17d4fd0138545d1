"""``python -m parallelkit.checkpoint inspect CKPT`` and ``convert CKPT OUT strategy=...``, offline, in one process.

``inspect`` prints the layout a checkpoint was written by (read from the checkpoint itself, and from the run's
``.hydra/config.yaml`` when it sits in a run directory), the step and epoch, its tensors with shape, dtype and
bytes, and what it can be loaded into. It reads shapes only: no tensor data.

``convert`` rewrites a checkpoint tensor by tensor (peak memory: the largest tensor plus the non-tensor state; a
DeepSpeed directory is read whole, its partitions being flat buffers with a piece of every parameter) into
the form a strategy writes: ``strategy=single`` or ``ddp`` (also ``zero`` stage 1/2) → one file; ``strategy=tp``,
``pp``, ``zero`` stage 3, ``hybrid4d`` → a sharded directory. A sharded directory holds full tensors per name, so
any degree and device count loads it (DCP reads each rank's slice): ``trainer.devices``/degrees need no conversion.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from parallelkit.checkpoint.sources import Checkpoint, deepspeed_as_canonical, open_checkpoint
from parallelkit.errors import ConfigError

EXIT_CONFIG_ERROR = 2
ONE_FILE = ("single", "ddp", "ddp_fp16", "auto")
SHARDED = ("tp", "pp", "zero", "hybrid4d", "moe")
#: what a continuation (``ckpt_path=``) accepts, as tests/integration/test_layout_change_resume.py and
#: test_context_parallel_train.py check, from every kind of checkpoint (one file, sharded directory, DeepSpeed's).
LOADS_INTO = ("single, ddp, zero stage 1/2/3, tp, pp, hybrid4d (incl. context parallel), deepspeed stage 1/2/3 (also offloaded), "
              "at any device count and degrees")
NOT_YET = "deepspeed stage 0: from its own DeepSpeed directories only (strategy=ddp continues any checkpoint)"


def describe_layout(ckpt: Checkpoint) -> dict[str, Any]:
    """The strategy and degrees a checkpoint was written with, from what it holds."""
    ev = ckpt.evidence
    if ckpt.kind == "deepspeed":
        out: dict[str, Any] = {"layout": f"strategy=deepspeed, ZeRO stage {ev['zero_stage']}, data parallel {ev['dp_world_size']} ({ev['degrees']})"}
    elif ckpt.kind == "file":
        out = {"layout": "one file: strategy=single, ddp or zero stage 1/2 (ranks' state gathered into one file)"}
    else:
        ranks = ev["writer_ranks"]
        chunks = ev["chunks"]
        split = {name: c for name, c in chunks.items() if len(c) > 1}
        along_later = [n for n, c in split.items() if any(any(off[1:]) for off, _ in c)]
        degree = max((len(c) for c in split.values()), default=1)
        parts = []
        keyed = [k for opt in ckpt.optimizers for k in opt.get("keyed_groups", [])]
        if keyed:
            parts.append(f"pipeline parallel ({len(keyed)} per-stage optimizer group sets: {', '.join(keyed)})")
        if along_later:
            parts.append(f"tensor parallel, degree {degree} ({len(split)} tensors split, {len(along_later)} along a dimension other than 0)")
        elif split:
            parts.append(f"ZeRO 3 / FSDP, degree {degree} ({len(split)} of {len(chunks)} parameters split along dimension 0)")
        out = {
            "layout": f"sharded directory written by {ranks} ranks: "
            + ("; ".join(parts) or "every parameter whole on each rank (ddp-like, or ZeRO 1/2, whose optimizer shards are saved whole)")
        }
    config = ckpt.path.parent.parent / ".hydra" / "config.yaml"
    if config.is_file():
        import yaml

        strategy = (yaml.safe_load(config.read_text()) or {}).get("strategy") or {}
        trainer = (yaml.safe_load(config.read_text()) or {}).get("trainer") or {}
        settings = {k: v for k, v in strategy.items() if k != "_target_" and v not in (None, False)}
        out["run_config"] = f"{strategy.get('_target_', '?')} {settings} devices={trainer.get('devices')}"
    return out


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def inspect(path: str | Path, show_all: bool = False, out=sys.stdout) -> Checkpoint:
    ckpt = open_checkpoint(path)
    tensors = ckpt.tensors()
    layout = describe_layout(ckpt)
    print(f"checkpoint: {ckpt.path}", file=out)
    print(f"format:     {ckpt.evidence['format']}", file=out)
    print(f"layout:     {layout['layout']}", file=out)
    if "run_config" in layout:
        print(f"run config: {layout['run_config']}", file=out)
    print(f"step:       {ckpt.meta.get('global_step')}  epoch: {ckpt.meta.get('epoch')}", file=out)
    print(f"state:      {', '.join(sorted(k for k in ckpt.meta if k not in ('state_dict',)))}", file=out)
    total = sum(t.nbytes for t in tensors.values())
    groups: dict[str, list] = {}
    for name, t in tensors.items():
        groups.setdefault(name.split(".")[0] if name.startswith("state_dict") else ".".join(name.split(".")[:2]) + " ." + name.rsplit(".", 1)[1], []).append(t)
    print(f"tensors:    {len(tensors)}, {_size(total)} ({total} bytes)", file=out)
    width = max((len(k) for k in groups), default=0)
    for key, ts in groups.items():
        dtypes = sorted({str(t.dtype).replace("torch.", "") for t in ts})
        print(f"  {key:<{width}} {len(ts):>5} tensors  {'/'.join(dtypes):<10} {_size(sum(t.nbytes for t in ts)):>10}", file=out)
    if show_all:
        for name, t in tensors.items():
            print(f"  {name:<60} {list(t.shape)!s:<16} {str(t.dtype).replace('torch.', ''):<9} {t.nbytes:>12}", file=out)
    else:
        largest = max(tensors.items(), key=lambda kv: kv[1].nbytes, default=None)
        if largest:
            print(f"  largest: {largest[0]} {list(largest[1].shape)} ({_size(largest[1].nbytes)}); --all lists every tensor", file=out)
    print(f"loads into: {LOADS_INTO} (ckpt_path=...; no conversion needed)", file=out)
    print(f"            not into: {NOT_YET}", file=out)
    return ckpt


def target_form(overrides: list[str]) -> str:
    """``"file"`` or ``"sharded"``: the form the strategy named in ``overrides`` writes."""
    values = dict(o.split("=", 1) for o in overrides if "=" in o)
    unknown = [o for o in overrides if "=" not in o]
    if unknown:
        raise ConfigError(f"convert takes key=value overrides; got {unknown}. Example: strategy=single or strategy=tp strategy.tp=2 trainer.devices=2.")
    strategy = values.get("strategy")
    if strategy is None:
        raise ConfigError("convert needs strategy=NAME: strategy=single (or ddp) for one file, strategy=tp/pp/zero/hybrid4d for a sharded directory.")
    if strategy == "zero" and values.get("strategy.stage", "3") in ("1", "2"):
        return "file"
    if strategy in ONE_FILE:
        return "file"
    if strategy in SHARDED:
        return "sharded"
    if strategy == "deepspeed":
        raise ConfigError("convert writes no DeepSpeed directories: strategy=deepspeed (stage 1-3) continues from any checkpoint as it is "
                          "(ckpt_path=...). To convert, name strategy=single or strategy=zero.")
    raise ConfigError(f"strategy={strategy} is not a strategy convert writes for; use one of {', '.join(ONE_FILE + SHARDED)}.")


def convert(path: str | Path, out: str | Path, overrides: list[str]) -> tuple[Path, str]:
    from parallelkit.checkpoint.writers import write_file, write_sharded

    form = target_form(overrides)
    out = Path(out)
    if out.exists():
        raise ConfigError(f"{out} already exists; convert writes a new file or directory (nothing is overwritten).")
    if not out.parent.is_dir():
        raise ConfigError(f"{out.parent} is not a directory: create it first, or give OUT inside an existing directory.")
    ckpt = open_checkpoint(path)
    if ckpt.kind == "deepspeed":
        ckpt = deepspeed_as_canonical(ckpt)  # read whole: its partitions are flat buffers with a piece of every parameter
    return (write_file(ckpt, out) if form == "file" else write_sharded(ckpt, out)), form


def main(argv: list[str] | None = None) -> int:
    import os

    import torch

    if not torch.cuda.is_available():  # DeepSpeed (imported to read its checkpoints) would warn
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    parser = argparse.ArgumentParser(prog="python -m parallelkit.checkpoint", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("inspect", help="layout, step, tensors, sizes, what it loads into")
    show.add_argument("checkpoint", help="a checkpoint file or directory (e.g. outputs/RUN/checkpoints/last.ckpt)")
    show.add_argument("--all", action="store_true", help="list every tensor, not a summary")
    change = commands.add_parser("convert", help="rewrite into the form a strategy writes, tensor by tensor")
    change.add_argument("checkpoint")
    change.add_argument("out", help="a new file (strategy=single/ddp) or directory (tp/pp/zero/hybrid4d)")
    change.add_argument("overrides", nargs="*", help="strategy=NAME [strategy.*=... trainer.devices=N]")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            inspect(args.checkpoint, show_all=args.all)
            return 0
        out, form = convert(args.checkpoint, args.out, args.overrides)
    except ConfigError as err:
        print(f"parallelkit: error: {err}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    what = "one file" if form == "file" else "a sharded directory (any device count and degrees load it)"
    print(f"parallelkit: converted {args.checkpoint} to {out}: {what}; continue with ckpt_path={out} {' '.join(args.overrides)}")
    return 0
