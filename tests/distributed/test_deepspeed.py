"""``apply_deepspeed`` (ZeRO stages 0-3, offload, accumulation) on 2 real gloo ranks against one process.

Each rank trains on its own half of every global batch (and, with accumulation, on two micro-batches of
it). DeepSpeed must then equal one process that trains on the whole batch: same mean loss every step,
same weights at the end, within fp32 round-off. The optimizer is SGD with momentum and a warm-up
schedule (``LambdaLR`` stepped by the caller, as Lightning does): unlike Adam, SGD sees a gradient
scaled twice or clipped, so the negative controls below (DeepSpeed's defaults: loss divided by the
accumulation steps a second time; clipping at 1.0) must fail the same comparison. Traffic must be
counted, and the memory accounting must show what each stage shards.

All variants run in one launch of 2 ranks: DeepSpeed's start-up costs seconds per process.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.testing import assert_close

from parallelkit.callbacks.run_summary import os_bytes_written
from parallelkit.distributed.comm_stats import CommStats
from parallelkit.distributed.deepspeed_config import auto_bucket_elements, build_deepspeed_config
from parallelkit.models.gpt import GPT

from .harness import run_ranks

WORLD_SIZE = 2
VOCAB, SEQ, GLOBAL_BATCH, STEPS = 64, 16, 8, 4
LR, MOMENTUM, WARMUP = 0.5, 0.9, 3
CLIP = 0.05  # below this model's gradient norm (about 0.5), above nothing DeepSpeed clips by default
INIT_SEED, DATA_SEED = 0, 11
RTOL, ATOL = 1e-5, 1e-6

# name → (stage, offload, accumulate, gradient clipping, what to break). "double_scaled" divides the loss by
# the accumulation steps in DeepSpeed too (its default); "default_clipping" leaves gradient_clipping out of
# the config (DeepSpeed then clips at 1.0, not at CLIP).
VARIANTS = {
    "stage0": (0, "none", 1, None, None),
    "stage1": (1, "none", 1, None, None),
    "stage2_accumulate": (2, "none", 2, None, None),
    "stage3": (3, "none", 1, None, None),
    "stage2_offload_optimizer": (2, "optimizer", 1, None, None),
    "stage3_offload_params": (3, "params", 2, None, None),
    "stage1_clipped": (1, "none", 1, CLIP, None),
    "double_scaled": (2, "none", 2, None, "double_scaled"),
    "default_clipping": (1, "none", 1, CLIP, "default_clipping"),
}


def _model() -> GPT:
    torch.manual_seed(INIT_SEED)
    return GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_embd=32, n_head=2)


def _batches() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, SEQ), generator=gen)
    return x, torch.roll(x, -1, dims=-1)


def _optimizer_and_schedule(params):
    optimizer = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / WARMUP))


def _train_deepspeed(rank: int, world_size: int) -> dict:
    import os

    # DeepSpeed asserts LOCAL_RANK exists (Lightning and torchrun set it; this harness does not).
    os.environ.update(LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu")
    # torch 2.13 warns (to stderr, once) when DeepSpeed first calls all_gather_into_tensor: a write that is
    # not traffic, inside the window where written bytes are compared with counted ones.
    warnings.simplefilter("ignore", FutureWarning)
    import deepspeed

    from parallelkit.distributed.deepspeed_engine import (
        apply_deepspeed,
        counting_deepspeed,
        deepspeed_state_bytes,
    )

    x, y = _batches()
    local = GLOBAL_BATCH // world_size
    results = {}
    for name, (stage, offload, accumulate, clip, broken) in VARIANTS.items():
        model = _model()
        optimizer, schedule = _optimizer_and_schedule(model.parameters())
        config = build_deepspeed_config(
            stage, offload, micro_batch_size=local // accumulate, accumulate=accumulate, gradient_clip_val=clip,
            bucket_elements=auto_bucket_elements(model),
        )
        if broken == "default_clipping":
            del config["gradient_clipping"]
        stats = CommStats()
        engine = apply_deepspeed(model, optimizer, config)
        losses, lrs, state = [], [], None
        written = os_bytes_written()
        with counting_deepspeed(stats):  # the engine's collectives, as the strategy counts them
            for step in range(STEPS):
                rows = slice(rank * local, (rank + 1) * local)
                step_loss = 0.0
                for xm, ym in zip(x[step, rows].chunk(accumulate), y[step, rows].chunk(accumulate)):
                    loss = model.loss(engine(xm), ym) / accumulate  # as Lightning hands it over
                    engine.backward(loss, scale_wrt_gas=broken == "double_scaled")
                    step_loss += loss.item()
                if step == 0:
                    state = deepspeed_state_bytes(engine)[0]  # gradients are still held here
                lrs.append(engine.optimizer.param_groups[0]["lr"])
                engine.step()
                schedule.step()
                losses.append(step_loss)
        written = os_bytes_written() - written
        comm = {**stats.totals(), "written": written}
        after = deepspeed_state_bytes(engine)[0]
        state = {k: max(state[k], after[k]) for k in state}
        with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=stage == 3):
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        results[name] = {"losses": losses, "lrs": lrs, "weights": weights, "comm": comm, "state": state}
        engine.destroy()
    return results


def _train_reference(schedule_on: bool = True, clip: float | None = None) -> dict:
    model = _model()
    optimizer, schedule = _optimizer_and_schedule(model.parameters())
    x, y = _batches()
    losses = []
    for step in range(STEPS):
        loss = model.loss(model(x[step]), y[step])
        optimizer.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if schedule_on:
            schedule.step()
        losses.append(loss.item())
    return {"losses": losses, "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    ranks = run_ranks(_train_deepspeed, WORLD_SIZE, tmp_path_factory.mktemp("deepspeed"), timeout_s=400)
    num_params = sum(p.numel() for p in _model().parameters())
    references = {None: _train_reference(), CLIP: _train_reference(clip=CLIP)}
    return {"ranks": ranks, "references": references, "psi": num_params}


def _mean_losses(ranks: list, name: str) -> list[float]:
    return [sum(r[name]["losses"][s] for r in ranks) / len(ranks) for s in range(STEPS)]


@pytest.mark.parametrize("name", [n for n, v in VARIANTS.items() if v[4] is None])
def test_deepspeed_matches_one_process(runs, name):
    ranks, ref = runs["ranks"], runs["references"][VARIANTS[name][3]]
    assert_close(torch.tensor(_mean_losses(ranks, name)), torch.tensor(ref["losses"]), rtol=RTOL, atol=ATOL)
    for rank in ranks:  # every rank ends with the reference's weights
        for param, expected in ref["weights"].items():
            assert_close(rank[name]["weights"][param], expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name} {param}: {m}")
    # The schedule set the learning rate the engine's optimizer stepped with: warm-up 1/3, 2/3, 1, 1.
    assert ranks[0][name]["lrs"] == pytest.approx([LR * min(1.0, (s + 1) / WARMUP) for s in range(STEPS)])


@pytest.mark.parametrize("name", ["double_scaled", "default_clipping"])
def test_negative_controls_are_caught(runs, name):
    """DeepSpeed's defaults (second division by the accumulation steps; clipping at 1.0) change training."""
    ref = runs["references"][VARIANTS[name][3]]
    diff = max((runs["ranks"][0][name]["weights"][p] - w).abs().max().item() for p, w in ref["weights"].items())
    assert diff > 100 * ATOL, f"{name}: weights equal the reference (max diff {diff:.2e}); the check could not fail"


def test_schedule_and_clipping_matter():
    """Without the schedule, or without clipping, the reference differs: the checks above are not vacuous."""
    reference = _train_reference()
    assert abs(reference["losses"][-1] - _train_reference(schedule_on=False)["losses"][-1]) > 1e-3
    assert abs(reference["losses"][-1] - _train_reference(clip=CLIP)["losses"][-1]) > 1e-3


def test_traffic_is_counted(runs):
    psi4 = 4 * runs["psi"]  # fp32 bytes of the model
    for rank in runs["ranks"]:
        comm = {name: rank[name]["comm"] for name in VARIANTS}
        # Everything DeepSpeed issued in training was counted, as the bytes the process wrote.
        for name in VARIANTS:
            assert comm[name]["bytes"] == comm[name]["written"], (name, comm[name])
        # Stage 0: one ring all-reduce of every gradient per step sends 2(N-1)/N·4Ψ = 4Ψ at N = 2
        # (plus a few bytes of norms and overflow flags, and gloo's 48-byte headers: 12 per all-reduce).
        all_reduce = comm["stage0"]["by_kind"]["deepspeed_all_reduce"]
        assert psi4 * STEPS <= all_reduce["bytes"] <= psi4 * STEPS + 1024 + all_reduce["collectives"] * 12 * 48
        # Stages 1-2 gather the updated parameter partitions: (N-1)·4Ψ/N each step, at least.
        for name in ("stage1", "stage2_accumulate"):
            assert comm[name]["by_kind"]["deepspeed_all_gather"]["bytes"] >= psi4 / 2 * STEPS
        # Stage 3 gathers parameters in forward and backward: more than the stage 2 gather.
        gathered = sum(v["bytes"] for k, v in comm["stage3"]["by_kind"].items() if "gather" in k)
        assert gathered >= 2 * psi4 / 2 * STEPS, comm["stage3"]


def test_memory_accounting_shows_the_sharding(runs):
    psi4 = 4 * runs["psi"]
    state = {name: runs["ranks"][1][name]["state"] for name in VARIANTS}
    # Every rank holds all parameters up to stage 2 (DeepSpeed's flat buffer may pad a little) ...
    for name in ("stage0", "stage1", "stage2_accumulate"):
        assert psi4 <= state[name]["params"] <= 1.01 * psi4 + 4096, (name, state[name])
    # ... and half of them in stage 3.
    assert state["stage3"]["params"] <= 0.51 * psi4 + 4096, state["stage3"]
    # Stage 0: SGD momentum for every parameter; stage 1: half the momentum plus an fp32 master slice.
    assert psi4 <= state["stage0"]["optimizer"] <= 1.01 * psi4 + 4096
    assert psi4 <= state["stage1"]["optimizer"] <= 1.02 * psi4 + 4096
    # Stage 2 keeps a gradient partition, not full gradients, once the step starts.
    assert state["stage0"]["grads"] >= psi4
    assert 0 < state["stage3"]["grads"] < state["stage0"]["grads"]


# ------------------------------------------------------------------------------ the config (no processes)
def test_config_sets_what_deepspeed_would_otherwise_default():
    config = build_deepspeed_config(2, micro_batch_size=4, accumulate=2, bucket_elements=1000)
    assert config["gradient_clipping"] == 0.0  # DeepSpeed's default would clip at 1.0
    assert config["managed_gradient_accumulation"] is False  # Lightning owns the accumulation boundary
    assert config["gradient_accumulation_steps"] == 2 and config["train_micro_batch_size_per_gpu"] == 4
    assert config["zero_optimization"]["reduce_bucket_size"] == 1000
    assert build_deepspeed_config(1, gradient_clip_val=0.5, bucket_elements=1000)["gradient_clipping"] == 0.5
    offloaded = build_deepspeed_config(3, "params", bucket_elements=1000)["zero_optimization"]
    assert offloaded["offload_optimizer"]["device"] == offloaded["offload_param"]["device"] == "cpu"
    assert offloaded["stage3_param_persistence_threshold"] == 0  # else small models are not sharded at all


@pytest.mark.parametrize(
    "stage,offload,words",
    [(4, "none", ["strategy.stage", "Got 4"]), (0, "optimizer", ["stage=1, 2 or 3"]), (2, "params", ["strategy.stage=3"]), (3, "disk", ["'disk'"])],
)
def test_strategy_refuses_what_deepspeed_cannot_do(stage, offload, words):
    from parallelkit.errors import ConfigError
    from parallelkit.strategies.deepspeed import DeepSpeedStrategy

    with pytest.raises(ConfigError) as err:
        DeepSpeedStrategy(stage=stage, offload=offload)
    for word in words:
        assert word in str(err.value)


def test_auto_bucket_is_sized_to_the_model():
    model = _model()
    sizes = [p.numel() for p in model.parameters()]
    assert auto_bucket_elements(model) == max(max(sizes), sum(sizes) // 8)


@pytest.mark.parametrize(
    "settings,words",
    [(("bf16-mixed", None, None), ["trainer.precision=bf16-mixed", "32-true"]), (("32-true", 1.0, "value"), ["gradient_clip_algorithm=value", "norm"])],
)
def test_strategy_refuses_trainer_settings_deepspeed_cannot_apply(settings, words):
    from parallelkit.errors import ConfigError
    from parallelkit.strategies.deepspeed import DeepSpeedStrategy

    precision, clip, algorithm = settings
    with pytest.raises(ConfigError) as err:
        DeepSpeedStrategy().bind_trainer_config({"precision": precision, "gradient_clip_val": clip, "gradient_clip_algorithm": algorithm})
    for word in words:
        assert word in str(err.value)
    DeepSpeedStrategy().bind_trainer_config({"precision": "32-true", "gradient_clip_val": 1.0, "gradient_clip_algorithm": "norm"})
