"""What a run prints: the default command's stderr held to a short allow-list, each line once, the progress bar
counting to ``trainer.max_steps`` across epochs, the final table's path whole, ``lr_monitor`` at every step.

The allow-list is Lightning's two INFO lines that say something about this run. Anything else on stderr — a
second copy of a log line (two console handlers), a warning per rank, Lightning's start-up chatter, a
deprecation from parallelkit's own calls — fails the test with the lines it found.
"""

from __future__ import annotations

import csv
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_train import TINY, train  # noqa: E402

ALLOWED = (
    r"INFO: GPU available: (True|False), used: (True|False)",
    r"INFO: `Trainer\.fit` stopped: `max_steps=\d+` reached\.",
)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def unexpected_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not any(re.fullmatch(p, line) for p in ALLOWED)]


def test_the_default_command_prints_only_what_applies_once(tmp_path):
    # The default experiment as the README gives it (ddp, 2 processes, validation, progress bar auto), shortened
    # to 30 steps with validation every 10 so that it takes seconds. A real `python train.py` (cold).
    run_dir = tmp_path / "run"
    proc = train(["trainer.max_steps=30", "trainer.val_check_interval=10", f"hydra.run.dir={run_dir}"], cwd=tmp_path, cold=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    unexpected = unexpected_lines(proc.stderr)
    assert not unexpected, "stderr beyond the allow-list:\n" + "\n".join(unexpected)
    assert len(lines) == len(set(lines)), f"a line printed twice: {lines}"
    assert any(re.fullmatch(ALLOWED[1], line) for line in lines)  # the allow-list matched real output
    # The final table names the summary by its whole path (not cut by the table's width).
    assert f"summary: {run_dir / 'summary.json'}" in proc.stdout
    assert (run_dir / "summary.json").is_file()


def test_a_line_beyond_the_allow_list_is_caught_and_said_once_per_job(tmp_path):
    """Negative control of the check above, and a message that applies said once for the job, not once per rank:
    moe_gpt under tp on 2 ranks keeps its experts whole, which parallelkit says in one line."""
    proc = train([*TINY, "model=moe_gpt", "model.num_experts=4", "model.top_k=2", "strategy=tp", "trainer.devices=2",
                  "trainer.max_steps=3", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    unexpected = unexpected_lines(proc.stderr)
    assert len(unexpected) == 1 and "whole on every tensor-parallel rank" in unexpected[0], unexpected


def test_the_progress_bar_counts_steps_to_max_steps_across_epochs(tmp_path):
    # 30 steps in epochs of 10 batches. Rich draws the bar when it believes it writes to a terminal
    # (TTY_INTERACTIVE); the bar's counter must run 0 → 30 once over the epochs, never restart at an epoch.
    proc = train([*TINY, "strategy=ddp", "trainer.devices=2", "trainer.max_steps=30", "trainer.limit_train_batches=10",
                  "trainer.enable_progress_bar=true", f"hydra.run.dir={tmp_path / 'run'}"],
                 cwd=tmp_path, env={"TTY_INTERACTIVE": "1", "TTY_COMPATIBLE": "1", "COLUMNS": "150"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = ANSI.sub("", proc.stdout)
    frames = [(int(e), int(n), int(total)) for e, n, total in re.findall(r"Epoch (\d+) +\S+ (\d+)/(\d+) ", text)]
    assert len({e for e, _, _ in frames}) == 3, sorted({e for e, _, _ in frames})  # epochs 0, 1, 2
    assert {total for _, _, total in frames} == {30}
    counts = [n for _, n, _ in frames]
    assert counts == sorted(counts) and counts[-1] == 30, counts  # never back to 0 at a new epoch
    assert "/-2" not in text  # Rich's "Epoch 0/-2" for max_epochs=-1


def test_lr_monitor_logs_every_step(tmp_path):
    run_dir = tmp_path / "run"
    proc = train([*TINY, "strategy=single", "trainer.max_steps=12", "callbacks=[lr_monitor]", "optim.schedule.warmup_steps=4",
                  f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(run_dir / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("lr-AdamW")]
    assert [int(r["step"]) for r in rows] == list(range(12))
    lrs = [float(r["lr-AdamW"]) for r in rows]
    assert lrs[0] < lrs[1] < lrs[2] < lrs[3] and max(lrs) == lrs[4]  # the warm-up, step by step
