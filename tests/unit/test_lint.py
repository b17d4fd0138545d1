"""The linter the suite runs: ``ruff check`` with pyproject.toml's ``[tool.ruff]`` (pyflakes, pycodestyle's errors
and warnings, line length 160) over every Python file of the repository finds nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PATHS = ["src", "tests", "bench", "examples", "conf", "train.py", "setup.py"]


def ruff(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module", autouse=True)
def _ruff_installed():
    proc = subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True, text=True)
    if proc.returncode != 0:  # the dev extra installs it: pip install -e ".[dev]"
        pytest.fail(f"ruff is not installed in {sys.executable} (pip install -e '.[dev]'): {proc.stderr.strip()}")


def test_ruff_finds_nothing():
    proc = ruff(*PATHS)
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0, f"ruff check {' '.join(PATHS)}:\n{proc.stdout}{proc.stderr}"


def test_the_configuration_is_the_repositorys_and_finds_an_unused_import(tmp_path):
    """Negative control: with the repository's configuration, an unused import and a line over 160 are found."""
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "bad.py").write_text("import os\n\nX = '" + "x" * 160 + "'\n")
    proc = ruff("bad.py", cwd=tmp_path)
    assert proc.returncode == 1
    assert "bad.py:1:8: F401" in proc.stdout and "bad.py:3:161: E501" in proc.stdout, proc.stdout
