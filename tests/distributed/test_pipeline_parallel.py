"""``apply_pp`` on real gloo ranks against a single-process reference, for every schedule.

Each rank cuts the same tiny GPT into its stages; data-parallel replicas of the pipeline read different
halves of every global batch. One process that trains the whole model on the whole batch (mean loss) is
the reference: the last stage's losses, every gradient and the stepped weights must equal it within fp32
round-off. A broken variant (gradients not divided by the micro-batch count, the classic bug) must be
caught by the same comparison. All schedules run in one launch per world size (a launch costs seconds).
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from parallelkit.callbacks.run_summary import os_bytes_written
from parallelkit.distributed.comm_stats import CommStats
from parallelkit.distributed.pipeline_parallel import (
    PP_P2P,
    SCHEDULES,
    check_microbatch_split,
    check_pipeline_config,
    stage_blocks,
    stage_ids_for_rank,
)
from parallelkit.errors import ConfigError

from .harness import run_ranks

N_LAYER, VOCAB, SEQ, EMBD, BATCH, STEPS, LR = 4, 32, 16, 32, 8, 3, 0.1
# (schedule, microbatches, virtual stages): M = 4 > P = 2, so 1F1B's bound (P) and GPipe's (M) differ.
CASES = [("gpipe", 4, 1), ("1f1b", 4, 1), ("interleaved_1f1b", 4, 2), ("zero_bubble", 4, 2)]


def _model():
    from parallelkit.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=N_LAYER, n_head=2, n_embd=EMBD)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _train_pipeline(rank: int, world: int, pp: int, cases: list, scale_grads: bool = True) -> dict:
    from parallelkit.distributed.grad_sync import GRAD_ALLREDUCE, apply_grad_allreduce
    from parallelkit.distributed.parallel_dims import ParallelDims
    from parallelkit.distributed.pipeline_parallel import apply_pp
    from parallelkit.models.gpt import GPT
    from parallelkit.models.gpt.parallelize import pipeline_stages

    dims = ParallelDims.from_degrees(world, dp=-1, pp=pp)
    mesh = dims.build_mesh("cpu")
    coords = dims.coordinates(rank)
    per_rank = BATCH // dims.dp
    rows = slice(coords["dp"] * per_rank, (coords["dp"] + 1) * per_rank)  # each dp replica its own half
    results = {}
    for schedule, microbatches, virtual in cases:
        model = _model()
        ids = stage_ids_for_rank(coords["pp"], pp, virtual, schedule)
        stages = pipeline_stages(model, stage_blocks(N_LAYER, pp * virtual), ids)
        stats = CommStats()
        pipe = apply_pp(stages, ids, pp * virtual, mesh.get_group("pp"), microbatches=microbatches, schedule=schedule,
                        loss_fn=GPT.loss, device=torch.device("cpu"), comm_stats=stats, scale_grads=scale_grads)
        sync = apply_grad_allreduce(model.parameters(), mesh.get_group("dp"), comm_stats=stats)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses, first_grads, counted, written = [], None, [], []
        for step in range(STEPS):
            x, y = _batch(step)
            opt.zero_grad()
            before = (stats.bytes(), os_bytes_written())
            loss = pipe.train_step(x[rows], y[rows])
            sync.sync()
            counted.append(stats.bytes() - before[0])
            written.append(os_bytes_written() - before[1])
            if first_grads is None:
                first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            opt.step()
            losses.append(loss)
        p2p_train, p2p_messages = stats.bytes(PP_P2P), stats.calls(PP_P2P)
        x, y = _batch(0)
        results[schedule] = {
            "losses": losses,
            "eval": pipe.eval_step(x[rows], y[rows]),
            "grads": first_grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "stage_ids": ids,
            "peak_inflight": dict(pipe.stats.peak_inflight),
            "p2p_bytes": p2p_train,
            "p2p_messages": p2p_messages,  # sends and receives
            "counted": counted,
            "written": written,
            "grad_allreduce_bytes": stats.bytes(GRAD_ALLREDUCE),
            "dp_rank": coords["dp"],
            "per_rank": per_rank,
        }
    return results


def _reference(dp: int) -> dict:
    """One process, whole model; the dp replicas' mean of shard losses is what their losses average to."""
    from parallelkit.models.gpt import GPT

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    shard_losses, first_grads = [], None
    per_rank = BATCH // dp
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        logits = model(x)
        GPT.loss(logits, y).backward()
        with torch.no_grad():
            shard_losses.append([GPT.loss(logits[d * per_rank:(d + 1) * per_rank], y[d * per_rank:(d + 1) * per_rank]) for d in range(dp)])
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    with torch.no_grad():
        x, y = _batch(0)
        evals = [GPT.loss(model(x[d * per_rank:(d + 1) * per_rank]), y[d * per_rank:(d + 1) * per_rank]) for d in range(dp)]
    return {"shard_losses": shard_losses, "grads": first_grads, "params": dict(model.named_parameters()), "evals": evals}


def _check_against_reference(results: list[dict], schedule: str, ref: dict, pp: int) -> None:
    seen: set[str] = set()
    for r in results:
        out = r[schedule]
        holds_last = pp * (2 if SCHEDULES[schedule].multi_stage else 1) - 1 in out["stage_ids"]
        if holds_last:  # the loss lives on the last stage only
            for step, loss in enumerate(out["losses"]):
                assert_close(loss, ref["shard_losses"][step][out["dp_rank"]], rtol=1e-5, atol=0)
        else:
            assert all(loss is None for loss in out["losses"])
        for name, grad in out["grads"].items():
            assert_close(grad, ref["grads"][name], rtol=1e-4, atol=1e-6, msg=f"{schedule}: grad of {name}")
            assert_close(out["params"][name], ref["params"][name].detach(), rtol=1e-5, atol=1e-6, msg=f"{schedule}: {name}")
            seen.add(name)
    # Together the ranks hold the whole model, each stage's parameters on its own rank only.
    assert seen == set(ref["grads"])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_train_pipeline, 2, tmp_path_factory.mktemp("pp2"), 2, CASES)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict]:
    return run_ranks(_train_pipeline, 4, tmp_path_factory.mktemp("pp2dp2"), 2, CASES, timeout_s=240)


@pytest.mark.parametrize("schedule", [c[0] for c in CASES])
def test_pp2_matches_single_process(two_ranks, schedule):
    _check_against_reference(two_ranks, schedule, _reference(1), pp=2)
    _check_counted_is_written(two_ranks, schedule)
    # Activations went forward and gradients back: M micro-batches of (B/M, T, C) fp32 per stage boundary;
    # on gloo every transfer also writes 3 headers of 48 bytes (2 from the sender, 1 from the receiver).
    boundary = BATCH * SEQ * EMBD * 4 * STEPS
    sent = sum(r[schedule]["p2p_bytes"] for r in two_ranks)
    transfers = sum(r[schedule]["p2p_messages"] for r in two_ranks) // 2
    assert sent == boundary * (2 * (2 * (2 if SCHEDULES[schedule].multi_stage else 1) - 1)) + transfers * 3 * 48, sent
    assert all(r[schedule]["grad_allreduce_bytes"] == 0 for r in two_ranks)  # dp = 1: nothing to average
    for r in two_ranks:  # the forward-only path agrees with the model in eval
        if r[schedule]["eval"] is not None:
            assert torch.isfinite(r[schedule]["eval"])


@pytest.mark.parametrize("schedule", [c[0] for c in CASES])
def test_pp2_dp2_matches_single_process(four_ranks, schedule):
    ref = _reference(2)
    _check_against_reference(four_ranks, schedule, ref, pp=2)
    for r in four_ranks:
        out = r[schedule]
        if out["eval"] is not None:
            assert_close(out["eval"], ref["evals"][out["dp_rank"]], rtol=1e-5, atol=0)
        # Every stage's gradients were averaged over its dp peer once per step (gloo: plus 12 headers of 48 bytes).
        own = sum(g.numel() for g in out["grads"].values()) * 4
        assert out["grad_allreduce_bytes"] == (own + 12 * 48) * STEPS
    _check_counted_is_written(four_ranks, schedule)


def _check_counted_is_written(results: list[dict], schedule: str) -> None:
    """Every step's traffic counted is what the rank's process wrote; the first step also exchanges the
    stages' tensor metadata (torch.distributed.pipelining's shape inference, not counted: once per run)."""
    for rank, r in enumerate(results):
        counted, written = r[schedule]["counted"], r[schedule]["written"]
        assert counted[1:] == written[1:], (rank, schedule, counted, written)
        assert counted[0] <= written[0], (rank, schedule, counted, written)


def test_peak_inflight_activations_1f1b_at_most_p_gpipe_m(two_ranks):
    pp, m = 2, 4
    for r in two_ranks:
        (stage,) = r["1f1b"]["stage_ids"]
        assert r["1f1b"]["peak_inflight"][stage] == pp - stage <= pp  # warm-up depth of 1F1B
        assert r["gpipe"]["peak_inflight"][stage] == m  # GPipe runs every forward first


def _train_unscaled(rank: int, world: int) -> dict:
    return _train_pipeline(rank, world, 2, [("1f1b", 4, 1)], False)


def test_negative_control_unscaled_gradients_are_caught(tmp_path):
    """Without dividing by the micro-batch count, gradients are M × too large: the check must fail."""
    results = run_ranks(_train_unscaled, 2, tmp_path)
    with pytest.raises(AssertionError):
        _check_against_reference(results, "1f1b", _reference(1), pp=2)
    grads = {n: g for r in results for n, g in r["1f1b"]["grads"].items()}
    ref = _reference(1)["grads"]
    assert_close(grads["lm_head.weight"], 4 * ref["lm_head.weight"], rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------ validation (no processes)
def test_stage_blocks_balanced_and_split():
    assert stage_blocks(4, 2) == [range(0, 2), range(2, 4)]
    assert stage_blocks(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_blocks(4, 2, [3]) == [range(0, 3), range(3, 4)]
    with pytest.raises(ConfigError, match=r"3 stages but the model has only 2 blocks"):
        stage_blocks(2, 3)
    with pytest.raises(ConfigError, match=r"strategy.split=\[2, 2\]"):
        stage_blocks(4, 3, [2, 2])


def test_stage_placement():
    assert stage_ids_for_rank(1, 2, 1, "1f1b") == [1]
    assert stage_ids_for_rank(1, 4, 2, "interleaved_1f1b") == [1, 5]


def test_bad_schedule_settings_name_the_numbers():
    with pytest.raises(ConfigError, match=r"microbatches=2 < 4 stages"):
        check_pipeline_config(4, 2, "1f1b", 1)
    check_pipeline_config(4, 2, "gpipe", 1)  # GPipe fills and drains with any M
    with pytest.raises(ConfigError, match="virtual_stages=2"):
        check_pipeline_config(2, 4, "gpipe", 2)
    with pytest.raises(ConfigError, match="not a pipeline schedule"):
        check_pipeline_config(2, 4, "pipedream", 1)
    with pytest.raises(ConfigError, match=r"multiple of the 2 rounds"):
        check_pipeline_config(2, 5, "interleaved_1f1b", 2)
    with pytest.raises(ConfigError, match=r"6 samples cannot be split into strategy.microbatches=4"):
        check_microbatch_split(6, 4)


def test_strategy_rejects_bad_settings_when_built():
    from parallelkit.strategies.pp import PipelineStrategy

    with pytest.raises(ConfigError, match=r"strategy.microbatches=1 < 2 stages"):
        PipelineStrategy(pp=2, microbatches=1, schedule="1f1b")
    with pytest.raises(ConfigError, match=r"strategy.pp should be an int greater than 0"):
        PipelineStrategy(pp=0)
    dims = PipelineStrategy(pp=2, microbatches=4).plan(4)
    assert (dims.pp, dims.dp) == (2, 2)  # the remaining ranks are data parallel
    with pytest.raises(ConfigError, match="does not divide"):
        PipelineStrategy(pp=3, microbatches=4).plan(4)


def test_bubble_is_measured_against_the_pipeline_step():
    from parallelkit.distributed.pipeline_parallel import PipelineStats, pipeline_spans, theoretical_bubble

    # P=2, M=2, forward 1 and backward 2 time units: the pipeline takes (M+P−1)·3 = 9 units per step,
    # each rank computes M·3 = 6. The first stage computes from t=0 to t=9; the last from t=1 to t=8.
    first, last = PipelineStats(), PipelineStats()
    for stats, events in ((first, [("F", 0, 1), ("F", 1, 2), ("B", 4, 6), ("B", 7, 9)]),
                          (last, [("F", 1, 2), ("B", 2, 4), ("F", 4, 5), ("B", 5, 7)])):
        for step in range(3):  # the first (warm-up) step is left out of the fraction
            stats.begin_step()
            for kind, start, end in events:
                stats.compute(kind, 0, 0, 100.0 * step + start, 100.0 * step + end)
            stats.end_step()
    assert first.step_active == [9.0] * 3 and last.step_active == [6.0] * 3
    spans = pipeline_spans([first.step_active, last.step_active])
    assert theoretical_bubble(2, 2) == pytest.approx(1 / 3)
    for stats in (first, last):
        assert stats.bubble_fraction(spans) == pytest.approx(1 / 3)
    assert last.bubble_fraction() == pytest.approx(0.0)  # its own clock alone would hide its bubble
