"""The one composition, combination by combination: every pair of {dp, sharding, tp, sp, pp × each schedule, ep,
recompute, bf16, fp16 + loss scaling} trains through ``strategy=hybrid4d`` and reproduces ``strategy=single`` in the
same precision.

At most 4 ranks, so each run holds two parallel axes of size 2 (``ep`` lives inside the data-parallel ranks) plus
the options; the runs below are a covering set: every pair of techniques that can meet at 4 ranks meets in at
least one run (:func:`test_the_runs_cover_every_pair` checks the table itself). The full set at once needs 8 ranks
(``slow``). Pairs that cannot meet: two pipeline schedules, bf16 with fp16 (one precision per run), and sp with ep
(sequence parallelism is refused with Mixture-of-Experts models: ``docs/architecture.md``, refused combinations).

Tolerances, per step of the loss, relative (compare each parallel run with single in the *same* precision):
- fp32: ``REL_TOL`` (1e-5), fp32 round-off over a different reduction order;
- bf16 and fp16: ``u · sqrt(steps / tokens)``, ``u`` the format's unit round-off (``2**-8`` for bf16's 8 significant
  bits, ``2**-11`` for fp16's 11). Autocast rounds matmul outputs to the half format, and a pipeline's
  micro-batches, a split over tp or a sharded reduction round partial sums at other places than one process: each
  token's loss moves by about ``u``, independently, so the mean over the step's ``tokens`` moves by
  ``u / sqrt(tokens)``, and the steps' differences add up like a random walk (``sqrt(steps)``). Here 128 tokens and
  6 steps: 8.5e-4 (bf16), 1.1e-4 (fp16); measured 6e-5 and 2e-6 at most. fp16's loss scale is a power of two: exact.
A negative control drops the data-parallel gradient averaging from one run of each precision: it must fail by
several times the tolerance (measured: 3.4e-3 in every precision).
"""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path

import pytest

from test_train import REL_TOL, TINY, max_rel_diff, run_ok

HERE = Path(__file__).resolve().parent
# Four blocks: interleaved and zero-bubble schedules run 2 stages per rank (4 stages at pp=2).
STEPS, TOKENS = 6, 8 * 16  # TINY: data.global_batch_size=8 sequences of data.seq_len=16
BASE = [*TINY, "model.n_layer=4", f"trainer.max_steps={STEPS}", "trainer.limit_val_batches=0", "strategy=hybrid4d"]
CLIP = ["trainer.gradient_clip_val=0.5"]  # really clips: the whole-model norm must be right on every layout
MOE = ["model=moe_gpt", "model.num_experts=4", "model.top_k=2", "model.capacity_factor=2.0", "model.aux_loss_weight=0"]
PRECISION = {"fp32": [], "bf16": ["trainer.precision=bf16-mixed"], "fp16": ["callbacks=[amp]", "callbacks.amp.dtype=fp16"]}
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}


def half_tolerance(precision: str, steps: int = STEPS, tokens: int = TOKENS) -> float:
    """The relative loss tolerance of a half-precision run against one process in the same format (module docstring)."""
    return UNIT_ROUNDOFF[precision] * math.sqrt(steps / tokens)


TOLERANCE = {"fp32": REL_TOL, "bf16": half_tolerance("bf16"), "fp16": half_tolerance("fp16")}
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")

# name: (techniques, precision); degrees of size 2 for dp/sharding/tp/pp, ep=2 inside dp × sharding.
RUNS = {
    "dp_tp_sp_recompute": ({"dp", "tp", "sp", "recompute"}, "fp32"),
    "sharding_tp_sp": ({"sharding", "tp", "sp"}, "fp32"),
    "tp_sp_1f1b_recompute": ({"tp", "sp", "1f1b", "recompute"}, "fp32"),
    "sharding_interleaved_recompute": ({"sharding", "interleaved_1f1b", "recompute"}, "fp32"),
    "dp_zero_bubble_recompute": ({"dp", "zero_bubble", "recompute"}, "fp32"),
    "dp_sharding_recompute": ({"dp", "sharding", "recompute"}, "fp32"),
    "dp_gpipe": ({"dp", "gpipe"}, "fp32"),
    "tp_sp_gpipe_recompute_bf16": ({"tp", "sp", "gpipe", "recompute"}, "bf16"),
    "dp_sharding_bf16": ({"dp", "sharding"}, "bf16"),
    "dp_interleaved_bf16": ({"dp", "interleaved_1f1b"}, "bf16"),
    "sharding_zero_bubble_bf16": ({"sharding", "zero_bubble"}, "bf16"),
    "dp_1f1b_bf16": ({"dp", "1f1b"}, "bf16"),
    "dp_tp_sp_recompute_fp16": ({"dp", "tp", "sp", "recompute"}, "fp16"),
    "sharding_1f1b_fp16": ({"sharding", "1f1b"}, "fp16"),
    "tp_sp_interleaved_fp16": ({"tp", "sp", "interleaved_1f1b"}, "fp16"),
    "tp_sp_zero_bubble_fp16": ({"tp", "sp", "zero_bubble"}, "fp16"),
    "sharding_gpipe_fp16": ({"sharding", "gpipe"}, "fp16"),
    "ep_dp_tp_recompute_bf16": ({"ep", "dp", "tp", "recompute"}, "bf16"),
    "ep_sharding_fp16": ({"ep", "sharding"}, "fp16"),
    "ep_dp_gpipe": ({"ep", "dp", "gpipe"}, "fp32"),
    "ep_dp_1f1b_fp16": ({"ep", "dp", "1f1b"}, "fp16"),
    "ep_dp_interleaved": ({"ep", "dp", "interleaved_1f1b"}, "fp32"),
    "ep_dp_zero_bubble_bf16": ({"ep", "dp", "zero_bubble"}, "bf16"),
}
TECHNIQUES = {"dp", "sharding", "tp", "sp", *SCHEDULES, "ep", "recompute", "bf16", "fp16"}
NEVER_TOGETHER = {frozenset(p) for p in itertools.combinations(SCHEDULES, 2)} | {frozenset({"bf16", "fp16"}), frozenset({"sp", "ep"})}


def arguments(techniques: set[str], precision: str) -> list[str]:
    """The command line of one run: the degrees (2 where on, ``dp`` takes what is left), the options, the precision."""
    degrees = {axis: 2 if axis in techniques else 1 for axis in ("sharding", "tp")}
    degrees["pp"] = 2 if techniques & set(SCHEDULES) else 1
    degrees["ep"] = 2 if "ep" in techniques else 1
    args = [*(MOE if "ep" in techniques else []), *BASE, *(f"strategy.{k}={v}" for k, v in degrees.items()), "strategy.dp=-1"]
    schedule = next((s for s in SCHEDULES if s in techniques), None)
    if schedule:
        args += [f"strategy.schedule={schedule}", "strategy.microbatches=2"]
    if "sp" in techniques:
        args.append("strategy.sequence_parallel=true")
    if "recompute" in techniques:
        args.append("recompute=full")
    if "ep" not in techniques:
        args += CLIP  # by norm: each rank's experts differ, so clipping by norm is refused with ep > 1
    world = 2 ** len(techniques & {"dp", "sharding", "tp"} | ({"pp"} if schedule else set()))
    return [*args, *PRECISION[precision], f"trainer.devices={world}"]


@pytest.fixture(scope="module")
def singles(tmp_path_factory):
    """``strategy=single`` per (model, precision), run once when first asked for."""
    cache: dict[tuple[bool, str], dict] = {}

    def get(moe: bool, precision: str) -> dict:
        if (moe, precision) not in cache:
            args = [*(MOE if moe else []), *BASE[:-1], "strategy=single", *PRECISION[precision], *([] if moe else CLIP)]
            cache[moe, precision] = run_ok(args, tmp_path_factory.mktemp(f"single_{int(moe)}_{precision}") / "run")
        return cache[moe, precision]

    return get


def test_the_runs_cover_every_pair():
    covered = {frozenset(p) for techniques, precision in RUNS.values() for p in itertools.combinations(techniques | {precision}, 2)}
    wanted = {frozenset(p) for p in itertools.combinations(TECHNIQUES, 2)} - NEVER_TOGETHER
    assert not wanted - covered, sorted(map(sorted, wanted - covered))
    for techniques, precision in RUNS.values():
        assert not any(pair <= techniques | {precision} for pair in NEVER_TOGETHER), techniques
        args = arguments(techniques, precision)
        assert int(args[-1].split("=")[1]) <= 4, args


@pytest.mark.parametrize("name", list(RUNS))
def test_combination_matches_single_in_its_precision(name, singles, tmp_path):
    techniques, precision = RUNS[name]
    run = run_ok(arguments(techniques, precision), tmp_path / "run")
    reference = singles("ep" in techniques, precision)
    assert max_rel_diff(run["train_loss"], reference["train_loss"]) <= TOLERANCE[precision], (run["train_loss"], reference["train_loss"])
    kinds = {kind for kind, entry in run["comm"]["by_kind"].items() if entry["bytes_per_step"] > 0}
    assert ("pp_p2p" in kinds) == bool(techniques & set(SCHEDULES)), kinds  # the parallelism really ran
    assert any(k.startswith("tp") for k in kinds) == ("tp" in techniques), kinds
    if precision == "fp16":
        assert run["amp"]["dtype"] == "fp16" and run["amp"]["loss_scale"] >= 1


@pytest.mark.parametrize("name", ["dp_tp_sp_recompute", "dp_interleaved_bf16", "dp_tp_sp_recompute_fp16"])
def test_negative_control_without_gradient_averaging_fails(name, singles, tmp_path):
    # The same run with the data-parallel gradient all-reduce removed (fault_injection.DropGradSync): each replica
    # trains on its own half of the batch, and the comparison above must see it.
    techniques, precision = RUNS[name]
    drop = ["+callbacks.drop._target_=fault_injection.DropGradSync", "+callbacks.drop.kind=grad_allreduce"]
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    run = run_ok([*arguments(techniques, precision), *drop], tmp_path / "run", env=env)
    reference = singles(False, precision)
    assert max_rel_diff(run["train_loss"], reference["train_loss"]) > 3 * TOLERANCE[precision]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_full_set_on_8_ranks(precision, singles, tmp_path):
    # sharding × tp(+sp) × pp at once (8 ranks), recompute, one precision; interleaved schedule. 8 processes on 2 cores.
    args = arguments({"sharding", "tp", "sp", "interleaved_1f1b", "recompute"}, precision)
    run = run_ok(args, tmp_path / "run")
    assert run["dims"]["sharding"] == run["dims"]["tp"] == run["dims"]["pp"] == 2
    assert max_rel_diff(run["train_loss"], singles(False, precision)["train_loss"]) <= TOLERANCE[precision]
