"""``python -m parallelkit.verify``: a configuration against ``strategy=single``, step by step.

The passing case (``strategy=auto`` → hybrid4d dp=2 on 2 ranks, exit 0) is in test_auto_train.py, which
reads that run's summary as well; here the negative control and the refusals.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from parallelkit.planner.inputs import compose_config
from parallelkit.tools.verify import compare, reference_overrides
from test_train import TINY

# TINY without its step count: verify sets trainer.max_steps itself (--steps).
WORKLOAD = [a for a in TINY if not a.startswith("trainer.max_steps=")]


def verify(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "parallelkit.verify", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HYDRA_FULL_ERROR": "0"})


def rows(stdout: str) -> list[tuple[int, float, float, float]]:
    """The per-step table: (step, single, other, rel. diff)."""
    found = re.findall(r"^\s*(\d+) \|\s*([-\d.]+) \|\s*([-\d.]+) \| ([\d.e+-]+)", stdout, flags=re.M)
    return [(int(s), float(a), float(b), float(d)) for s, a, b, d in found]


def test_local_sgd_is_caught_and_the_first_differing_step_named(tmp_path):
    """Negative control: Local SGD (k_steps=4) steps each rank on its own gradients, so its losses leave
    single's after the first update; step 1 (before any update) must still agree."""
    proc = verify(*WORKLOAD, "strategy=ddp", "trainer.devices=2", "callbacks=[local_sgd]", "--steps", "4", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "reference without callbacks ['local_sgd']" in proc.stdout
    table = rows(proc.stdout)
    assert table[0][3] == 0.0
    first_bad = next(step for step, _, _, d in table if d > 1e-4)
    assert first_bad > 1
    assert f"DIFFERS: step {first_bad} is the first beyond rtol=0.0001" in proc.stdout


def test_bad_overrides_exit_2_before_any_run(tmp_path):
    proc = verify(*WORKLOAD, "strategy=nosuch", cwd=tmp_path)
    assert proc.returncode == 2 and "the overrides do not compose" in proc.stderr and "strategy/nosuch" in proc.stderr
    assert "step |" not in proc.stdout  # nothing ran
    proc = verify(*WORKLOAD, "strategy=ddp", "--steps", "0", cwd=tmp_path)
    assert proc.returncode == 2 and "--steps must be ≥ 1" in proc.stderr


def test_reference_drops_the_layout_and_callbacks_single_refuses():
    overrides = [*WORKLOAD, "strategy=ddp", "strategy.bucket_cap_mb=1", "trainer.devices=2",
                 "callbacks=[amp,local_sgd]", "callbacks.local_sgd.k_steps=2"]
    ref, dropped = reference_overrides(overrides, compose_config(overrides))
    assert dropped == ["local_sgd"]
    assert "callbacks=[amp]" in ref and "strategy=single" in ref and "trainer.devices=1" in ref
    assert not any(o.startswith(("strategy.", "strategy=ddp", "trainer.devices=2", "callbacks.local_sgd")) for o in ref)
    assert all(o in ref for o in WORKLOAD)


def test_compare_names_the_first_step_beyond_rtol_and_fails_on_nan():
    diffs, first = compare([2.0, 2.0, 2.0], [2.0, 2.002, 2.0], rtol=1e-4)
    assert first == 2 and diffs[1] == pytest.approx(1e-3)
    assert compare([2.0, 2.0], [2.0, float("nan")], rtol=1e-4)[1] == 2
    assert compare([2.0], [2.0], rtol=0.0)[1] is None
