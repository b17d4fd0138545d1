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


# ------------------------------------------------------------------ relative links in the Markdown pages resolve
MARKDOWN_PAGES = [REPO / "README.md", *sorted(REPO.glob("docs/*.md")), REPO / "bench" / "README.md"]
_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code removed (a link inside either is not a link)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return lines


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings: the text as rendered (code spans and links reduced to their text),
    lower-cased, every character but letters, digits, ``_``, ``-`` and spaces dropped, spaces as ``-``; a
    repeated anchor gets ``-1``, ``-2``, ..."""
    anchors: set[str] = set()
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        title = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1))  # a link: its text
        title = re.sub(r"<[^>]+>", "", title).replace("`", "").replace("*", "")
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def broken_links(page: Path, text: str) -> list[str]:
    """Each relative link of ``text`` (the page ``page``) whose file or heading anchor does not exist."""
    broken = []
    for line in _prose(text):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md":
                if anchor not in heading_anchors(resolved.read_text() if path else text):
                    broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    return broken


def test_every_relative_markdown_link_resolves():
    """Links between the README, docs/ and bench/README.md point at files that exist and headings they have."""
    broken = [b for page in MARKDOWN_PAGES for b in broken_links(page, page.read_text())]
    assert not broken, broken


def test_the_link_check_finds_a_broken_link():
    """Negative control: a missing file, a missing heading and a missing heading of this page are each caught;
    links in code, external links and good anchors are not."""
    page = REPO / "README.md"
    text = ("# A title (`with code`), and × more\n\nSee [x](docs/no_such_page.md), [y](docs/sharding.md#no-such-heading),"
            " [z](#not-here), [ok](#a-title-with-code-and--more), [web](https://example.com/x.md#y),"
            " `[code](nowhere.md)` and [ok too](docs/sharding.md).\n\n```\n[fenced](nowhere.md)\n```\n")
    assert broken_links(page, text) == ["README.md: docs/no_such_page.md (no such file)",
                                        "README.md: docs/sharding.md#no-such-heading (no such heading)",
                                        "README.md: #not-here (no such heading)"]
    assert "slow-networks-python-benchslow_networkpy" in heading_anchors("### Slow networks (`python bench/slow_network.py`)")


def test_the_readme_lists_every_docs_page():
    """The README's Documentation section links every page of docs/ (a page no one links is not read)."""
    section = (REPO / "README.md").read_text().split("\n## Documentation", 1)[1].split("\n## ", 1)[0]
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)\)", section))
    pages = {p.relative_to(REPO).as_posix() for p in REPO.glob("docs/*.md")}
    assert pages - linked == set(), sorted(pages - linked)


def modules_not_named(text: str, root: Path) -> list[str]:
    """The package's modules and subpackages' modules (one level down) whose name ``text`` never mentions."""
    import re

    missing = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if path.stem != "__init__" and len(rel.parts) <= 2 and not re.search(rf"\b{re.escape(path.stem)}\b", text):
            missing.append(str(rel))
    return missing


def test_the_layout_page_names_every_module():
    """docs/layout.md is the newcomer's map of the source: a module added without a line there is a stale map."""
    root = REPO / "src" / "parallelkit"
    text = (REPO / "docs" / "layout.md").read_text()
    assert modules_not_named(text, root) == []
    # Negative control: a page without the word "job" misses parallelkit/job.py.
    assert "job.py" in modules_not_named(text.replace("job", "j-o-b"), root)
