"""The installed command: ``pip install .`` gives ``parallelkit``, which runs from any directory.

This checkout is built into a wheel and installed, *not* editable, into a fresh virtual environment; the
command then runs from ``tmp_path`` (outside the checkout) with ``PYTHONPATH`` cleared, so the checkout
cannot help: the configs must come from the installed ``parallelkit/conf`` (``pkg://parallelkit.conf``) and
every rank must import the installed code. The run also uses what a user brings: a config directory joined
with ``hydra.searchpath=[file://./my_conf]`` (``model=mynet``) whose model is a class of the user's own
package in the working directory — a subclass of parallelkit's GPT that records, on every rank, where
``parallelkit`` was imported from and the ``sys.path`` it ran with.

No downloads: the wheel is built with this interpreter's setuptools (no build isolation), and the new
environment reaches torch, Lightning and Hydra through a ``.pth`` line naming this interpreter's
site-packages. (``venv --system-site-packages`` would not do: it reaches the *base* interpreter's
site-packages, not this virtual environment's.) A ``.pth`` line only adds a directory — the ``.pth`` files
inside it are not run — so the development environment's editable install (``__editable__*.pth``, which
points at ``src/``) stays inactive there.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[2]
# What the wheel is built from (setup.py lists the packages, README.md is the long description).
SOURCES = ("pyproject.toml", "setup.py", "README.md", "src", "conf", "examples")
TINY = [
    "+experiment=smoke",
    "model.n_layer=2",
    "model.n_embd=32",
    "model.n_head=2",
    "data.seq_len=16",
    "data.global_batch_size=8",
    "trainer.max_steps=3",
    "trainer.enable_progress_bar=false",
]
USER_CONFIG = """\
# A user's own model config (lightning-hydra-template layout), picked with model=mynet.
_target_: mypkg.ProbedGPT
n_layer: 2
n_head: 2
n_embd: 32
"""
USER_PACKAGE = """\
import json, os, sys

import parallelkit
from parallelkit.models.gpt import GPT


class ProbedGPT(GPT):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int) -> None:
        super().__init__(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
        with open(f"probe_rank{os.environ.get('LOCAL_RANK', '0')}.json", "w") as f:
            json.dump({"parallelkit": parallelkit.__file__, "sys_path": sys.path}, f)
"""


def run(command: list, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=timeout, **kwargs)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> SimpleNamespace:
    """A virtual environment with this checkout installed from its wheel (``bin``, ``site``: its site-packages)."""
    root = tmp_path_factory.mktemp("installed")
    # Built from a copy: pip builds a local directory in place, which would leave build/ and
    # src/parallelkit.egg-info in the checkout (and two test runs at once would share them).
    source = root / "source"
    source.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(REPO / name, source / name)
    build = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", root / "wheels", source])
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = (root / "wheels").glob("parallelkit-*.whl")

    venv = root / "venv"
    made = run([sys.executable, "-m", "venv", "--without-pip", venv])
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    # This pip, run by the new interpreter (--python): installs there, console script included. Before the
    # .pth below exists, so pip sees an empty environment, not the development one and its parallelkit.
    install = run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel])
    assert install.returncode == 0, install.stdout + install.stderr
    site_dir = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    ours = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    (site_dir / "zz_parallelkit_test_deps.pth").write_text("\n".join(dict.fromkeys(p for p in ours if os.path.isdir(p))) + "\n")
    return SimpleNamespace(bin=venv / "bin", python=python, site=site_dir)


def user_env(installed: SimpleNamespace) -> dict[str, str]:
    """A user's shell with the environment activated; nothing points at the checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "VIRTUAL_ENV")}
    return {**env, "PATH": f"{installed.bin}{os.pathsep}{env.get('PATH', '')}", "HYDRA_FULL_ERROR": "0"}


def user_project(path: Path) -> Path:
    (path / "my_conf" / "model").mkdir(parents=True)
    (path / "my_conf" / "model" / "mynet.yaml").write_text(USER_CONFIG)
    (path / "mypkg").mkdir()
    (path / "mypkg" / "__init__.py").write_text(USER_PACKAGE)
    return path


def test_the_wheel_carries_every_config(installed):
    conf = installed.site / "parallelkit" / "conf"
    assert (conf / "__init__.py").is_file()  # Hydra's pkg:// source needs a regular package
    packaged = sorted(p.relative_to(conf).as_posix() for p in conf.rglob("*.yaml"))
    assert packaged == sorted(p.relative_to(REPO / "conf").as_posix() for p in (REPO / "conf").rglob("*.yaml"))
    assert not list(installed.site.glob("__editable__*")), "the test environment must hold a non-editable install"


@pytest.mark.parametrize(
    "devices",
    [
        ["trainer.devices=2"],  # rank 1 started before Hydra, composing its own config (parallelkit.launch.local_ranks)
        [],  # the strategy's default (2 on CPU): Lightning's launcher re-runs the console script (parallelkit.launcher)
    ],
    ids=["early-start", "lightning-launcher"],
)
def test_installed_command_runs_a_users_config_and_package_from_any_directory(installed, tmp_path, devices):
    work = user_project(tmp_path)
    proc = run(["parallelkit", "hydra.searchpath=[file://./my_conf]", "model=mynet", *TINY, *devices],
               cwd=work, env=user_env(installed), timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]

    # The run directory is relative to the working directory, as with python train.py.
    (summary_path,) = (work / "outputs").glob("*/summary.json")
    summary = json.loads(summary_path.read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert (summary_path.parent / "train_rank1.log").exists()
    hydra_cfg = OmegaConf.load(summary_path.parent / ".hydra" / "hydra.yaml").hydra
    sources = {(s.schema, s.path, s.provider) for s in hydra_cfg.runtime.config_sources}
    assert ("pkg", "parallelkit.conf", "main") in sources  # the packaged configs, not a directory
    assert ("file", "./my_conf", "hydra.searchpath in command-line") in sources
    assert hydra_cfg.runtime.choices.model == "mynet"

    # Every rank built the user's model from the user's package, with the installed parallelkit only.
    for rank in (0, 1):
        probe = json.loads((work / f"probe_rank{rank}.json").read_text())
        assert Path(probe["parallelkit"]).resolve() == (installed.site / "parallelkit" / "__init__.py").resolve(), rank
        with_parallelkit = [p for p in probe["sys_path"] if p and (Path(p) / "parallelkit" / "__init__.py").is_file()]
        assert [Path(p).resolve() for p in with_parallelkit] == [installed.site.resolve()], (rank, probe["sys_path"])
        assert str(REPO) not in probe["sys_path"] and str(REPO / "src") not in probe["sys_path"], rank


def test_the_wheel_carries_the_default_corpus(installed):
    """data=chars/text read the packaged snapshot (not the running Python's docs): it must be in the wheel."""
    name = "python_docs_3.11.7.txt.gz"
    shipped = installed.site / "parallelkit" / "data" / "corpora" / name
    assert shipped.read_bytes() == (REPO / "src" / "parallelkit" / "data" / "corpora" / name).read_bytes()


def test_the_wheel_carries_the_examples(installed, tmp_path):
    """``parallelkit examples DIR`` writes, from the installed package, what examples/ holds."""
    shipped = sorted(p.relative_to(REPO / "examples").as_posix() for p in (REPO / "examples").rglob("*")
                     if p.is_file() and p.suffix in (".py", ".yaml") and "__pycache__" not in p.parts and "outputs" not in p.parts)
    written = run(["parallelkit", "examples", "ex"], cwd=tmp_path, env=user_env(installed))
    assert written.returncode == 0, written.stderr
    assert sorted(p.relative_to(tmp_path / "ex").as_posix() for p in (tmp_path / "ex").rglob("*") if p.is_file()) == shipped
    for name in shipped:
        assert (tmp_path / "ex" / name).read_bytes() == (REPO / "examples" / name).read_bytes(), name


def test_installed_help_matches_train_py_and_a_bad_choice_fails(installed, tmp_path):
    work = user_project(tmp_path)
    env = user_env(installed)
    reference = run([sys.executable, REPO / "train.py", "--help"], cwd=REPO)
    assert reference.returncode == 0, reference.stderr
    assert "Config groups" in reference.stdout and "  strategy=" in reference.stdout
    for command, prog in ((["parallelkit"], "parallelkit"), ([installed.python, "-m", "parallelkit"], "python -m parallelkit")):
        helped = run([*command, "--help"], cwd=work, env=env)
        assert helped.returncode == 0, helped.stderr
        # The same help, its examples named as the user invoked parallelkit.
        as_train_py = reference.stdout.split("usage: ", 1)[1].split(" [GROUP", 1)[0]  # python train.py, as run from REPO
        assert as_train_py == "python train.py"
        assert helped.stdout == reference.stdout.replace(as_train_py, prog), command

    # Negative control: a choice no config directory has fails in Hydra, which names the user's option too.
    bad = run(["parallelkit", "hydra.searchpath=[file://./my_conf]", "model=nosuch", *TINY], cwd=work, env=env)
    assert bad.returncode != 0
    assert "Could not find 'model/nosuch'" in bad.stderr, bad.stderr[-2000:]
    assert "mynet" in bad.stderr and "pkg://parallelkit.conf" in bad.stderr
    assert not (work / "outputs").exists()


def test_installed_calibration_trains_from_any_directory(installed, tmp_path):
    """``plan --calibrate`` measures the host time per step by training (``planner/calibrate_host.py``): with only the
    wheel installed, from a directory outside the checkout, writing nothing there. (It ran the checkout's
    ``train.py``, so an installed ``--calibrate`` failed: a pip user has no train.py.)"""
    code = ("import json; from parallelkit.planner.calibrate_host import TINY, _train; "
            "print(json.dumps(_train(['strategy=single', *TINY, 'model.n_layer=1', 'data.global_batch_size=8'], 1, 1)))")
    proc = run([installed.python, "-c", code], cwd=tmp_path, env=user_env(installed), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wall, cpu = json.loads(proc.stdout.splitlines()[-1])
    assert 0 < wall < 10 and 0 < cpu < 10  # seconds per step of a 16-wide one-block GPT
    assert not list(tmp_path.iterdir())  # the run went to a scratch directory, not the user's


# ------------------------------------------------------------------------------------ README, "Your own model"
def readme_block(marker: str) -> str:
    """The fenced code block of README.md between ``<!-- marker -->`` and ``<!-- /marker -->``."""
    text = (REPO / "README.md").read_text()
    block = text.split(f"<!-- {marker} -->", 1)[1].split(f"<!-- /{marker} -->", 1)[0].strip()
    lines = block.splitlines()
    assert lines[0].startswith("```") and lines[-1] == "```", block[:200]
    return "\n".join(lines[1:-1])


def test_readme_user_package_example_runs_installed_outside_the_checkout(installed, tmp_path):
    """The README's commands, as written, from a copy of examples/user_package with only the wheel installed."""
    project = tmp_path / "user_package"
    shutil.copytree(REPO / "examples" / "user_package", project, ignore=shutil.ignore_patterns("__pycache__", "outputs"))
    commands = readme_block("own-model-commands").splitlines()
    assert commands[0] == "cd examples/user_package"
    summaries = []
    for command in commands[1:]:
        proc = run(["bash", "-c", command], cwd=project, env=user_env(installed), timeout=300)
        assert proc.returncode == 0, (command, proc.stderr[-3000:])
        run_dirs = [p for p in (project / "outputs").iterdir() if p.is_dir() and (p / "summary.json").exists() and p not in {s[0] for s in summaries}]
        assert len(run_dirs) == 1, run_dirs
        summaries.append((run_dirs[0], json.loads((run_dirs[0] / "summary.json").read_text())))
    (tp_dir, tp), (pp_dir, pp) = summaries
    assert tp["dims"]["tp"] == 2 and pp["dims"]["pp"] == 2 and tp["steps"] == pp["steps"] == 200
    # Same seed, model, data and global batch: tensor and pipeline parallel train one trajectory.
    assert max(abs(a - b) / a for a, b in zip(tp["train_loss"], pp["train_loss"])) <= 1e-5
    assert tp["train_loss"][-1] < tp["train_loss"][0] - 1.5  # it learned (a uniform guess is ln(103) = 4.63)


def test_readme_lightning_module_example_runs_installed_outside_the_checkout(installed, tmp_path):
    """examples/own_lightning_module.py run as the README says, with only the wheel installed, from a copy outside
    the checkout (Lightning's launcher re-runs it for rank 1); and the README's excerpt is the file's own code."""
    script = REPO / "examples" / "own_lightning_module.py"
    source = [line.strip() for line in script.read_text().splitlines()]
    for line in readme_block("own-lightning-module").splitlines():
        if line.strip() and not line.strip().startswith("..."):
            assert line.strip() in source, f"README line not in {script.name}: {line!r}"
    shutil.copy2(script, tmp_path / script.name)
    proc = run(["python", script.name], cwd=tmp_path, env=user_env(installed), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # No library noise: Lightning's LeafSpec deprecation, FSDP2's "returned a view tensor" (issue 35).
    noise = [line for line in proc.stderr.splitlines() if "Warning" in line or "deprecated" in line]
    assert not noise, noise
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("train_loss")]
    val_loss = float(line.split()[-1])
    # The target's variance is 2.8 (sin of 4 normals plus a product of two): the model learned most of it.
    assert val_loss < 0.7, line


def test_readme_own_model_by_target_runs_installed_from_any_directory(installed, tmp_path):
    """The README's `parallelkit examples` + `model._target_=` block, as written, with only the wheel installed."""
    block = readme_block("own-model-target")
    proc = run(["bash", "-ec", block], cwd=tmp_path, env=user_env(installed), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (summary,) = (tmp_path / "my_examples" / "user_package" / "outputs").glob("*/summary.json")
    assert json.loads(summary.read_text())["world_size"] == 2
    config = OmegaConf.load(summary.parent / ".hydra" / "config.yaml")
    assert OmegaConf.to_container(config.model) == {"_target_": "mynet.CharMLP", "hidden": 128}
