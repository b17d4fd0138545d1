"""Any LightningModule under every parallelkit strategy that needs no model-specific plan, on 2 real gloo ranks.

Two modules that are not parallelkit's (``own_modules.py``): Lightning's own ``BoringModel`` and a regressor
written as a Lightning user writes one (blocks in a ModuleList, ``self.log(..., sync_dist=True)``, an LR
schedule, validation). Each trains for a few steps in a plain ``lightning.pytorch.Trainer`` with a parallelkit
strategy (no Hydra, no ``parallelkit.run``), each rank on its own half of every batch through Lightning's
``DistributedSampler``; the reference trains the same module in this process on the whole batch. Exact
strategies must give the reference's per-step loss (the mean of the ranks' losses), its logged
``train_loss``/``val_loss`` and its final parameters; approximate techniques (fp16 traffic, mixed precision,
compression, Local SGD) must train, keep the replicas equal, and send what they claim. Every run must have
communicated. The negative control feeds both ranks the same data (no sharding): the comparison must catch it.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed.harness import run_ranks
from tests.distributed.own_modules import fit

REL = 1e-5
# DeepSpeed reduces in flat fp32 buffers in another order than one process sums; the integration tests and the
# README hold it to the same bound.
REL_DEEPSPEED = 1e-4
WORLD = 2


def _zero(**kwargs):
    from parallelkit.strategies.zero import ZeroStrategy

    return ZeroStrategy(timeout_s=60, **kwargs)


def _ddp(**kwargs):
    from parallelkit.strategies import DDPStrategy

    return DDPStrategy(timeout_s=60, **kwargs)


def _deepspeed(**kwargs):
    from parallelkit.strategies.deepspeed import DeepSpeedStrategy

    return DeepSpeedStrategy(timeout_s=60, **kwargs)


def _recompute(module):
    from parallelkit.distributed.recompute import apply_recompute

    apply_recompute(module, "full")


# name → (strategy factory, callbacks factory or None, prepare(module) or None, relative tolerance)
EXACT = {
    "ddp": (_ddp, None, None, REL),
    "zero1": (functools.partial(_zero, stage=1), None, None, REL),
    "zero2": (functools.partial(_zero, stage=2), None, None, REL),
    "zero2-offload": (functools.partial(_zero, stage=2, offload="optimizer"), None, None, REL),
    "zero3": (functools.partial(_zero, stage=3), None, None, REL),
    "zero3-offload": (functools.partial(_zero, stage=3, offload="params"), None, None, REL),
    "zero3-by-class": (functools.partial(_zero, stage=3, shard_modules=["Linear"]), None, None, REL),
    "zero3-by-size": (functools.partial(_zero, stage=3, shard_min_params=40), None, None, REL),
    "deepspeed2": (functools.partial(_deepspeed, stage=2), None, None, REL_DEEPSPEED),
    "deepspeed3": (functools.partial(_deepspeed, stage=3), None, None, REL_DEEPSPEED),
    "hierarchical_allreduce": (_ddp, lambda: [_callback("hierarchical_allreduce.HierarchicalAllReduce", local_size=2)], None, REL),
    "recompute": (_ddp, None, _recompute, REL),
}


def _callback(path: str, **kwargs):
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(f"parallelkit.callbacks.{module}"), name)(**kwargs)


def _train_both(rank: int, world: int, name: str, table: str) -> dict:
    make, callbacks, prepare, _ = {"exact": EXACT, "approximate": APPROXIMATE, "slow": SLOW}[table][name]
    return {model: fit(model, world, make, callbacks, prepare) for model in ("boring", "tiny")}


@functools.lru_cache(maxsize=None)
def _reference(model: str, prepare=None) -> dict:
    return fit(model, WORLD, None, None, prepare)


def _rank_mean_losses(results: list[dict], model: str) -> list[float]:
    per_rank = [r[model]["losses"] for r in results]
    assert all(len(losses) == len(per_rank[0]) for losses in per_rank)
    return [sum(step) / len(step) for step in zip(*per_rank)]


def _max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (len(a), len(b))
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def _assert_params_close(got: dict, want: dict, rel: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rel, atol=rel * 1e-2, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("name", list(EXACT))
def test_exact_strategy_trains_any_lightning_module_like_one_process(name, tmp_path):
    results = run_ranks(_train_both, WORLD, tmp_path, name, "exact", timeout_s=300)
    rel = EXACT[name][3]
    for model in ("boring", "tiny"):
        reference = _reference(model, EXACT[name][2])
        mine = [r[model] for r in results]
        assert _max_rel(_rank_mean_losses(results, model), reference["losses"]) <= rel, (model, _rank_mean_losses(results, model), reference["losses"])
        for r in mine:  # every rank ends with the one model the single process has
            _assert_params_close(r["params"], reference["params"], rel)
            assert r["bytes"] > 0, f"{model}: no traffic counted"  # the ranks really averaged something
        if model == "tiny":  # logged with sync_dist=True: the global mean, as one process logs it
            for key in ("train_loss", "val_loss"):
                assert abs(mine[0]["metrics"][key] - reference["metrics"][key]) <= rel * abs(reference["metrics"][key]) + 1e-7, key
    if name == "zero3":  # the default units: the regressor's blocks, and the module itself as the root
        assert results[0]["tiny"]["fsdp_units"] == ["", "blocks.0", "blocks.1", "blocks.2"]
        assert results[0]["boring"]["fsdp_units"] == [""]  # no repeated blocks: one unit, as FSDP does
    if name == "zero3-by-class":
        assert results[0]["tiny"]["fsdp_units"] == ["", "blocks.0.0", "blocks.1.0", "blocks.2.0", "inp", "out"]


def _amp(dtype: str, **kwargs):
    return lambda: [_callback("amp.AMP", dtype=dtype, **kwargs)]


APPROXIMATE = {
    # name → (strategy, callbacks, prepare, the bound on the loss's distance from fp32 one-process training)
    "ddp_fp16": (lambda: _ddp(ddp_comm_hook=_fp16_hook()), None, None, 1e-2),
    "amp-bf16-zero3": (functools.partial(_zero, stage=3), _amp("bf16"), None, 5e-2),
    # A scale these small models' gradients do not overflow at: no step is skipped (skipping is tested elsewhere).
    "amp-fp16-ddp": (_ddp, _amp("fp16", init_loss_scaling=256.0), None, 5e-2),
    "dgc": (_ddp, lambda: [_callback("dgc.DeepGradientCompression", rampup_steps=2)], None, None),
    "local_sgd": (_ddp, lambda: [_callback("local_sgd.LocalSGDCallback", k_steps=2)], None, None),
    "powersgd": (_ddp, lambda: [_callback("grad_compression.GradCompression", method="powersgd", start_iter=2)], None, None),
    "grad_compression-fp16": (_ddp, lambda: [_callback("grad_compression.GradCompression", method="fp16")], None, 1e-2),
}


def _fp16_hook():
    from parallelkit.distributed.comm_hooks import fp16_compress_hook

    return fp16_compress_hook


@pytest.mark.parametrize("name", list(APPROXIMATE))
def test_approximate_technique_trains_any_lightning_module(name, tmp_path):
    results = run_ranks(_train_both, WORLD, tmp_path, name, "approximate", timeout_s=300)
    bound = APPROXIMATE[name][3]
    for model in ("boring", "tiny"):
        reference = _reference(model)
        losses = _rank_mean_losses(results, model)
        assert all(torch.isfinite(torch.tensor(losses))), losses
        if bound is not None:
            assert _max_rel(losses, reference["losses"]) <= bound, (model, losses, reference["losses"])
        # The replicas agree at the end (the technique's last exchange made them one model again).
        _assert_params_close(results[1][model]["params"], results[0][model]["params"], 1e-6)
        assert results[0][model]["bytes"] > 0, f"{model}: no traffic counted"
    if name == "ddp_fp16":  # a ring all-reduce of every gradient in fp16 per step: 2(n-1)/n × 2 bytes × parameters
        for model in ("boring", "tiny"):  # ... plus gloo's headers: 12 of 48 bytes per all-reduce on 2 ranks
            run = results[0][model]
            numel = sum(p.numel() for p in run["params"].values())
            grad = run["by_kind"]["grad_allreduce"]
            payload = numel * 2 * 2 * (WORLD - 1) / WORLD * len(run["losses"])
            assert grad["bytes_per_step"] == payload + grad["collectives_per_step"] * 12 * 48


def _train_unsharded(rank: int, world: int) -> dict:
    make = EXACT["zero3"][0]
    return {"tiny": fit("tiny", world, make, shard_data=False)}


def test_negative_control_ranks_on_the_same_data_do_not_match(tmp_path):
    """Without the sampler each rank trains on the first half-batch only: the parity check must see it."""
    results = run_ranks(_train_unsharded, WORLD, tmp_path)
    reference = _reference("tiny")
    assert _max_rel(_rank_mean_losses(results, "tiny"), reference["losses"]) > 1e-3


# ------------------------------------------------------------------------------------ beyond the defaults
def _train_grouped(rank: int, world: int) -> dict:
    return {stage: fit("tiny", world, functools.partial(_zero, stage=stage, sharding_group=2)) for stage in (2, 3)}


def test_grouped_sharding_trains_any_lightning_module_like_one_process(tmp_path):
    """4 ranks in 2 sharding groups of 2 (HSDP at stage 3): shard inside a group, replicate across."""
    results = run_ranks(_train_grouped, 4, tmp_path, timeout_s=300)
    reference = fit("tiny", 4, None)
    for stage in (2, 3):
        per_rank = [r[stage]["losses"] for r in results]
        means = [sum(step) / len(step) for step in zip(*per_rank)]
        assert _max_rel(means, reference["losses"]) <= REL, stage
        for r in results:
            _assert_params_close(r[stage]["params"], reference["params"], REL)
        kinds = results[0][stage]["by_kind"]
        assert kinds, stage
    # Stage 3 across the groups: the replicas all-reduce their reduced shards (HSDP).
    assert results[0][3]["by_kind"]["grad_all_reduce"]["bytes_per_step"] > 0


def _train_self_sharding(rank: int, world: int, conflicting: bool) -> dict:
    make = functools.partial(_zero, stage=3, **({"shard_modules": ["Linear"]} if conflicting else {}))
    return fit("self_sharding", world, make)


def test_units_from_the_modules_own_configure_model(tmp_path):
    """Lightning's convention: the module shards its blocks itself (on ``self.device_mesh["data_parallel"]``);
    stage 3 keeps those units and shards the rest at the root."""
    results = run_ranks(_train_self_sharding, WORLD, tmp_path, False, timeout_s=300)
    reference = _reference("tiny")  # the same module without configure_model: the same initial weights
    assert _max_rel(_rank_mean_losses([{"m": r} for r in results], "m"), reference["losses"]) <= REL
    for r in results:
        _assert_params_close(r["params"], reference["params"], REL)
    assert results[0]["fsdp_units"] == ["", "blocks.0", "blocks.1", "blocks.2"]
    # A policy on top of the module's own units is a conflict, said before training.
    from tests.distributed.harness import RankFailure

    with pytest.raises(RankFailure, match="already shards the model"):
        run_ranks(_train_self_sharding, WORLD, tmp_path, True, timeout_s=120)


def _train_manual(rank: int, world: int, stage: int) -> dict:
    return fit("manual", world, functools.partial(_zero, stage=stage))


def test_manual_optimization_with_two_optimizers(tmp_path):
    """Stage 3 reduces gradients in backward (FSDP2): two optimizers step what they own, like one process.
    Stages 0-2 average at each optimizer step, so a second optimizer would average again: refused."""
    results = run_ranks(_train_manual, WORLD, tmp_path, 3, timeout_s=300)
    reference = _reference("manual")
    assert _max_rel(_rank_mean_losses([{"m": r} for r in results], "m"), reference["losses"]) <= REL
    for r in results:
        _assert_params_close(r["params"], reference["params"], REL)
    from tests.distributed.harness import RankFailure

    with pytest.raises(RankFailure, match="returned 2 optimizers"):
        run_ranks(_train_manual, WORLD, tmp_path, 2, timeout_s=120)


def _compile(module):
    from parallelkit.distributed.compile import apply_compile

    apply_compile(module, "cpu")


SLOW = {"compile": (_ddp, None, _compile, REL)}


@pytest.mark.slow
def test_compiled_lightning_module_under_ddp(tmp_path):
    """``compile=true``'s regional compilation of a module that is not parallelkit's (inductor, C++ on CPU)."""
    results = run_ranks(_train_both, WORLD, tmp_path, "compile", "slow", timeout_s=600)
    for model in ("boring", "tiny"):
        reference = _reference(model)
        assert _max_rel(_rank_mean_losses(results, model), reference["losses"]) <= REL
        for r in results:
            _assert_params_close(r[model]["params"], reference["params"], REL)
