"""Tables a planner command produces are produced by it: regenerated, they must equal what the files hold.

docs/planner.md's validation table (``python -m parallelkit.planner.validation``) and hardware profile table
(``python -m parallelkit.planner.docs_tables``). The README has no planner table (its planner section is prose).
``python -m parallelkit.planner.docs_tables`` rewrites them.
"""

from __future__ import annotations

from parallelkit.planner import docs_tables


def test_generated_tables_match_their_commands():
    tables = {name: make() for name, (_, make) in docs_tables.TABLES.items()}
    for rel, names in docs_tables.FILES.items():
        text = (docs_tables.ROOT / rel).read_text()
        assert docs_tables.regenerate(text, names, tables) == text, (
            f"{rel}: a generated table differs from its command; run `python -m parallelkit.planner.docs_tables`")


def test_the_readme_has_no_planner_table_to_generate():
    readme = (docs_tables.ROOT / "README.md").read_text()
    assert "| run | source | layout" not in readme and "| profile | backend" not in readme
