"""Tables a benchmark produces are produced by it: every table of docs/benchmarks.md (and any table of README.md or
docs/ so marked) sits between ``<!-- table: bench/NAME.py [PART] -->`` markers, and rendered again from ``bench/results/NAME.json`` by the
benchmark's own function (what ``python bench/NAME.py --table`` prints) it must equal the page.
``python bench/docs_tables.py`` rewrites them after a benchmark ran. (The planner's tables:
tests/unit/test_planner_docs_tables.py.)"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_docs_tables", REPO / "bench" / "docs_tables.py")
docs_tables = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = docs_tables
_spec.loader.exec_module(docs_tables)


def test_every_marked_table_matches_its_results():
    assert docs_tables.MARKER.findall(docs_tables.PAGE.read_text()), "no marked tables found"
    stale = {page.relative_to(REPO).as_posix(): docs_tables.differences(page.read_text()) for page in docs_tables.PAGES}
    stale = {page: names for page, names in stale.items() if names}
    assert not stale, f"tables differ from their results: {stale}; run `python bench/docs_tables.py`"


def test_every_table_of_the_page_is_a_generated_one():
    """A table typed into the page by hand (outside the markers) would drift from its command unseen."""
    text = docs_tables.MARKER.sub("", docs_tables.PAGE.read_text())
    hand = [line for line in text.splitlines() if line.startswith("|")]
    assert not hand, hand[:3]


def test_a_perturbed_table_is_detected_and_rewritten():
    """Negative control: one figure changed in one table is named, and regeneration restores the page."""
    text = docs_tables.PAGE.read_text()
    row = "| 2 | zero stage 3 | 1.59 | 1.59 | 3.18 | 6.37 | 6.37 | 1.000 |"
    assert text.count(row) == 1
    perturbed = text.replace(row, row.replace("| 6.37 | 6.37 | 1.000 |", "| 6.37 | 6.37 | 1.001 |"))
    assert docs_tables.differences(perturbed) == ["bench/memory.py"]
    assert docs_tables.regenerate(perturbed) == text
    # A table cut short (a row dropped) is caught the same way, in a benchmark with several tables.
    rpc = "| 2 × 2 | 16,384 |"
    lines = text.splitlines(keepends=True)
    dropped = "".join(line for line in lines if not line.startswith(rpc))
    assert docs_tables.differences(dropped) == ["bench/parameter_server.py rpc"]


# ------------------------------------------------------------------ the README's headline figures
def headline_misses(readme: str, page: str) -> list[str]:
    """Each figure of the README's "Measured results" table that the benchmarks page section it links to lacks."""
    section = readme.split("\n## Measured results", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    assert rows, "the README has no Measured results table"
    misses = []
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        anchor = re.search(r"\(docs/benchmarks\.md#([^)]+)\)", cells[-1]).group(1)
        headings = [h for h in re.split(r"\n(?=## )", page) if _anchor(h.splitlines()[0]) == anchor]
        assert len(headings) == 1, anchor
        for figure in re.findall(r"\d[\d,]*(?:\.\d+)?", cells[1]):
            if not re.search(rf"(?<![\d.,]){re.escape(figure)}(?![\d]|[.,]\d)", headings[0]):  # the whole number
                misses.append(f"{cells[0]}: {figure}")
    return misses


def _anchor(heading: str) -> str:
    title = heading.lstrip("#").strip().replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def test_the_readme_headline_figures_are_in_the_tables_they_link():
    readme, page = (REPO / "README.md").read_text(), docs_tables.PAGE.read_text()
    assert not headline_misses(readme, page)
    # Negative control: a figure the linked section does not hold.
    assert headline_misses(readme.replace("**1.242** × DDP", "**1.243** × DDP"), page) == [
        "ZeRO stage 3 step time, default GPT, 2 ranks: 1.243"]
