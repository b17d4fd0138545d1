"""What parallelkit reads from its command line before Hydra does: ``model._target_=X`` alone, ``--help``,
``--version``, ``parallelkit examples DIR``, and whether the degrees allow starting the local ranks early.

Imported by the entry points before torch (and before Hydra, which :func:`degrees_allow_early_start` imports
lazily): nothing heavy at module level.
"""

from __future__ import annotations

import os
import re
import sys
from importlib import resources
from pathlib import Path
from typing import Any

# The configs an installed parallelkit carries: the repository's conf/, shipped as the package parallelkit.conf
# (pyproject.toml, setup.py). train.py reads its checkout's conf/ directly instead (see there).
PACKAGED_CONFIGS = "pkg://parallelkit.conf"


# ------------------------------------------------------------------------------------- model._target_=X
def replace_groups_by_target(argv: list[str], groups: list[str]) -> list[str]:
    """``G._target_=X`` without ``G=...`` means "my own X instead of the group's option": the group's default
    (``model=gpt``) is dropped (``~G``) so that none of its keys (``n_layer``) reach X's constructor, and every
    ``G.key=value`` becomes ``+G.key=value`` (X's arguments are new keys). Idempotent: ranks started with the
    rewritten command line, or a sweep's job, rewrite nothing."""
    out = list(argv)
    for group in groups:
        keys = [a.split("=", 1)[0] for a in out if "=" in a or a.startswith("~")]
        sets_target = any(k.lstrip("+") == f"{group}._target_" for k in keys)
        chooses = any(k.lstrip("+~") == group for k in keys)  # model=..., ~model, +model=...
        if not sets_target or chooses:
            continue
        first = next(i for i, a in enumerate(out) if a.lstrip("+").startswith(f"{group}."))
        out = [f"+{a}" if a.startswith(f"{group}.") else a for a in out]
        out.insert(first, f"~{group}")
    return out


# ------------------------------------------------------------------------------------- the config tree
def config_root(config_path: str) -> Any:
    """The config directory as a traversable tree: a path (train.py's checkout) or ``pkg://module`` (installed)."""
    if config_path.startswith("pkg://"):
        return resources.files(config_path[len("pkg://"):])
    return Path(config_path)


def config_groups(config_path: str) -> dict[str, list[str]]:
    """Each config group (a directory of YAML files) and its options, sorted."""
    root = config_root(config_path)
    groups = {}
    for entry in root.iterdir():
        if entry.is_dir() and not entry.name.startswith(("_", ".")):
            options = sorted(f.name[:-5] for f in entry.iterdir() if f.name.endswith(".yaml"))
            if options:
                groups[entry.name] = options
    return dict(sorted(groups.items()))


def describe_yaml(text: str) -> tuple[str, list[tuple[str, str]]]:
    """A YAML file's first comment line (what the option is) and its top-level keys with their ``# comment``."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("#") and not ln.startswith("# @package")), None)
    first = ""
    if start is not None:
        block = []
        for ln in lines[start:]:
            if not ln.startswith("#"):
                break
            block.append(ln.lstrip("# ").strip())
        first = _first_sentence(" ".join(block))
    keys = []
    for line in lines:
        match = re.match(r"^([A-Za-z_][\w]*):(.*)$", line)
        if match and match.group(1) not in ("defaults", "hydra"):
            value, _, comment = match.group(2).partition(" #")
            keys.append((match.group(1), comment.strip() or value.strip()))
    return first, keys


def _comment_above(lines: list[str], index: int) -> str:
    """The comment block just above line ``index``, first sentence only (train.yaml documents keys that way)."""
    block = []
    j = index - 1
    while j >= 0 and lines[j].startswith("#"):
        block.insert(0, lines[j].lstrip("# ").strip())
        j -= 1
    return _first_sentence(" ".join(block))


def _first_sentence(text: str) -> str:
    # A period, a space and a capital ends it; "et al. 2023", "e.g. X" do not. One line: at most ~150 characters.
    first = re.split(r"(?<!\bal)(?<!e\.g)(?<!i\.e)(?<=\.)\s(?=[A-Z`(])", text, maxsplit=1)[0] if text else ""
    return first if len(first) <= 150 else first[:first.rfind(" ", 0, 148)] + " …"


# ---------------------------------------------------------------------------------------------- --help
def invoked_as() -> str:
    """How the user started parallelkit, for the examples: ``parallelkit``, ``python -m parallelkit``, ``python train.py``."""
    import __main__

    spec = getattr(__main__, "__spec__", None)
    if spec is not None and spec.name.startswith("parallelkit"):
        return "python -m parallelkit"
    script = sys.argv[0]
    if os.path.basename(script) == "parallelkit":
        return "parallelkit"
    return f"python {os.path.relpath(script) if os.path.isabs(script) and not os.path.relpath(script).startswith('..') else script}"


def help_text(config_path: str, argv: list[str]) -> str:
    """parallelkit's ``--help``: groups and options with their one-line descriptions (from the YAML comments),
    the main settings, examples as invoked. ``--help GROUP=OPTION`` (or ``--help GROUP``) lists that option's keys."""
    root = config_root(config_path)
    groups = config_groups(config_path)
    prog = invoked_as()
    asked = [a for a in argv if not a.startswith("-")]
    if asked:
        return "\n".join(_option_help(root, groups, a, prog) for a in asked)
    out = [
        "parallelkit: distributed training on Lightning's Trainer, composed with Hydra.",
        "",
        f"usage: {prog} [GROUP=OPTION ...] [KEY=VALUE ...]",
        f"       {prog} --help GROUP=OPTION      the keys of one option, e.g. --help strategy=zero",
        f"       {prog} --version | --hydra-help | examples DIR",
        "",
        "Config groups (GROUP=OPTION; callbacks=[a,b] takes several; +experiment=NAME a preset):",
    ]
    for group, options in groups.items():
        out.append(f"  {group}=")
        for option in options:
            first, _ = describe_yaml((root / group / f"{option}.yaml").read_text())
            out.append(f"    {option:<24}{first}")
    train = (root / "train.yaml").read_text().splitlines()
    out += ["", "Settings (KEY=VALUE; a group's keys too, e.g. model.n_layer=4; a key that no code reads is an error):"]
    for i, line in enumerate(train):
        match = re.match(r"^([a-z_]+):", line)
        if match and match.group(1) not in ("defaults", "hydra"):
            out.append(f"  {match.group(1):<26}{_comment_above(train, i)}")
    out += [
        f"  {'hydra.run.dir=DIR':<26}where the run writes (default outputs/<the overrides>)",
        "",
        "Examples:",
        f"  {prog} strategy=ddp trainer.devices=2 model.n_layer=2 trainer.max_steps=50",
        f"  {prog} strategy=zero strategy.stage=3 callbacks=[amp] trainer.devices=2",
        f"  {prog} model._target_=mynet.CharMLP strategy=ddp trainer.devices=2   (your own model, from its directory)",
        f"  {prog} -m strategy=single,ddp                (a sweep, one sub-directory per job)",
        f"  {prog} +experiment=smoke                     (a preset)",
        "",
        "Every run writes summary.json, metrics.csv and checkpoints/ to hydra.run.dir.",
    ]
    return "\n".join(out)


def _option_help(root: Any, groups: dict[str, list[str]], asked: str, prog: str) -> str:
    group, _, option = asked.partition("=")
    if group not in groups:
        return f"{asked}: no config group {group!r}; the groups are {', '.join(groups)}."
    if not option:
        return "\n".join([f"{group}= options:"] + [f"  {o:<24}{describe_yaml((root / group / f'{o}.yaml').read_text())[0]}" for o in groups[group]])
    if option not in groups[group]:
        return f"{asked}: no option {option!r} in {group}; its options are {', '.join(groups[group])}."
    first, keys = describe_yaml((root / group / f"{option}.yaml").read_text())
    lines = [f"{group}={option}: {first}", ""]
    lines += [f"  {group}.{key:<28}{text}" for key, text in keys if key != "_target_"]
    lines += ["", f"e.g. {prog} {group}={option} {group}.{next((k for k, _ in keys if k != '_target_'), 'KEY')}=..."]
    return "\n".join(lines)


def version_text() -> str:
    """``parallelkit --version``: parallelkit's version and the pinned libraries it runs on (read without importing them)."""
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    try:
        own = metadata.version("parallelkit")
    except metadata.PackageNotFoundError:  # a checkout on PYTHONPATH, not installed
        from parallelkit import __version__ as own
    libs = ", ".join(f"{name} {version(name)}" for name in ("torch", "lightning", "hydra-core", "omegaconf"))
    return f"parallelkit {own} ({libs})"


# ------------------------------------------------------------------------------------ examples DIR
def examples_root() -> Path | Any:
    """The examples an installed parallelkit carries (``parallelkit.examples``, the repository's ``examples/``),
    or, for a checkout on ``PYTHONPATH``/an editable install made before they were packaged, the checkout's."""
    try:
        root = resources.files("parallelkit.examples")
        if root.is_dir() and any(True for _ in root.iterdir()):
            return root
    except ModuleNotFoundError:
        pass
    return Path(__file__).resolve().parents[3] / "examples"


def write_examples(target: str) -> str:
    """``parallelkit examples DIR``: copy the examples (your own model: ``user_package/``; a LightningModule in plain
    Python: ``own_lightning_module.py``) into ``DIR``, refusing to overwrite a file; returns what to run next."""
    dest = Path(target)
    files = []

    def walk(node: Any, rel: Path) -> None:
        for entry in node.iterdir():
            if entry.name == "__pycache__" or (rel == Path() and entry.name == "__init__.py"):
                continue
            if entry.is_dir():
                walk(entry, rel / entry.name)
            elif entry.name.endswith((".py", ".yaml")):
                files.append((rel / entry.name, entry))

    walk(examples_root(), Path())
    clashes = [str(dest / rel) for rel, _ in files if (dest / rel).exists()]
    if clashes:
        raise SystemExit(f"parallelkit: error: {clashes[0]} exists already ({len(clashes)} file(s) would be overwritten); "
                         "choose an empty or new directory.")
    for rel, entry in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_bytes(entry.read_bytes())
    prog = invoked_as()
    return (f"wrote {len(files)} files to {dest}/. Try:\n"
            f"  cd {dest / 'user_package'}\n"
            f"  {prog} model._target_=mynet.CharMLP strategy=ddp trainer.devices=2 trainer.max_steps=50\n"
            f"  {prog} hydra.searchpath=[file://./my_conf] model=mynet strategy=tp trainer.devices=2 trainer.max_steps=50\n"
            f"  python {dest / 'own_lightning_module.py'}")


# -------------------------------------------------------------------- degrees before the ranks start
def degrees_allow_early_start(config_path: str, argv: list[str], world_size: int) -> bool:
    """Whether ``world_size`` processes may start before Hydra composes the job: the strategy's degrees
    (its keys named like :class:`~parallelkit.distributed.parallel_dims.ParallelDims`' axes) must fit them.
    Composed with Hydra's compose API, then forgotten (the job composes again). Any doubt says no: the ranks
    then start once the run has validated its degrees (:func:`parallelkit.run.assemble`), never before."""
    try:
        import inspect

        from hydra import compose, initialize_config_dir, initialize_config_module
        from omegaconf import OmegaConf

        from parallelkit.distributed.parallel_dims import ParallelDims
        from parallelkit.launch.resolvers import register_resolvers

        register_resolvers()
        overrides = [a for a in argv if not a.startswith("-") and not a.startswith(("hydra.", "hydra/"))]
        config_name = next((a.split("=", 1)[1] for a in argv if a.startswith("--config-name=")), "train")
        init = (initialize_config_module(config_path[len("pkg://"):], version_base="1.3") if config_path.startswith("pkg://")
                else initialize_config_dir(os.path.abspath(config_path), version_base="1.3"))
        with init:
            strategy = compose(config_name, overrides=overrides).get("strategy")
        axes = [p for p in inspect.signature(ParallelDims.request).parameters if p != "mesh_order"]
        node = OmegaConf.to_container(strategy, resolve=True) if strategy is not None else {}
        degrees = {k: v for k, v in node.items() if k in axes and isinstance(v, int)}
        ParallelDims.request(**degrees).resolve(world_size)
        return True
    except Exception:  # noqa: BLE001 - bad degrees, a command line that does not compose: the job says why
        return False
