"""``python train.py strategy=auto``: the planner picks the degrees, hybrid4d trains with them.

Run through ``python -m parallelkit.verify`` (which runs ``train.py strategy=auto ...`` and
``strategy=single`` as subprocesses): one pair of runs checks that auto trains, that it matches one process
step by step (hybrid4d is exact), and what it recorded in summary.json.
"""

from __future__ import annotations

import json

from test_train import train
from test_verify import WORKLOAD, verify


def test_auto_trains_with_the_chosen_degrees_matches_single_and_its_estimates_hold(tmp_path):
    proc = verify(*WORKLOAD, "strategy=auto", "trainer.devices=2", "--steps", "3", "--run-dir", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr  # same per-step loss as strategy=single
    summary = json.loads((tmp_path / "config" / "summary.json").read_text())
    plan = summary["auto_plan"]
    assert plan["strategy"] == "auto" and summary["strategy"] == "hybrid4d"
    assert summary["dims"] == {**plan["chosen"], "ep": 1}  # it trained with the degrees it chose
    assert plan["candidates_fitting"] >= 1 and summary["steps"] == 3
    log = (tmp_path / "config" / "train.out").read_text()
    assert "strategy=auto: 2 ranks" in log and "chosen: " in log  # the ranking was printed before training
    # The done-criterion: estimates within 2× of what was measured.
    measured_state = sum(summary["model_state_bytes"].values())
    assert 0.5 <= plan["estimated_memory_bytes"]["state"] / measured_state <= 2
    measured_comm = sum(k["bytes_per_step"] for name, k in summary["comm"]["by_kind"].items() if name != "metrics")
    # summary.json's comm is rank 0's own counter: compare with the estimate for rank 0's pipeline stage.
    estimated_comm = sum(plan["estimated_comm_bytes_per_step_by_pp_rank"][0].values())
    assert measured_comm > 0 and 0.5 <= estimated_comm / measured_comm <= 2


def test_auto_refuses_a_degree_before_launch(tmp_path):
    proc = train([*WORKLOAD, "trainer.max_steps=2", "strategy=auto", "+strategy.tp=2", "trainer.devices=2",
                  f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "strategy=auto chooses strategy.tp itself" in proc.stderr
    assert not (tmp_path / "run" / "summary.json").exists()
