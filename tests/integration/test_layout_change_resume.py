"""A checkpoint continues under another layout as one process's uninterrupted run (issue 33, item 2 in part).

Each source layout trains 10 steps and saves; the continuation to 20 steps under another layout must give steps
11-20 of ``strategy=single``'s 20-step run within ``REL_TOL`` (parameters, Adam's moments and step counts, the
learning-rate schedule and the data position carried over). The pairs cover each way a checkpoint is stored and
read: a one-process file (single, ddp), a sharded directory with one set of optimizer groups (tp, ZeRO-3), a
pipeline's per-stage groups and DeepSpeed's flat ZeRO partitions (stages 2 and 3), read by a one-process loader, a
per-rank loader, Lightning's DTensor loader and a DeepSpeed engine (each rank its partition).
Negative control: a continuation that drops the optimizer state (a fresh Adam at step 11) misses by far.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sample_log
import torch
from test_train import REL_TOL, TINY, max_rel_diff, run_ok

from parallelkit.distributed.checkpoint_io import fqn_optimizer_states, load_unsharded

# Parameters and Adam's moments at step 20 against single's: a multi-rank layout's own arithmetic (the all-reduce's or
# the micro-batches' summation order, amplified by Adam where second moments are tiny) already moves its straight
# 20-step run away from single's (measured: parameters by 3.2-3.4e-6, first moments by 1.5-3e-8, second moments by
# 1-2e-9, for ddp, zero 3, pp and DeepSpeed at 2 ranks). A continuation (10 steps under the source, 10 under the
# target) is held to twice the larger of its source's own distance and the pipeline's (always measured here: the
# target's arithmetic, at most the largest of these).
BASE = [*TINY, "model.n_layer=4", "trainer.limit_val_batches=0"]  # 4 layers: an interleaved pipeline's 2×2 stages
LAYOUTS = {
    "single": ["strategy=single"],
    "ddp": ["strategy=ddp", "trainer.devices=2"],
    "zero3": ["strategy=zero", "strategy.stage=3", "trainer.devices=2"],
    "tp": ["strategy=tp", "strategy.tp=2", "trainer.devices=2"],
    "pp": ["strategy=pp", "strategy.pp=2", "strategy.microbatches=2", "trainer.devices=2"],
    "zero2": ["strategy=zero", "strategy.stage=2", "trainer.devices=2"],
    "ds2": ["strategy=deepspeed", "strategy.stage=2", "trainer.devices=2"],
    "ds3": ["strategy=deepspeed", "strategy.stage=3", "trainer.devices=2"],
    "ds2_4": ["strategy=deepspeed", "strategy.stage=2", "trainer.devices=4"],
    "ddp4": ["strategy=ddp", "trainer.devices=4"],
    "ppi": ["strategy=pp", "strategy.pp=2", "strategy.microbatches=2", "strategy.schedule=interleaved_1f1b", "trainer.devices=2"],
    "zero3_4": ["strategy=zero", "strategy.stage=3", "trainer.devices=4"],
    "dp2tp2": ["strategy=hybrid4d", "strategy.dp=2", "strategy.tp=2", "strategy.pp=1", "strategy.microbatches=2", "trainer.devices=4"],
    "pp2dp2": ["strategy=hybrid4d", "strategy.dp=2", "strategy.tp=1", "strategy.pp=2", "strategy.microbatches=2", "trainer.devices=4"],
    "zero3_groups": ["strategy=zero", "strategy.stage=3", "strategy.sharding_group=2", "trainer.devices=4"],
    "zero2_offload": ["strategy=zero", "strategy.stage=2", "strategy.offload=optimizer", "trainer.devices=2"],
    "zero3_offload": ["strategy=zero", "strategy.stage=3", "strategy.offload=params", "trainer.devices=2"],
    "tp_sp": ["strategy=tp", "strategy.tp=2", "strategy.sequence_parallel=true", "trainer.devices=2"],
    "ds1": ["strategy=deepspeed", "strategy.stage=1", "trainer.devices=2"],
    "ds3_params": ["strategy=deepspeed", "strategy.stage=3", "strategy.offload=params", "trainer.devices=2"],
}
# (saved by, continued by): every pair that failed before (a pipeline's per-stage groups read whole or by another
# layout, a sharded directory read by DDP, a one-process file read per stage), and the reverse directions.
# DeepSpeed's directories (flat ZeRO partitions) are read whole by the others; into an engine each rank keeps its
# partition; DeepSpeed at another stage or rank count goes the same way (its own loader needs the saved ones).
PAIRS = [("pp", "single"), ("pp", "tp"), ("zero3", "ddp"), ("ddp", "pp"), ("ds2", "zero2"), ("pp", "ds3"), ("ddp", "ddp4")]
SLOW_PAIRS = [("pp", "ddp"), ("pp", "zero3"), ("tp", "pp"), ("single", "pp"), ("zero3", "pp"),
              ("ds3", "tp"), ("ds2", "ds3"), ("ds2", "ds2_4"), ("tp", "ds2"), ("ds3", "single"),
              # the matrix, beside the pairs above
              ("single", "tp"), ("tp", "zero3"), ("zero3_4", "ddp"), ("ppi", "single"), ("dp2tp2", "pp2dp2"),
              # the rest of the list: sharding groups, offload, sequence parallel, DeepSpeed stage 1
              ("zero3_groups", "tp_sp"), ("tp_sp", "zero2_offload"), ("zero3_offload", "ds1"), ("ds1", "zero3_groups"),
              ("ddp", "zero3_offload"),
              # DeepSpeed with its parameters offloaded (ZeRO-Infinity on the host) both ways
              ("ddp", "ds3_params"), ("ds3_params", "tp")]


def final_state(run_dir: Path) -> tuple[dict, dict]:
    """``(parameters, per-parameter optimizer state)`` by name, of a run's last checkpoint, whatever its layout."""
    checkpoint = load_unsharded(run_dir / "checkpoints" / "last.ckpt")
    params = checkpoint["state_dict"]
    return params, fqn_optimizer_states(checkpoint, list(params))[0]["state"]  # GPT: every state_dict entry a parameter


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("single20") / "run"
    summary = run_ok([*BASE, *LAYOUTS["single"], *sample_log.args(run_dir.parent / "samples")], run_dir, env=sample_log.ENV)
    return {**summary, "run_dir": run_dir, "samples": sample_log.samples_per_step(run_dir.parent / "samples")}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each source layout trains 20 steps straight, keeping its step-10 checkpoint: that is what is continued, and
    the straight run's step-20 state measures the layout's own distance from single's."""
    cache: dict[str, tuple[str, Path]] = {}

    def checkpoint_of(layout: str) -> tuple[str, Path]:
        if layout not in cache:
            run_dir = tmp_path_factory.mktemp(f"saved_{layout}") / "run"
            run_ok([*BASE, *LAYOUTS[layout], "checkpoint.every_n_steps=10", "checkpoint.save_top_k=-1"], run_dir)
            cache[layout] = (str(next((run_dir / "checkpoints").glob("*-step=10.ckpt"))), run_dir)
        return cache[layout]

    return checkpoint_of


def distance(a: tuple[dict, dict], b: tuple[dict, dict]) -> dict[str, float]:
    """The largest absolute difference of the parameters and of each Adam moment between two final states."""
    (pa, oa), (pb, ob) = a, b
    assert set(pa) == set(pb) and set(oa) == set(ob)
    out = {"params": max(float((pa[n] - pb[n]).abs().max()) for n in pb)}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = max(float((oa[n][key] - ob[n][key]).abs().max()) for n in ob)
    return out


def continued(saved, source: str, target: str, tmp_path) -> dict:
    summary = run_ok([*BASE, *LAYOUTS[target], f"ckpt_path='{saved(source)[0]}'", *sample_log.args(tmp_path / "samples")], tmp_path / "run",
                     env=sample_log.ENV)
    return {**summary, "samples": sample_log.samples_per_step(tmp_path / "samples")}


@pytest.mark.parametrize("source, target", PAIRS + [pytest.param(*p, marks=pytest.mark.slow) for p in SLOW_PAIRS],
                         ids=[f"{s}_to_{t}" for s, t in PAIRS + SLOW_PAIRS])
def test_continues_as_one_uninterrupted_process(source, target, reference, saved, tmp_path):
    run = continued(saved, source, target, tmp_path)
    assert len(run["train_loss"]) == 20  # the history of the first 10 steps came along
    assert max_rel_diff(reference["train_loss"][10:], run["train_loss"][10:]) <= REL_TOL, (reference["train_loss"][10:], run["train_loss"][10:])
    # the data position: steps 11-20 trained on the samples of the uninterrupted run's steps 11-20, each once
    assert sorted(run["samples"]) == list(range(10, 20))
    assert all(run["samples"][step] == reference["samples"][step] for step in range(10, 20))
    reference_state = final_state(reference["run_dir"])
    got = distance(final_state(tmp_path / "run"), reference_state)
    own, pipeline = (distance(final_state(saved(layout)[1]), reference_state) for layout in (source, "pp"))
    assert all(got[k] <= 2 * max(own[k], pipeline[k]) for k in got), (got, own, pipeline)
    steps = {float(s["step"]) for s in final_state(tmp_path / "run")[1].values()}
    assert steps == {20.0}


def test_negative_control_without_the_optimizer_state(reference, tmp_path):
    """The same continuation from the parameters alone (weights exported, a fresh optimizer): steps 11-20 differ."""
    import torch

    fresh = tmp_path / "weights_only.ckpt"
    source = tmp_path / "source"
    run_ok([*BASE, *LAYOUTS["single"], "trainer.max_steps=10"], source)
    checkpoint = torch.load(source / "checkpoints" / "last.ckpt", weights_only=False)
    for state in checkpoint["optimizer_states"]:
        state["state"] = {}  # Adam's moments and step counts gone
    torch.save(checkpoint, fresh)
    run = run_ok([*BASE, *LAYOUTS["pp"], f"ckpt_path={fresh}"], tmp_path / "run")
    assert max_rel_diff(reference["train_loss"][10:], run["train_loss"][10:]) > 100 * REL_TOL


def test_negative_control_without_the_data_position(reference, tmp_path):
    """A ddp(2) checkpoint whose data position is dropped, continued at ddp(4): the samples of step 11 are not the
    uninterrupted run's (the sample comparison above sees the position the continuation carried)."""
    source = tmp_path / "source"
    run_ok([*BASE, *LAYOUTS["ddp"], "trainer.max_steps=10"], source)
    checkpoint = torch.load(source / "checkpoints" / "last.ckpt", weights_only=False)
    datamodule_keys = [k for k in checkpoint if k.endswith("DataModule")]
    assert datamodule_keys, sorted(checkpoint)
    for key in datamodule_keys:
        del checkpoint[key]
    stripped = tmp_path / "no_position.ckpt"
    torch.save(checkpoint, stripped)
    run_ok([*BASE, *LAYOUTS["ddp4"], f"ckpt_path={stripped}", *sample_log.args(tmp_path / "samples")], tmp_path / "run", env=sample_log.ENV)
    samples = sample_log.samples_per_step(tmp_path / "samples")
    assert samples[10] != reference["samples"][10]


MOE = ["model=moe_gpt", "model.num_experts=4", "model.top_k=2", "model.capacity_factor=2.0"]  # no token dropped: exact


@pytest.mark.slow
def test_expert_parallel_checkpoint_continues_in_one_process(tmp_path):
    """moe ep2 → single: each rank's experts saved under its own groups, read whole by one process."""
    reference = run_ok([*BASE, *MOE, "strategy=single", *sample_log.args(tmp_path / "ref_samples")], tmp_path / "single20", env=sample_log.ENV)
    run_ok([*BASE, *MOE, "strategy=moe", "strategy.ep=2", "trainer.devices=2", "trainer.max_steps=10"], tmp_path / "ep2")
    run = run_ok([*BASE, *MOE, "strategy=single", f"ckpt_path={tmp_path / 'ep2' / 'checkpoints' / 'last.ckpt'}", *sample_log.args(tmp_path / "samples")],
                 tmp_path / "run", env=sample_log.ENV)
    assert max_rel_diff(reference["train_loss"][10:], run["train_loss"][10:]) <= REL_TOL, (reference["train_loss"][10:], run["train_loss"][10:])
    ref_samples, samples = sample_log.samples_per_step(tmp_path / "ref_samples"), sample_log.samples_per_step(tmp_path / "samples")
    assert all(samples[step] == ref_samples[step] for step in range(10, 20))
