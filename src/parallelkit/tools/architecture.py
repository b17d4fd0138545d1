"""The package's import layers, read from the code: each module's ``parallelkit`` imports (at module level and
inside functions), the layer table they must respect, and docs/architecture.md's layers section made from both.

    python -m parallelkit.tools.architecture            # rewrite the section (docs/architecture.md)
    python -m parallelkit.tools.architecture --check    # exit 1 if it differs from the code

A module may import its own layer and the layers below it. ``tests/unit/test_layers.py`` holds the rule (every
import that goes up is listed there with its reason) and fails when the section differs from what this prints.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
ROOT = PACKAGE.parents[1]
DOC = "docs/architecture.md"

# The layers, bottom first: (name, units, what they hold). A unit is a module of the package root (``run``) or a
# subpackage (``data/``, every module inside it). Derived from the import graph (a unit sits above everything
# it imports); ``--check`` and the test fail when a unit is missing or an import goes up.
LAYERS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("shared", ("__init__", "errors", "hashing", "process_stats", "capabilities", "console", "deferred_imports", "config_check",
                "optim", "run_dir", "csv_logger"),
     "errors, one hash, process counters, capability names, console quieting, transformers imported on first use, "
     "config-key and optim= checks, "
     "what a run directory holds"),
    ("data", ("data/",), "data modules, sharded by the data-parallel rank, resumable"),
    ("distributed", ("distributed/",), "one technique per module (`ParallelDims` → `DeviceMesh`, `apply_tp`, `apply_fsdp`, …), "
                                       "traffic counting, checkpoint I/O"),
    ("bridges", ("ps/", "strategy_protocol"), "the parameter-server bridge; the steps `run.py` takes with any strategy"),
    ("models", ("models/",), "single-device models with their `parallelize.py` plans; the LightningModule contract"),
    ("planner and callbacks", ("planner/", "callbacks/"),
     "cost model and search (`strategy=auto`), per-rank dry run; Lightning callbacks that act on a step"),
    ("strategies", ("strategies/",), "one Lightning strategy per name, composing the techniques"),
    ("tools", ("tools/", "checkpoint/"), "the commands' code: plan, verify, export, predict, checkpoint conversion"),
    ("run", ("run", "run_config", "job"), "assemble from the composed config and fit; the job around it (predict, teardown)"),
    ("launch", ("launch/",), "Hydra's main, exit codes, the local ranks; hands its hooks to the run"),
    ("entry", ("__main__", "plan", "verify", "export"), "`python -m parallelkit` and the commands' public names"),
)


@dataclass(frozen=True)
class Import:
    importer: str  # parallelkit.x.y
    imported: str  # the parallelkit module it names (a package's __init__: the package)
    line: int
    in_function: bool  # inside a function or method (imported when called), not at module level


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """``parallelkit.x.y`` → its file; a package's ``__init__.py`` is the package."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _owner(name: str, known: dict[str, Path]) -> str | None:
    """``parallelkit.x.y`` if it is a module, else the module that defines it (``from parallelkit.x import y``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, known: dict[str, Path]) -> list[Import]:
    """Every ``parallelkit`` import in ``path``, absolute or relative, at module level or inside a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:  # relative: from the importing module's package, one level up per extra dot
                    anchor = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" for alias in child.names]
            for target in targets:
                owner = _owner(target, known) if target.split(".")[0] == "parallelkit" else None
                if owner and owner != name:
                    found.append(Import(name, owner, child.lineno, in_function))
            visit(child, inside)

    visit(ast.parse(path.read_text()), False)
    return found


def all_imports(package: Path = PACKAGE) -> list[Import]:
    known = modules(package)
    return [imp for name, path in known.items() for imp in imports_of(name, path, known)]


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """``module → parallelkit modules it imports``, at any depth."""
    graph: dict[str, set[str]] = {name: set() for name in modules(package)}
    for imp in all_imports(package):
        graph[imp.importer].add(imp.imported)
    return graph


def unit(module: str) -> str:
    """``parallelkit.data.text`` → ``data/``; ``parallelkit.run`` → ``run``; ``parallelkit`` → ``__init__``."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return f"{parts[1]}/" if (PACKAGE / parts[1]).is_dir() else parts[1]


def layer(module: str) -> int | None:
    """The index in :data:`LAYERS` of the layer holding ``module`` (``None``: in no layer)."""
    return next((i for i, (_, units, _) in enumerate(LAYERS) if unit(module) in units), None)


def upward(imports: list[Import]) -> list[Import]:
    """The imports from a layer into a layer above it."""
    return [imp for imp in imports if (layer(imp.imported) or 0) > (layer(imp.importer) or 0)]


def layers_section(imports: list[Import] | None = None) -> str:
    """docs/architecture.md's table: the layers top first, each with what it imports from the layers below."""
    imports = all_imports() if imports is None else imports
    below: dict[int, set[str]] = {}
    for imp in imports:
        a, b = layer(imp.importer), layer(imp.imported)
        if a is not None and b is not None and b < a:
            below.setdefault(a, set()).add(unit(imp.imported))
    def shown(units: list[str] | tuple[str, ...]) -> str:
        return ", ".join(f"`{u if u.endswith('/') else u + '.py'}`" for u in units)

    lines = ["| layer | modules (`src/parallelkit/`) | holds | imports from the layers below |", "|---|---|---|---|"]
    for i in reversed(range(len(LAYERS))):
        name, units, holds = LAYERS[i]
        used = sorted(below.get(i, ()), key=lambda u: (-next(j for j, (_, us, _) in enumerate(LAYERS) if u in us), u))
        lines.append(f"| {i + 1}. {name} | {shown(units)} | {holds} | {shown(used) or '—'} |")
    return "\n".join(lines)


def block() -> re.Pattern[str]:
    return re.compile(r"(<!-- generated: layers \([^)]*\) -->)(.*?)(<!-- end generated: layers -->)", re.S)


def regenerate(text: str, section: str) -> str:
    """``text`` with its layers block replaced by ``section`` (a text without the block is an error)."""
    if not block().search(text):
        raise ValueError("no generated block 'layers' (<!-- generated: layers (...) --> … <!-- end generated: layers -->)")
    return block().sub(lambda m: m.group(1) + "\n" + section + "\n" + m.group(3), text)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    path = ROOT / DOC
    old = path.read_text()
    new = regenerate(old, layers_section())
    if new == old:
        print(f"{DOC}: the layers section matches the code")
        return 0
    if "--check" in args:
        print(f"{DOC}: the layers section differs from the code (python -m parallelkit.tools.architecture rewrites it)")
        return 1
    path.write_text(new)
    print(f"rewrote {DOC}'s layers section")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
