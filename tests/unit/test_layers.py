"""Who imports whom: no import cycle anywhere in the package, the neutral modules (capabilities, the strategy protocol) and the callbacks import no
strategy, the planner imports neither torch nor matplotlib, the package root holds only the modules meant to be
there, and the names that moved out of ``parallelkit.strategies`` are still importable from there."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import parallelkit

# A fresh interpreter: this test process has long imported every strategy.
_LOADED = """
import importlib, pkgutil, sys
for module in {modules!r}:
    importlib.import_module(module)
for package in {packages!r}:  # and every module of these packages
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        importlib.import_module(package + "." + info.name)
print(" ".join(sorted(m for m in sys.modules if m.startswith({prefixes!r}))))
"""

# The package root: what starts and runs a job, the one-line modules that keep the commands' public names
# (``python -m parallelkit.plan`` runs ``parallelkit.tools.plan``), and neutral modules that several layers share.
# Anything else has a role, and a subpackage of that role: tools/, planner/, distributed/, ...
ENTRY_AND_RUN = {"__init__", "__main__", "run", "run_dir", "config_check", "optim", "console", "csv_logger"}
COMMANDS = {"plan", "verify", "export"}
NEUTRAL = {"errors", "capabilities", "strategy_protocol", "hashing", "process_stats"}


def loaded_after_importing(modules: list[str], packages: tuple[str, ...] = ("parallelkit.callbacks",),
                           prefixes: tuple[str, ...] = ("parallelkit.strategies", "parallelkit.ps")) -> list[str]:
    code = _LOADED.format(modules=modules, packages=packages, prefixes=prefixes)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return proc.stdout.split()


def test_callbacks_and_neutral_modules_import_no_strategy():
    neutral = [f"parallelkit.{name}" for name in sorted(NEUTRAL)]
    assert loaded_after_importing(neutral) == []
    # The data sets and the parameter server share their hash and process counters through neutral modules.
    assert loaded_after_importing(["parallelkit.data.ctr"], packages=(), prefixes=("parallelkit.ps",)) == []
    assert loaded_after_importing(["parallelkit.ps.server"], packages=(), prefixes=("parallelkit.callbacks",)) == []
    # Negative control: the same check sees a strategy when one is imported.
    assert "parallelkit.strategies.base" in loaded_after_importing(["parallelkit.strategies.base"])


def test_moved_names_are_importable_from_their_old_modules():
    import parallelkit.capabilities as capabilities
    import parallelkit.strategy_protocol as strategy_protocol
    from parallelkit.strategies import base, protocol

    for name in ("DDP_COMM_HOOK", "REPLICATED_PARAMS", "LIGHTNING_BACKWARD", "SERVER_TABLES", "SPARSE_GRADIENTS",
                 "require_capabilities"):
        assert getattr(base, name) is getattr(capabilities, name)
    for name in ("StrategyProtocol", "ForeignStrategy", "as_protocol"):
        assert getattr(protocol, name) is getattr(strategy_protocol, name)


def test_the_planner_imports_neither_torch_nor_matplotlib():
    # strategy=auto plans thousands of ranks as arithmetic: the dry run's torch and the drawing's matplotlib are
    # imported inside the functions that need them.
    assert loaded_after_importing([], packages=("parallelkit.planner",), prefixes=("torch", "matplotlib")) == []
    # Negative control: the same check sees matplotlib when it is imported.
    assert "matplotlib" in loaded_after_importing(["matplotlib"], packages=(), prefixes=("matplotlib",))


def test_the_package_root_holds_only_entry_points_commands_and_neutral_modules():
    root = Path(parallelkit.__file__).parent
    assert {p.stem for p in root.glob("*.py")} == ENTRY_AND_RUN | COMMANDS | NEUTRAL
    for name in COMMANDS:  # each only re-exports its tools module: the code lives in parallelkit.tools
        tree = ast.parse((root / f"{name}.py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert imported - {"__future__"} == {f"parallelkit.tools.{name}"}, name
        assert sum(isinstance(node, (ast.FunctionDef, ast.ClassDef)) for node in ast.walk(tree)) == 0, name


def import_graph(root: Path) -> dict[str, set[str]]:
    """``module → parallelkit modules it imports``, at any depth (imports inside functions too: a cycle through
    a lazy import is still a cycle of responsibilities)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def owner(name: str) -> str | None:  # `from parallelkit.x import y`: the module y, else the module x
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("parallelkit"):
                targets = [owner(f"{node.module}.{alias.name}") for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [owner(alias.name) for alias in node.names if alias.name.startswith("parallelkit")]
            else:
                continue
            graph[name] |= {t for t in targets if t and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_in_the_package():
    graph = import_graph(Path(parallelkit.__file__).parent)
    assert "parallelkit.run" in graph["parallelkit.launch.cli"]  # the graph sees imports inside functions
    assert cycles(graph) == []
    # Negative control: the launch cycle this package once had (run → local_launch → local_child → cli → run) is found.
    old = {**graph, "parallelkit.run": graph["parallelkit.run"] | {"parallelkit.launch.cli"}}
    assert any({"parallelkit.run", "parallelkit.launch.cli"} <= set(c) for c in cycles(old))
