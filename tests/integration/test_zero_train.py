"""``strategy=zero`` end to end: every stage reproduces one process, holds the ZeRO paper's bytes, sends the
theory's traffic, and its checkpoints resume at another world size.

All runs here share one setup: 10 batches per epoch and a checkpoint every 10 steps, so a run resumed from
step 10 starts a fresh epoch exactly as the uninterrupted run does (mid-epoch data position is issue 11's),
and no validation, so the counted traffic is the training step's alone.
"""

from __future__ import annotations

import pytest

from tests.integration.test_train import REL_TOL, TINY, max_rel_diff, run_ok, train

ZTINY = [
    *TINY,
    "trainer.limit_train_batches=10",
    "trainer.limit_val_batches=0",
    "trainer.num_sanity_val_steps=0",
    "checkpoint.every_n_steps=10",
    "checkpoint.save_top_k=-1",
]
N_EMBD, N_LAYER = 32, 2  # TINY's GPT
PARAM_TENSORS = 2 + 16 * N_LAYER + 3  # embeddings; 8 weight+bias pairs per block; ln_f pair + head


def zero_formula(stage: int, psi: int, n: int) -> float:
    """Model-state bytes per rank for fp32 Adam (ZeRO paper, Rajbhandari et al. 2020, §3)."""
    return {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}[stage]


def zero3_gathered(psi: int) -> int:
    """Parameters stage 3 all-gathers per step on TINY's GPT: each block in forward and again in backward; the root
    (embeddings, ln_f, head) once, as it stays gathered from forward into backward (FSDP2's root default)."""
    block = 12 * N_EMBD**2 + 13 * N_EMBD  # attention 4(d² + d), MLP 8d² + 5d, two LayerNorms 4d
    return 2 * N_LAYER * block + (psi - N_LAYER * block)


def state_total(summary: dict) -> int:
    return sum(summary["model_state_bytes"].values())


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return run_ok([*ZTINY, "strategy=single"], tmp_path_factory.mktemp("single") / "run")


@pytest.fixture(scope="module")
def stage2_run(tmp_path_factory) -> tuple[dict, object]:
    run_dir = tmp_path_factory.mktemp("zero2") / "run"
    return run_ok([*ZTINY, "strategy=zero", "strategy.stage=2", "trainer.devices=2"], run_dir), run_dir


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_stage_matches_single_process_memory_and_traffic(single, stage, tmp_path):
    run = run_ok([*ZTINY, "strategy=zero", f"strategy.stage={stage}", "trainer.devices=2"], tmp_path / "run")
    _check_stage(run, single, stage, n=2)


def test_stage3_without_prefetch_matches_single_process_memory_and_traffic(single, tmp_path):
    # every collective when its unit needs it: the same result, memory and bytes as with the overlap
    run = run_ok([*ZTINY, "strategy=zero", "strategy.stage=3", "strategy.prefetch=false", "trainer.devices=2"], tmp_path / "run")
    _check_stage(run, single, 3, n=2)


def test_stage2_matches_single_process_memory_and_traffic(single, stage2_run):
    _check_stage(stage2_run[0], single, 2, n=2)


def _check_stage(run: dict, single: dict, stage: int, n: int) -> None:
    assert run["strategy"] == "zero" and run["steps"] == 20
    assert max_rel_diff(run["train_loss"], single["train_loss"]) <= REL_TOL
    assert run["train_loss"][-1] < run["train_loss"][0] - 0.2  # it trained
    psi = run["num_params"]
    ratio = state_total(run) / zero_formula(stage, psi, n)
    assert 0.999 <= ratio <= 1.05, (stage, run["model_state_bytes"], ratio)
    if stage == 3:
        # The "half of DP or less": exactly half, plus Adam's step counter (a 4-byte scalar per
        # parameter tensor, which FSDP2 keeps on every rank).
        assert state_total(run) - 4 * PARAM_TENSORS <= 0.5 * zero_formula(0, psi, n)
    kinds = run["comm"]["by_kind"]
    ring = 2 * (n - 1) / n * 4 * psi  # DDP's ring all-reduce: what stages 1-2 must match
    if stage == 0:
        sent = kinds["grad_allreduce"]["bytes_per_step"]
        assert sent == pytest.approx(ring, rel=0.05)
    elif stage in (1, 2):
        sent = kinds["grad_reduce_scatter"]["bytes_per_step"] + kinds["param_all_gather"]["bytes_per_step"]
        assert sent == pytest.approx(ring, rel=0.05)
    else:
        # FSDP2 gathers the blocks twice and the root once (zero3_gathered), and reduce-scatters every gradient
        # once: the paper's 1.5× DDP less one gather of the root.
        gathered = zero3_gathered(psi)
        assert kinds["param_all_gather"]["bytes_per_step"] == pytest.approx((n - 1) / n * 4 * gathered, rel=0.05)
        assert kinds["grad_reduce_scatter"]["bytes_per_step"] == pytest.approx((n - 1) / n * 4 * psi, rel=0.05)


@pytest.mark.parametrize("stage", [2, 3])
def test_grouped_sharding_matches_single_process(single, stage, tmp_path):
    run = run_ok([*ZTINY, "strategy=zero", f"strategy.stage={stage}", "strategy.sharding_group=2", "trainer.devices=4"], tmp_path / "run")
    assert run["dims"] == {"dp": 2, "sharding": 2, "cp": 1, "tp": 1, "pp": 1, "ep": 1}
    assert max_rel_diff(run["train_loss"], single["train_loss"]) <= REL_TOL
    psi = run["num_params"]
    # Sharded over the group of 2, replicated across the 2 groups: the formula for N = 2.
    assert 0.999 <= state_total(run) / zero_formula(stage, psi, 2) <= 1.05
    # The replicas average the reduced shards: an all-reduce of 1/2 of the gradients over 2 groups.
    replica_traffic = run["comm"]["by_kind"]["grad_all_reduce"]["bytes_per_step"]
    assert replica_traffic == pytest.approx(2 * (2 - 1) / 2 * 4 * psi / 2, rel=0.05)


@pytest.mark.parametrize("stage,offload", [(2, "optimizer"), (3, "params")])
def test_offload_matches_single_process(single, stage, offload, tmp_path):
    run = run_ok([*ZTINY, "strategy=zero", f"strategy.stage={stage}", f"strategy.offload={offload}", "trainer.devices=2"], tmp_path / "run")
    assert max_rel_diff(run["train_loss"], single["train_loss"]) <= REL_TOL
    if offload == "optimizer":  # the host keeps its own copy of the owned parameter slices (the master copy)
        assert run["model_state_bytes"]["params"] == pytest.approx(4 * run["num_params"] * 1.5, rel=0.01)


@pytest.mark.parametrize("stage", [1, 2])
def test_an_optimizer_with_state_from_construction_is_sharded(stage, tmp_path):
    """Adagrad builds its accumulators when it is constructed (AdamW at its first step): ZeRO 1-2 lays them out on
    the shards like the parameters, reproduces one process, and resumes from its own checkpoint exactly."""
    adagrad = [*ZTINY, "optim=adagrad"]
    single = run_ok([*adagrad, "strategy=single"], tmp_path / "single")
    zero = run_ok([*adagrad, "strategy=zero", f"strategy.stage={stage}", "trainer.devices=2"], tmp_path / "zero")
    assert max_rel_diff(zero["train_loss"], single["train_loss"]) <= REL_TOL
    # Adagrad's accumulator (one fp32 value per parameter) is split in two, as AdamW's moments are.
    assert zero["model_state_bytes"]["optimizer"] == pytest.approx(4 * zero["num_params"] / 2, rel=0.01)
    step10 = tmp_path / "zero" / "checkpoints" / "epoch=0-step=10.ckpt"
    resumed = run_ok([*adagrad, "strategy=zero", f"strategy.stage={stage}", "trainer.devices=2", f"ckpt_path='{step10}'"], tmp_path / "resumed")
    assert max_rel_diff(resumed["train_loss"][10:], zero["train_loss"][10:]) <= REL_TOL


def test_sharded_checkpoint_resumes_at_other_world_sizes(stage2_run, tmp_path):
    # 4 → 2: stage 3 saves a sharded checkpoint at step 10 on 4 ranks; 2 ranks resume and match.
    four = run_ok([*ZTINY, "strategy=zero", "strategy.stage=3", "trainer.devices=4"], tmp_path / "four")
    step10 = tmp_path / "four" / "checkpoints" / "epoch=0-step=10.ckpt"
    assert (step10 / "meta.pt").is_file() and len(list(step10.glob("*.distcp"))) == 4  # one shard per rank
    two = run_ok([*ZTINY, "strategy=zero", "strategy.stage=3", "trainer.devices=2", f"ckpt_path='{step10}'"], tmp_path / "two")
    assert two["train_loss"][:10] == four["train_loss"][:10]  # the restored history
    assert max_rel_diff(two["train_loss"][10:], four["train_loss"][10:]) <= REL_TOL

    # 2 → 1: one process resumes from the 2-rank stage-2 run's step-10 checkpoint and matches it.
    stage2, stage2_dir = stage2_run
    one = run_ok([*ZTINY, "strategy=single", f"ckpt_path='{stage2_dir / 'checkpoints' / 'epoch=0-step=10.ckpt'}'"], tmp_path / "one")
    assert max_rel_diff(one["train_loss"][10:], stage2["train_loss"][10:]) <= REL_TOL


    # A checkpoint of another model shape is refused before any process starts, naming what differs.
    wide = train([*ZTINY, "strategy=single", "model.n_embd=64", f"ckpt_path='{step10}'", f"hydra.run.dir={tmp_path / 'wide'}"], cwd=tmp_path)
    assert wide.returncode == 2, wide.stderr[-2000:]
    assert "saved from a different model" in wide.stderr and "weight is (32, 32) in the checkpoint but (64, 64) in this model" in wide.stderr, wide.stderr[
        -2000:
    ]
    assert not (tmp_path / "wide" / "checkpoints").exists()


def test_bytes_that_leave_the_process_match_the_theory(tmp_path):
    """Not parallelkit's own count: what each process handed to the kernel to write (gloo's TCP transport
    sends with writev), over the steps a 7-step run has beyond a 2-step one (start-up and files cancel)."""
    written = {}
    for stage in (1, 3):
        quiet = [*TINY, "trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0", "checkpoint.every_n_steps=0",
                 "strategy=zero", f"strategy.stage={stage}", "trainer.devices=2"]
        short = run_ok([*quiet, "trainer.max_steps=2"], tmp_path / f"short{stage}")
        long = run_ok([*quiet, "trainer.max_steps=7"], tmp_path / f"long{stage}")
        written[stage] = (long["os_bytes_written"] - short["os_bytes_written"]) / 5
        psi, n = long["num_params"], 2
    ring = 2 * (n - 1) / n * 4 * psi
    # stage 1: reduce-scatter + all-gather = DDP's ring all-reduce (gloo's own reduce_scatter, an all-reduce
    # plus a slice, would make it 1.5×); stage 3: the paper's 1.5× less one gather of the root (zero3_gathered)
    stage3 = (n - 1) / n * 4 * (zero3_gathered(psi) + psi)
    assert written[1] == pytest.approx(ring, rel=0.05), written
    assert written[3] == pytest.approx(stage3, rel=0.05), written
    # the counter sees the difference between the stages (a check of the measurement itself)
    assert written[3] / written[1] == pytest.approx(stage3 / ring, rel=0.05)
