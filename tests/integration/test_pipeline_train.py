"""End-to-end: ``python train.py strategy=pp ...`` against ``strategy=single`` (the correctness contract).

Every schedule trains 20 steps of a 4-block GPT at pp = 2 (2 processes) or pp = 2 × dp = 2 (4 processes)
and must reproduce the single process's per-step ``train_loss`` within rel. 1e-5; gradient accumulation
and clipping by norm (combined over stages) too. The traced run is drawn by the timeline tool. Bad
pipeline settings that need the model or the batch fail before any process starts, with exit code 2
and the numbers in the message (the others are unit-tested in tests/distributed/test_pipeline_parallel.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_train import REL_TOL, TINY, max_rel_diff, run_ok, train

# Four blocks, so that pp=2 × virtual_stages=2 has a block per stage; a global batch of 16, so that
# dp=2 × accumulate=2 still leaves 4 samples per rank for 4 micro-batches.
PP_TINY = [*TINY, "model.n_layer=4", "data.global_batch_size=16"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return run_ok([*PP_TINY, "strategy=single"], tmp_path_factory.mktemp("single") / "run")


def test_1f1b_pp2_matches_single_and_is_traced(reference, tmp_path):
    """The issue's "done when" command, traced, and the timeline drawn from the trace."""
    run = tmp_path / "run"
    pp = run_ok([*PP_TINY, "strategy=pp", "strategy.pp=2", "strategy.microbatches=4", "strategy.schedule=1f1b",
                 "strategy.trace=true", "trainer.devices=2"], run)
    assert pp["strategy"] == "pp" and pp["dims"]["pp"] == 2 and pp["dims"]["dp"] == 1
    assert pp["steps"] == 20
    assert max_rel_diff(pp["train_loss"], reference["train_loss"]) <= REL_TOL
    assert pp["val_loss"] == pytest.approx(reference["val_loss"], rel=REL_TOL)  # the schedule's eval path
    # Each rank holds only its stage: about half the parameters, never the whole model.
    assert pp["model_state_bytes"]["params"] < 0.75 * reference["num_params"] * 4
    pipe = pp["pipeline"]
    assert pipe["stage_blocks"] == [[0, 2], [2, 4]]
    assert pipe["peak_inflight_microbatches_by_stage"] == [2, 1]  # 1F1B: P − stage, never M
    assert 0 < pipe["bubble_fraction"] < 1 and pipe["bubble_fraction_theory"] == pytest.approx(1 / 5)
    assert pp["comm"]["by_kind"]["pp_p2p"]["bytes_per_step"] > 0

    from parallelkit.tools.pipeline_timeline import main, render

    result = render(run)
    assert Path(result["png"]).stat().st_size > 10_000
    chrome = json.loads(Path(result["chrome_trace"]).read_text())["traceEvents"]
    computes = [e for e in chrome if e.get("ph") == "X" and e["tid"] == 0]
    # One traced step: every micro-batch forward and backward on every stage, and its loss on the last.
    assert sorted(e["name"][0] for e in computes) == ["B"] * 8 + ["F"] * 8 + ["L"] * 4
    assert sorted(e["name"] for e in computes if e["name"][0] == "L") == [f"L{mb} s1" for mb in range(4)]
    assert main([str(run), "--step", "0", "--out", str(tmp_path / "pic")]) == 0
    assert (tmp_path / "pic" / "pipeline_timeline.png").is_file()


# Every schedule through train.py once (pp=2 × dp=2 on 4 processes where it adds coverage, else 2);
# tests/distributed/test_pipeline_parallel.py checks every schedule at both shapes, gradients included.
@pytest.mark.parametrize(("schedule", "devices"), [("gpipe", 4), ("interleaved_1f1b", 4), ("zero_bubble", 2)])
def test_schedules_match_single(reference, tmp_path, schedule, devices):
    pp = run_ok([*PP_TINY, "strategy=pp", "strategy.pp=2", f"strategy.schedule={schedule}", f"trainer.devices={devices}"], tmp_path / "run")
    assert pp["dims"]["pp"] == 2 and pp["dims"]["dp"] == devices // 2
    assert max_rel_diff(pp["train_loss"], reference["train_loss"]) <= REL_TOL
    if devices == 4:
        assert pp["comm"]["by_kind"]["grad_allreduce"]["bytes_per_step"] > 0  # dp replicas averaged their stages


def test_accumulation_and_clipping_match_single(reference, tmp_path):
    """Gradients accumulated over 2 batches (Lightning zeroes between training_step and backward),
    clipped by the norm of the whole model (combined over the stages), with unbalanced stages."""
    extra = ["trainer.accumulate_grad_batches=2", "trainer.gradient_clip_val=0.05"]
    single = run_ok([*PP_TINY, *extra, "strategy=single"], tmp_path / "single")
    # Negative control: the clipping is active here, so a pipeline that clipped wrongly would show.
    assert max_rel_diff(single["train_loss"], reference["train_loss"]) > 1e-3
    pp = run_ok([*PP_TINY, *extra, "strategy=pp", "strategy.schedule=1f1b", "strategy.microbatches=2",
                 "strategy.split=[3]", "trainer.devices=2"], tmp_path / "pp")
    assert max_rel_diff(pp["train_loss"], single["train_loss"]) <= REL_TOL
    assert pp["pipeline"]["stage_blocks"] == [[0, 3], [3, 4]]  # the split override, not the balanced cut
    assert pp["comm"]["by_kind"]["pp_grad_norm"]["collectives_per_step"] == 1


def test_resume_restores_every_stage(tmp_path):
    """10 steps, save, resume to 20: every stage's weights and Adam state come back (same as one process)."""
    from torch.distributed.checkpoint import FileSystemReader

    base = [*PP_TINY, "optim.schedule.decay_steps=20"]

    def in_two_halves(args: list[str], name: str) -> dict:
        run_ok([*base, *args, "trainer.max_steps=10"], tmp_path / f"{name}1")
        ckpt = tmp_path / f"{name}1" / "checkpoints" / "last.ckpt"
        return run_ok([*base, *args, "trainer.max_steps=20", f"ckpt_path={ckpt}"], tmp_path / f"{name}2")

    single = in_two_halves(["strategy=single"], "single")
    pp = in_two_halves(["strategy=pp", "trainer.devices=2"], "pp")
    assert max_rel_diff(pp["train_loss"], single["train_loss"]) <= REL_TOL
    keys = set(FileSystemReader(tmp_path / "pp1" / "checkpoints" / "last.ckpt").read_metadata().state_dict_metadata)
    for name in ("tok_emb.weight", "layers.0.attn.q_proj.weight", "layers.3.mlp.down_proj.weight", "lm_head.weight"):
        assert f"state_dict.model.{name}" in keys and f"optimizer_0.state.model.{name}.exp_avg" in keys, name
    assert {"optimizer_0.param_groups_stages_0.0.lr", "optimizer_0.param_groups_stages_1.0.lr"} <= keys


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy.pp=2", "strategy.schedule=interleaved_1f1b", "model.n_layer=2"], "4 stages but the model has only 2 blocks"),
        (["strategy.pp=2", "strategy.microbatches=3"], "16 samples cannot be split into strategy.microbatches=3"),
    ],
)
def test_bad_pipeline_settings_fail_before_launch(tmp_path, overrides, message):
    proc = train([*PP_TINY, "strategy=pp", "trainer.devices=2", *overrides, f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr + proc.stdout
