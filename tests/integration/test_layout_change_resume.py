"""A checkpoint continues under another layout as one process's uninterrupted run (issue 33, item 2 in part).

Each source layout trains 10 steps and saves; the continuation to 20 steps under another layout must give steps
11-20 of ``strategy=single``'s 20-step run within ``REL_TOL`` (parameters, Adam's moments and step counts, the
learning-rate schedule and the data position carried over). The pairs cover each way a checkpoint is stored and
read: a one-process file (single, ddp), a sharded directory with one set of optimizer groups (tp, ZeRO-3), and a
pipeline's per-stage groups, read by a one-process loader, a per-rank loader and Lightning's DTensor loader.
Negative control: a continuation that drops the optimizer state (a fresh Adam at step 11) misses by far.
"""

from __future__ import annotations

import pytest

from test_train import REL_TOL, TINY, max_rel_diff, run_ok

BASE = [*TINY, "trainer.limit_val_batches=0"]
LAYOUTS = {
    "single": ["strategy=single"],
    "ddp": ["strategy=ddp", "trainer.devices=2"],
    "zero3": ["strategy=zero", "strategy.stage=3", "trainer.devices=2"],
    "tp": ["strategy=tp", "strategy.tp=2", "trainer.devices=2"],
    "pp": ["strategy=pp", "strategy.pp=2", "strategy.microbatches=2", "trainer.devices=2"],
}
# (saved by, continued by): every pair that failed before (a pipeline's per-stage groups read whole or by another
# layout, a sharded directory read by DDP, a one-process file read per stage), and the reverse directions.
PAIRS = [("pp", "single"), ("pp", "tp"), ("zero3", "ddp"), ("ddp", "pp")]
SLOW_PAIRS = [("pp", "ddp"), ("pp", "zero3"), ("tp", "pp"), ("single", "pp"), ("zero3", "pp")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return run_ok([*BASE, *LAYOUTS["single"]], tmp_path_factory.mktemp("single20") / "run")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cache: dict[str, str] = {}

    def checkpoint_of(layout: str) -> str:
        if layout not in cache:
            run_dir = tmp_path_factory.mktemp(f"saved_{layout}") / "run"
            run_ok([*BASE, *LAYOUTS[layout], "trainer.max_steps=10"], run_dir)
            cache[layout] = str(run_dir / "checkpoints" / "last.ckpt")
        return cache[layout]

    return checkpoint_of


def continued(saved, source: str, target: str, tmp_path) -> dict:
    return run_ok([*BASE, *LAYOUTS[target], f"ckpt_path={saved(source)}"], tmp_path / "run")


@pytest.mark.parametrize("source, target", PAIRS + [pytest.param(*p, marks=pytest.mark.slow) for p in SLOW_PAIRS],
                         ids=[f"{s}_to_{t}" for s, t in PAIRS + SLOW_PAIRS])
def test_continues_as_one_uninterrupted_process(source, target, reference, saved, tmp_path):
    run = continued(saved, source, target, tmp_path)
    assert len(run["train_loss"]) == 20  # the history of the first 10 steps came along
    assert max_rel_diff(reference["train_loss"][10:], run["train_loss"][10:]) <= REL_TOL, (reference["train_loss"][10:], run["train_loss"][10:])


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
