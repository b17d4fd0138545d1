"""The tables of docs/planner.md that planner commands produce, regenerated in place between their markers.

    python -m parallelkit.planner.docs_tables            # rewrite them (docs/planner.md)
    python -m parallelkit.planner.docs_tables --check    # exit 1 naming the tables that differ

Each table sits between ``<!-- generated: NAME (COMMAND) -->`` and ``<!-- end generated: NAME -->``;
``tests/unit/test_planner_docs_tables.py`` fails when a file differs from what the command prints now.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def validation_table() -> str:
    """``python -m parallelkit.planner.validation``'s table: every published run, with strategy=auto's answer."""
    from parallelkit.planner.validation import runs, table, validate

    return table([validate(name, run) for name, run in runs().items()])


def profiles_table() -> str:
    """The named hardware profiles' figures (``parallelkit/planner/profiles/``): per GPU and per node."""
    from parallelkit.planner.hardware import load_profile, named_profiles

    lines = ["| profile | backend | matmul bf16 | memory bandwidth | inside a node (bus bw) | between nodes, per GPU (p2p, all-to-all) "
             "| ring across nodes, all GPUs of a node (node aggregate) | sources |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name in named_profiles():
        hw = load_profile(name)
        ring_bw = hw.ring_bandwidth(hw.devices_per_node)
        lines.append(f"| `{name}` | {hw.backend} | {hw.flops('bf16') / 1e12:.4g} TFLOP/s | {hw.memory_bandwidth / 1e12:.3g} TB/s "
                     f"| {hw.intra_node.bandwidth / 1e9:,.1f} GB/s | {hw.inter_node.bandwidth / 1e9:,.1f} GB/s | {ring_bw / 1e9:,.1f} GB/s "
                     f"| {len(hw.sources)} in the file |")
    return "\n".join(lines)


TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "validation": ("python -m parallelkit.planner.validation", validation_table),
    "profiles": ("python -m parallelkit.planner.docs_tables", profiles_table),
}
FILES = {"docs/planner.md": ("profiles", "validation")}


def block(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- generated: {name} \([^)]*\) -->)(.*?)(<!-- end generated: {name} -->)", re.S)


def regenerate(text: str, names: tuple[str, ...], tables: dict[str, str]) -> str:
    """``text`` with each named block replaced by its table (a block missing from the text is an error)."""
    for name in names:
        pattern = block(name)
        if not pattern.search(text):
            raise ValueError(f"no generated block {name!r} (<!-- generated: {name} (...) --> … <!-- end generated: {name} -->)")
        text = pattern.sub(lambda m, t=tables[name]: m.group(1) + "\n" + t + "\n" + m.group(3), text)
    return text


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    check = "--check" in args
    tables = {name: make() for name, (_, make) in TABLES.items()}
    stale = []
    for rel, names in FILES.items():
        path = ROOT / rel
        old = path.read_text()
        new = regenerate(old, names, tables)
        if new != old:
            stale.append(rel)
            if not check:
                path.write_text(new)
    if check and stale:
        print("tables differ from their commands in: " + ", ".join(stale) + " (python -m parallelkit.planner.docs_tables rewrites them)")
        return 1
    print(("rewrote " + ", ".join(stale)) if stale else "every generated table matches its command")
    return 0


if __name__ == "__main__":
    sys.exit(main())
