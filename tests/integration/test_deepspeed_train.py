"""End-to-end ``strategy=deepspeed``: every ZeRO stage reproduces ``strategy=single`` through train.py.

One run per stage, each also exercising one more feature so the suite stays at a handful of launches
(DeepSpeed's start-up costs seconds per process): stage 1 with gradient accumulation, stage 2 with the
optimizer offloaded, stage 3 with parameters offloaded, stopped at step 10 and resumed from its checkpoint.
The exactness of each feature on its own (with SGD, which unlike Adam notices a mis-scaled gradient) is
tested in tests/distributed/test_deepspeed.py; here the whole stack — Lightning's loop, the schedule,
the summary, checkpoints — must agree with one process.
"""

from __future__ import annotations

import json
import math

import pytest

from test_train import TINY, max_rel_diff, run_ok, train

REL_TOL = 1e-4  # the correctness contract's bound for deepspeed (measured: ~1e-7)
WARMUP, MAX_STEPS, BASE_LR, MIN_LR_RATIO = 5, 20, 3e-3, 0.1
# A warm-up shorter than the run, so the cosine decay moves the learning rate within the 20 steps.
SCHEDULE = [f"optim.schedule.warmup_steps={WARMUP}", f"optim.schedule.decay_steps={MAX_STEPS}"]
DS = [*TINY, *SCHEDULE, "strategy=deepspeed", "trainer.devices=2"]


def scheduled_lr(step: int) -> float:
    """TrainModule's schedule after ``step`` optimizer steps (what Lightning's LambdaLR sets)."""
    if step < WARMUP:
        return BASE_LR * (step + 1) / WARMUP
    progress = min(1.0, (step - WARMUP) / MAX_STEPS)
    return BASE_LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return run_ok([*TINY, *SCHEDULE, "strategy=single"], tmp_path_factory.mktemp("single") / "run")


def check_run(summary: dict, reference: dict, stage: int) -> None:
    psi = summary["num_params"]
    assert summary["strategy"] == "deepspeed" and summary["world_size"] == 2
    assert summary["deepspeed"]["stage"] == stage
    assert summary["steps"] == reference["steps"] == MAX_STEPS
    assert max_rel_diff(summary["train_loss"], reference["train_loss"]) <= REL_TOL
    assert summary["train_loss"][-1] < summary["train_loss"][0] - 0.2  # it trained
    # The schedule drove the engine's optimizer: its lr after 20 steps is the decayed value, not the base.
    assert summary["deepspeed"]["lr"] == pytest.approx([scheduled_lr(MAX_STEPS)], rel=1e-6)
    assert scheduled_lr(MAX_STEPS) < 0.5 * BASE_LR
    # DeepSpeed's traffic was counted: at least one exchange of the fp32 gradients per step
    # (a ring all-reduce or a reduce-scatter + all-gather of 4Ψ sends 4Ψ per rank at N = 2); per step of
    # this job (a resumed job divides its own traffic by its own steps).
    ds_bytes = sum(v["bytes_per_step"] for k, v in summary["comm"]["by_kind"].items() if k.startswith("deepspeed_"))
    assert ds_bytes >= 4 * psi
    # Memory: parameters replicated up to stage 2, halved in stage 3; Adam moments (8Ψ) sharded from stage 1.
    state = summary["model_state_bytes"]
    if stage < 3:
        assert state["params"] >= 4 * psi
    else:
        assert state["params"] <= 0.51 * 4 * psi + 4096
    adam = 8 * psi if stage == 0 else 8 * psi / 2
    assert adam <= state["optimizer"] <= adam + 4 * psi + 4096  # + the fp32 master partition from stage 1 on


@pytest.mark.parametrize(
    "stage,extra",
    [
        # Stages 0 and 2 (and offload) are also checked against one process in tests/distributed/test_deepspeed.py.
        pytest.param(0, [], marks=pytest.mark.slow),
        (1, ["trainer.accumulate_grad_batches=2"]),
        pytest.param(2, ["strategy.offload=optimizer"], marks=pytest.mark.slow),
    ],
    ids=["stage0", "stage1-accumulate", "stage2-offload-optimizer"],
)
def test_stage_reproduces_single_process_loss(reference, tmp_path, stage, extra):
    extensions = tmp_path / "torch_extensions"  # where DeepSpeed compiles its ops (gcc) on first use
    summary = run_ok([*DS, f"strategy.stage={stage}", *extra], tmp_path / "run", env={"TORCH_EXTENSIONS_DIR": str(extensions)})
    check_run(summary, reference, stage)
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt" / "checkpoint").is_dir()  # a DeepSpeed checkpoint
    # Start-up compiles no op: the runs use none (DeepSpeed steps the optim= optimizer parallelkit hands it, offloaded
    # or not), and the shared-memory all-reduce of DeepSpeed's inference (deepspeed_shm_comm: 25-45 s of gcc
    # here, on every new machine) is not built.
    built = sorted(p.name for p in extensions.iterdir()) if extensions.exists() else []
    assert built == [], built


def test_deepspeed_is_started_without_building_its_inference_all_reduce():
    """The stand-in for DeepSpeed's shm op builder lands in DeepSpeed's module. The negative control: the
    ``import ... as`` spelling of that module is the torch package (deepspeed.comm star-imports torch), where
    the stand-in once went, leaving the build in place."""
    import importlib

    import torch

    from parallelkit.distributed.deepspeed_engine import _import_deepspeed, _no_shm_op

    _import_deepspeed("gloo")
    assert importlib.import_module("deepspeed.comm.torch").build_shm_op is _no_shm_op
    import deepspeed.comm.torch as spelled_as
    assert spelled_as is torch


def test_stage3_offload_params_resumes_from_its_checkpoint(reference, tmp_path):
    """Stop at step 10, resume from the checkpoint in a new job: the 20 losses equal one process's."""
    args = [*DS, "strategy.stage=3", "strategy.offload=params", f"hydra.run.dir={tmp_path / 'run'}"]
    first = train([*args, "trainer.max_steps=10", "checkpoint.every_n_steps=10"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-4000:]
    half = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert half["steps"] == 10
    assert max_rel_diff(half["train_loss"], reference["train_loss"][:10]) <= REL_TOL
    second = train([*args, "ckpt_path=last"], cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-4000:]
    resumed = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert resumed["deepspeed"]["offload"] == "params"
    check_run(resumed, reference, 3)  # steps 11-20 continue from the restored weights, moments and schedule


def test_continuing_another_strategys_checkpoint_at_stage_0_is_a_clear_error(tmp_path):
    """Any other checkpoint continues into stage 1-3, with or without offload (tests/integration/
    test_layout_change_resume.py); stage 0 keeps no partitions to write it into: refused before any rank starts,
    naming what works."""
    run_dir = tmp_path / "run"
    proc = train([*TINY, "strategy=single", "trainer.max_steps=2", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ckpt = next((run_dir / "checkpoints").glob("*.ckpt"))
    proc = train([*DS, "strategy.stage=0", "trainer.max_steps=4", f"ckpt_path='{ckpt}'", f"hydra.run.dir={tmp_path / 'ds'}"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "was not written by strategy=deepspeed" in proc.stderr and "needs strategy.stage 1-3" in proc.stderr
    assert not (tmp_path / "ds").exists()


# The validation itself is tested without processes in tests/distributed/test_deepspeed.py; here, one case
# of each path (strategy constructor, Trainer settings) ends the job with exit code 2 before any rank starts.
BAD_INPUT = [
    (["strategy.stage=2", "strategy.offload=params"], ["strategy.offload=params", "strategy.stage=2", "strategy.stage=3"]),
    (["trainer.gradient_clip_val=1.0", "+trainer.gradient_clip_algorithm=value"], ["gradient_clip_algorithm=value", "norm"]),
]


@pytest.mark.parametrize("overrides,words", BAD_INPUT, ids=[" ".join(c[0]) for c in BAD_INPUT])
def test_bad_input_fails_before_launch(overrides, words, tmp_path):
    run_dir = tmp_path / "run"
    proc = train([*TINY, "strategy=deepspeed", *overrides, f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    for word in words:
        assert word in proc.stderr, f"{word!r} missing from:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (run_dir / "checkpoints").exists()  # nothing started
