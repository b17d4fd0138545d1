"""bench/overhead.py's ``--before CHECKOUT``: another commit's train.py as a fourth contender, named in the table."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import overhead  # noqa: E402


def test_before_adds_a_contender_run_from_that_checkout(tmp_path):
    args = overhead.parse_args(["--before", str(ROOT), "--only", "parallelkit,ddp_loop"])
    assert args.only == ["parallelkit", "ddp_loop", "before"]
    cmds = overhead.commands(args, tmp_path)
    assert cmds["before"][1] == "train.py" and f"hydra.run.dir={tmp_path / 'before'}" in cmds["before"]
    assert cmds["before"][2:4] == cmds["parallelkit"][2:4]  # the same experiment


def test_before_refuses_a_directory_that_is_no_checkout(tmp_path, capsys):
    with pytest.raises(SystemExit):
        overhead.parse_args(["--before", str(tmp_path)])
    assert "not a parallelkit checkout" in capsys.readouterr().err


def test_before_is_no_name_for_only_without_a_checkout(capsys):
    with pytest.raises(SystemExit):
        overhead.parse_args(["--only", "parallelkit,ddp_loop,before"])
    assert "--only takes names from" in capsys.readouterr().err


def test_saved_labels_name_the_rows():
    agg = {"before": {k: 1.0 for k in ("step_time_s_median", "wall_s_median", "outside_steps_s_median", "cpu_s_median",
                                       "step_ratio_median", "wall_ratio_median", "cpu_ratio_median")}}
    for key in ("step_ratio_range", "wall_ratio_range", "cpu_ratio_range"):
        agg["before"][key] = [1.0, 1.0]
    table = overhead.tables({"aggregate": agg, "labels": {"before": "parallelkit at abc1234"}})[""]
    assert "| parallelkit at abc1234 |" in table.splitlines()[-1]
