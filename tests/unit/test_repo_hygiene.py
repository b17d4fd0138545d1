"""Small promises about the repository's own text: what it cites exists, its tables render."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = [*REPO.glob("src/**/*.py"), *REPO.glob("tests/**/*.py"), *REPO.glob("bench/**/*.py"), *REPO.glob("bench/*.md"),
           *REPO.glob("conf/**/*.yaml"), REPO / "pyproject.toml", REPO / "setup.py", REPO / "train.py"]


def test_every_markdown_file_the_code_cites_exists():
    """A project note named in code, configs or benchmarks (``README.md``: upper-case names; lower-case
    ones are other projects' pages or test data) is one of the repository's, not a note kept elsewhere."""
    present = {p.name for p in REPO.rglob("*.md") if ".venv" not in p.parts}
    cited = {(path.relative_to(REPO).as_posix(), name) for path in SOURCES
             for name in re.findall(r"\b([A-Z][A-Z0-9_]*\.md)\b", path.read_text(errors="replace"))}
    missing = sorted((where, name) for where, name in cited if name not in present)
    assert not missing, missing


def test_the_configs_name_modules_that_exist():
    """A dotted ``parallelkit.x.y`` in a config comment names a module of the package."""
    for path in REPO.glob("conf/**/*.yaml"):
        for dotted in re.findall(r"\bparallelkit(?:\.[a-z_0-9]+)+", path.read_text()):
            parts = dotted.split(".")
            # the module itself, or an attribute of its parent module
            candidates = [REPO / "src" / Path(*parts).with_suffix(".py"), REPO / "src" / Path(*parts) / "__init__.py",
                          REPO / "src" / Path(*parts[:-1]).with_suffix(".py")]
            assert any(c.is_file() for c in candidates), f"{path.relative_to(REPO)} names {dotted}, which does not exist"


def _tables(text: str) -> list[list[str]]:
    tables, block = [], []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append(line)
        elif block:
            tables.append(block)
            block = []
    return tables


def test_every_markdown_table_has_its_separator_row():
    """Without the ``|---|`` row under its header a table renders as text."""
    broken = []
    for path in [REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("bench/*.md")]:
        for table in _tables(path.read_text()):
            if len(table) < 2 or not re.fullmatch(r"\|(\s*:?-{3,}:?\s*\|)+", table[1].strip()):
                broken.append(f"{path.relative_to(REPO)}: {table[0][:80]}")
    assert not broken, broken
