"""A new user's first hour (issue 35, frictions 1-7): each test runs what the user typed, from outside the checkout
where that matters, and checks what they would see: exit code, the words of the message, what is left on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from test_train import TINY, train

REPO = Path(__file__).resolve().parents[2]


def cold(args: list[str], cwd: Path, timeout: float = 240, module: bool = True) -> subprocess.CompletedProcess:
    """``python -m parallelkit ...`` (the installed command's code) or ``python train.py ...``, as a real process."""
    entry = ["-m", "parallelkit"] if module else [str(REPO / "train.py")]
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, *entry, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------ 1. model._target_=X replaces the group
def test_own_model_by_target_alone_from_the_written_examples(tmp_path):
    """``parallelkit examples DIR``, then the README's command: model=gpt's keys (n_layer, ...) do not reach CharMLP."""
    written = cold(["examples", "ex"], cwd=tmp_path)
    assert written.returncode == 0, written.stderr
    shipped = sorted(p.relative_to(REPO / "examples").as_posix() for p in (REPO / "examples").rglob("*")
                     if p.is_file() and p.suffix in (".py", ".yaml") and "__pycache__" not in p.parts and "outputs" not in p.parts)
    assert sorted(p.relative_to(tmp_path / "ex").as_posix() for p in (tmp_path / "ex").rglob("*") if p.is_file()) == shipped
    project = tmp_path / "ex" / "user_package"
    proc = cold(["model._target_=mynet.CharMLP", "model.hidden=32", "strategy=ddp", "trainer.devices=2", "trainer.max_steps=3",
                 "data.seq_len=16", "data.global_batch_size=8", "trainer.enable_progress_bar=false", "hydra.run.dir=run"], cwd=project)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = yaml.safe_load((project / "run" / ".hydra" / "config.yaml").read_text())
    assert config["model"] == {"_target_": "mynet.CharMLP", "hidden": 32}  # nothing of model=gpt left
    assert json.loads((project / "run" / "summary.json").read_text())["steps"] == 3


def test_examples_refuses_to_overwrite(tmp_path):
    (tmp_path / "ex" / "user_package" / "mynet").mkdir(parents=True)
    (tmp_path / "ex" / "user_package" / "mynet" / "model.py").write_text("mine")
    proc = cold(["examples", "ex"], cwd=tmp_path)
    assert proc.returncode == 2 and "exists already" in proc.stderr
    assert (tmp_path / "ex" / "user_package" / "mynet" / "model.py").read_text() == "mine"


# ------------------------------------------------------------------ 3. a key that no code reads
@pytest.mark.parametrize(("override", "words"), [
    ("+optim.lr=-1", ["optim.lr, which no code reads", "optim.optimizer.lr=-1"]),
    ("+trainer.max_stepz=3", ["trainer.max_stepz", "trainer.max_steps=3"]),
    ("+data.seq_lenn=8", ["data.seq_lenn", "data.seq_len=8"]),
    ("+model.n_layers=1", ["model.n_layers", "model.n_layer=1"]),
    ("+strategy.timeout=5", ["strategy.timeout", "strategy.timeout_s=5"]),
    ("+checkpoint.every_n_step=3", ["checkpoint.every_n_step", "checkpoint.every_n_steps=3"]),
    ("+seedd=1", ["seedd", "seed=1"]),
])
def test_a_key_no_code_reads_is_refused_with_the_nearest_valid_one(override, words, tmp_path):
    proc = train([*TINY, override, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert all(w in proc.stderr for w in words), proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_the_suggested_key_really_works(tmp_path):
    """Negative control of the check: the key it suggests trains (and keys that code does read pass it)."""
    proc = train([*TINY, "trainer.max_steps=2", "optim.optimizer.lr=0.01", "+trainer.gradient_clip_algorithm=norm",
                  "+callbacks.lr._target_=parallelkit.callbacks.lr_monitor.LearningRateMonitor", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]


# ------------------------------------------------------------------ 6. a refused run leaves nothing, starts nothing
def _children_seen_while(proc: subprocess.Popen) -> set[str]:
    seen: set[str] = set()
    while proc.poll() is None:
        try:
            seen.update(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split())
        except OSError:
            pass
        time.sleep(0.02)
    return seen


def test_bad_degrees_start_no_process_and_leave_no_run_directory(tmp_path):
    command = [sys.executable, str(REPO / "train.py"), "strategy=tp", "strategy.tp=2", "trainer.devices=3", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children = _children_seen_while(proc)
    stderr = proc.stderr.read()
    assert proc.returncode == 2, stderr[-2000:]
    assert "tp(2)" in stderr and "3 processes" in stderr
    assert not children, children
    assert not (tmp_path / "run").exists()


def test_a_refusal_after_the_ranks_started_leaves_nothing_and_the_next_run_writes_hydra(tmp_path):
    run = tmp_path / "run"
    proc = train([*TINY, "strategy=ddp", "trainer.devices=2", "data.global_batch_size=9", f"hydra.run.dir={run}"], cwd=tmp_path)
    assert proc.returncode == 2 and "data.global_batch_size=9" in proc.stderr, proc.stderr[-2000:]
    assert not run.exists(), sorted(p.name for p in run.iterdir())
    proc = train([*TINY, "trainer.max_steps=2", f"hydra.run.dir={run}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in run.glob(".hydra*")) == [".hydra"]


def test_a_refusal_in_an_existing_directory_takes_back_only_its_own_files(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("the user's")
    proc = train([*TINY, "+optim.lr=1", f"hydra.run.dir={run}"], cwd=tmp_path)
    assert proc.returncode == 2
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]


# ------------------------------------------------------------------ 7. --help, --version
def _yaml_description(path: Path) -> str:
    from parallelkit.launch.command_line import describe_yaml

    return describe_yaml(path.read_text())[0]


@pytest.mark.parametrize("module", [True, False], ids=["python -m parallelkit", "train.py"])
def test_help_lists_groups_options_and_descriptions_with_examples_as_invoked(module, tmp_path):
    proc = cold(["--help"], cwd=tmp_path, module=module)
    assert proc.returncode == 0, proc.stderr
    prog = "python -m parallelkit" if module else f"python {REPO / 'train.py'}"
    assert f"usage: {prog} [GROUP=OPTION" in proc.stdout and f"  {prog} strategy=ddp trainer.devices=2" in proc.stdout
    for path in sorted((REPO / "conf").glob("*/*.yaml")):
        description = _yaml_description(path)
        assert description, f"{path.relative_to(REPO)} has no description comment"
        assert f"    {path.stem:<24}{description}" in proc.stdout, path
    assert "train.yaml" not in proc.stdout and "== Configuration groups ==" not in proc.stdout  # not Hydra's dump


def test_help_of_one_option_lists_its_keys_with_their_comments(tmp_path):
    proc = cold(["--help", "strategy=zero"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for line in (REPO / "conf" / "strategy" / "zero.yaml").read_text().splitlines():
        if "#" in line and not line.startswith("#"):
            key, comment = line.split(":", 1)[0], line.split("#", 1)[1].strip()
            assert f"strategy.{key}" in proc.stdout and comment in proc.stdout, line


def test_version_is_parallelkits_own(tmp_path):
    from importlib import metadata

    proc = cold(["--version"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"parallelkit {metadata.version('parallelkit')} (torch {metadata.version('torch')}")
    assert "Hydra" not in proc.stdout


def test_the_model_summary_has_no_unmeasured_flops(tmp_path):
    proc = train([*TINY, "trainer.max_steps=2", "trainer.enable_model_summary=true", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "Total params" in output  # the summary is there ...
    assert "flops" not in output.lower()  # ... without a FLOPs column of zeros or "Total FLOPs: 0"
    assert "Skipping setting a default `ModelSummary`" not in output


# ------------------------------------------------------------------ 2. the vocabulary's numbers and their fix
def test_a_byte_level_run_of_a_256_token_config_names_the_right_numbers_and_its_fix_trains(tmp_path):
    import re

    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    config.save_pretrained(tmp_path / "cfg")
    base = ["model=hf", f"model.config={tmp_path / 'cfg'}", "data=text", "data.seq_len=16", "data.global_batch_size=8",
            "strategy=single", "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
            "trainer.enable_progress_bar=false"]
    refused = train([*base, f"hydra.run.dir={tmp_path / 'refused'}"], cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr[-2000:]
    # bytes 0..255 and the end-of-document id 256; data.vocab_multiple=64's padding (320) is not an id
    assert "has a vocabulary of 256 tokens" in refused.stderr and "ids up to 256 (257 ids)" in refused.stderr, refused.stderr
    assert "319" not in refused.stderr
    fix = re.search(r"\+model\.overrides\.vocab_size=\d+", refused.stderr).group(0)
    fixed = train([*base, fix, f"hydra.run.dir={tmp_path / 'fixed'}"], cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr[-3000:]


# ------------------------------------------------------------------ 4. a validation set without one batch per rank
def _small_corpus(tmp_path: Path) -> Path:
    """1,000 characters: 56 training windows of 16, 6 validation windows (fewer than 2 ranks × 4)."""
    import random

    rng = random.Random(0)
    path = tmp_path / "small.txt"
    path.write_text("".join(rng.choice("abcdefgh \n") for _ in range(1000)))
    return path


def test_an_empty_validation_is_one_line_and_no_validation(tmp_path):
    small = ["strategy=ddp", "trainer.devices=2", "data.source=files", f"data.files=[{_small_corpus(tmp_path)}]", "trainer.max_steps=12"]
    proc = train([*TINY, *small, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "no validation in this run" in line]
    assert len(lines) == 1 and "6 samples" in lines[0] and "4 on each of 2" in lines[0], proc.stderr[-3000:]
    assert "Total length of" not in proc.stderr and "across ranks is zero" not in proc.stderr


def test_an_empty_validation_that_was_asked_for_is_refused(tmp_path):
    small = ["strategy=ddp", "trainer.devices=2", "data.source=files", f"data.files=[{_small_corpus(tmp_path)}]", "trainer.val_check_interval=5"]
    proc = train([*TINY, *small, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "trainer.val_check_interval=5 asks for validation" in proc.stderr and "6 samples" in proc.stderr
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ 5. the progress bar's last line, once
def _on_a_terminal(command: list[str], cwd: Path, timeout: float = 240) -> tuple[int, str]:
    """Run ``command`` with stdout and stderr on one pseudo-terminal (a user's shell); its text without escapes."""
    import pty
    import re
    import select

    master, slave = pty.openpty()
    proc = subprocess.Popen(command, cwd=cwd, stdout=slave, stderr=slave, stdin=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "120"})
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the other end closed: the process is gone
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(master)
    code = proc.wait(timeout=30)
    return code, re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode("utf-8", "replace"))


def test_the_progress_bar_ends_before_the_runs_last_lines(tmp_path):
    code, text = _on_a_terminal([sys.executable, str(REPO / "train.py"), *[a for a in TINY if "enable_progress_bar" not in a],
                                 "trainer.max_steps=6", "trainer.enable_progress_bar=true", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert code == 0, text[-3000:]
    lines = text.replace("\r", "\n").split("\n")
    bars = [i for i, line in enumerate(lines) if "6/6" in line and "Epoch" in line]
    (stopped,) = [i for i, line in enumerate(lines) if "`Trainer.fit` stopped" in line]
    assert bars, text[-3000:]  # a bar was drawn (the check has something to see) ...
    assert max(bars) < stopped, lines[stopped:]  # ... and not drawn again below the run's last lines
