"""The benchmark tables of docs/benchmarks.md, rendered from the results the benchmarks saved.

Each generated table of a page (docs/*.md, README.md) sits between ``<!-- table: bench/NAME.py -->`` (or ``bench/NAME.py PART`` where
one benchmark prints several) and ``<!-- /table -->``. It is what ``python bench/NAME.py --table`` prints: the
benchmark's own rendering of ``bench/results/NAME.json``, nothing measured again. After a benchmark ran:

    python bench/docs_tables.py            # rewrite the marked tables (today: all in docs/benchmarks.md)
    python bench/docs_tables.py --check    # exit 1 naming each marked table that differs from its results

``tests/unit/test_docs_tables.py`` runs the check.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "benchmarks.md"  # every table of it is generated (tests/unit/test_docs_tables.py)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- table: (bench/(\w+)\.py)(?: ([\w-]+))? -->\n(.*?)<!-- /table -->\n", re.S)


def render(script: str, part: str | None) -> str:
    """The table ``bench/NAME.py --table`` prints for ``part`` (``None``: its only table)."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    module = importlib.import_module(script)
    tables = module.tables(module.load_results())
    if part is None:
        if len(tables) != 1:
            raise KeyError(f"bench/{script}.py prints {len(tables)} tables: name one of {sorted(tables)} in the marker")
        return next(iter(tables.values()))
    return tables[part]


def regenerate(text: str) -> str:
    """``text`` with every marked table replaced by its rendering."""
    def replace(match: re.Match) -> str:
        head = match.group(0).split("\n", 1)[0]
        return f"{head}\n{render(match.group(2), match.group(3)).rstrip()}\n<!-- /table -->\n"

    return MARKER.sub(replace, text)


def differences(text: str) -> list[str]:
    """The markers whose table differs from its rendering."""
    return [f"{m.group(1)}{' ' + m.group(3) if m.group(3) else ''}" for m in MARKER.finditer(text)
            if m.group(4).rstrip() != render(m.group(2), m.group(3)).rstrip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only compare; exit 1 if a table differs")
    args = p.parse_args(argv)
    failed = False
    for page in PAGES:
        text = page.read_text()
        if not MARKER.search(text):
            continue
        stale = differences(text)
        if args.check:
            for name in stale:
                print(f"{page.relative_to(ROOT)}: the table of {name} differs from its results; run python bench/docs_tables.py")
            failed |= bool(stale)
            continue
        page.write_text(regenerate(text))
        print(f"{page.relative_to(ROOT)}: {len(MARKER.findall(text))} tables, {len(stale)} rewritten ({', '.join(stale) or 'none'})")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
