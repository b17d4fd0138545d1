"""Who imports whom: no import goes up the layers (:data:`parallelkit.tools.architecture.LAYERS`, the table
docs/architecture.md shows), at module level or inside a function, and the few that must are listed here with
their reason; run code, callbacks and the planner never import ``launch/`` (the entry point hands its hooks in);
no import cycle anywhere in the package; the neutral modules (capabilities, the strategy protocol) and the
callbacks import no strategy, the planner imports neither torch nor matplotlib, the package root holds only the
modules meant to be there, and the names that moved out of ``parallelkit.strategies`` are still importable from
there."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import parallelkit
from parallelkit.tools import architecture
from parallelkit.tools.architecture import Import, all_imports, imports_of, layer, modules, unit, upward

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
ENTRY_AND_RUN = {"__init__", "__main__", "run", "run_config", "job", "run_dir", "config_check", "optim", "console", "csv_logger"}
COMMANDS = {"plan", "verify", "export"}
NEUTRAL = {"errors", "capabilities", "strategy_protocol", "hashing", "process_stats", "deferred_imports"}


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
    return architecture.import_graph(root)


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


# The imports that go up the layers, each with the reason it must. Anything else that goes up fails the test.
UPWARD_WITH_REASON: dict[tuple[str, str], str] = {}  # (importer, imported): why it must go up


def test_every_module_sits_in_a_layer():
    assert sorted({unit(m) for m in modules() if layer(m) is None}) == []
    units = [u for _, us, _ in architecture.LAYERS for u in us]
    assert len(units) == len(set(units))  # each in one layer


def test_no_import_goes_up_the_layers():
    found = upward(all_imports())
    unexplained = [f"{i.importer}:{i.line} imports {i.imported} ({'in a function' if i.in_function else 'module level'})"
                   for i in found if (i.importer, i.imported) not in UPWARD_WITH_REASON]
    assert unexplained == [], "imports up the layers (parallelkit.tools.architecture.LAYERS):\n" + "\n".join(unexplained)
    stale = set(UPWARD_WITH_REASON) - {(i.importer, i.imported) for i in found}
    assert not stale, f"listed as going up, but no longer imported: {sorted(stale)}"


def test_run_code_callbacks_tools_and_the_planner_never_import_launch():
    users = {"run", "run_config", "job", "callbacks/", "planner/", "tools/"}
    found = [i for i in all_imports() if unit(i.importer) in users and unit(i.imported) == "launch/"]
    assert found == []


@pytest.mark.parametrize("source, where", [
    ("from parallelkit.launch import local_ranks\n", "module level"),
    ("def f():\n    from parallelkit.launch.local_ranks import abort\n", "inside a function"),
    ("class C:\n    def m(self):\n        from ..launch import local_ranks\n", "relative, in a method"),
    ("import parallelkit.launch\n", "the package"),
    ("from parallelkit import job\n", "a module through its package"),
])
def test_an_upward_import_is_found(tmp_path, source, where):
    """Negative control: a callback that imports the launcher or the run, in any of these forms, goes up."""
    path = tmp_path / "fake.py"
    path.write_text(source)
    found = upward(imports_of("parallelkit.callbacks.fake", path, modules()))
    assert [unit(i.imported) for i in found] in (["launch/"], ["job"]), where
    assert found[0].in_function == ("def " in source)


def test_imports_below_and_within_the_layer_are_allowed(tmp_path):
    path = tmp_path / "fake.py"
    path.write_text("from parallelkit.errors import ConfigError\nfrom . import base\n\ndef f():\n    from ..models import plans\n")
    found = imports_of("parallelkit.callbacks.fake", path, modules())
    assert [i.imported for i in found] == ["parallelkit.errors", "parallelkit.callbacks.base", "parallelkit.models.plans"]
    assert upward(found) == []
    assert upward([Import("parallelkit.models.plans", "parallelkit.callbacks.base", 1, False)])  # and the other way round


def test_the_layers_section_of_the_architecture_page_matches_the_code():
    text = (architecture.ROOT / architecture.DOC).read_text()
    assert architecture.regenerate(text, architecture.layers_section()) == text, (
        f"{architecture.DOC}: the layers section differs from the code; run `python -m parallelkit.tools.architecture`")


def test_the_entry_point_hands_the_launchers_hooks_to_the_run(tmp_path):
    """``launch/cli.py`` hands the launcher's functions to the run (``run.LaunchHooks``) and the run hands the stop
    on to the signal callback; without the launcher (a test, torchrun) every hook does nothing."""
    from omegaconf import OmegaConf

    from parallelkit.launch import cli, local_ranks, startup_gc
    from parallelkit.run import LaunchHooks, checkpoint_callbacks

    hooks = cli.launch_hooks()
    assert hooks.is_started_rank is local_ranks.is_started_rank and hooks.start_ranks is local_ranks.ensure_started
    assert hooks.end_startup is startup_gc.resume and hooks.share_cores is local_ranks.share_cores
    _, signal_stop = checkpoint_callbacks(OmegaConf.create({}), tmp_path, hooks.stop_ranks)
    assert signal_stop.on_leave is hooks.stop_ranks
    quiet = LaunchHooks()
    assert quiet.is_started_rank() is False and quiet.start_ranks(2, 1) is None and quiet.start_work() is None
