"""``python -m parallelkit.plan``: the dry-run layout on the fake backend (one process, up to 64 ranks)."""

from __future__ import annotations

import itertools

import pytest
import torch

from parallelkit.distributed.parallel_dims import DP, EP, PP, SHARDING, TP
from parallelkit.planner.dry_run import build_plan, fake_world
from parallelkit.tools.plan import main

TINY = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "data.seq_len=16", "data.global_batch_size=64"]
MESH_AXES = (PP, DP, SHARDING, TP)


def plan_of(world: int, **degrees) -> object:
    args = [f"strategy.{k}={v}" for k, v in degrees.items()]
    return build_plan([*TINY, "strategy=hybrid4d", *args, f"trainer.devices={world}"])


LAYOUTS_64 = [dict(tp=2, pp=2, dp=-1), dict(tp=2, pp=1, sharding=4, dp=-1), dict(tp=1, pp=2, dp=-1)]


@pytest.mark.parametrize("degrees", LAYOUTS_64)
def test_64_rank_coordinates_cover_every_combination_once(degrees):
    plan = plan_of(64, **degrees)
    d = plan.dims
    seen = [tuple(r.coords[a] for a in MESH_AXES) for r in plan.ranks]
    expected = set(itertools.product(*(range(getattr(d, a)) for a in MESH_AXES)))
    assert len(seen) == 64 and set(seen) == expected  # a bijection ranks ↔ coordinates


@pytest.mark.parametrize("degrees", LAYOUTS_64)
def test_64_rank_groups_partition_the_ranks_along_each_axis(degrees):
    plan = plan_of(64, **degrees)
    d = plan.dims
    for axis in MESH_AXES:
        groups = {tuple(r.groups[axis]) for r in plan.ranks}
        members = [rank for g in groups for rank in g]
        assert sorted(members) == list(range(64)), axis  # disjoint and complete
        assert all(len(g) == getattr(d, axis) for g in groups), axis
        for r in plan.ranks:  # a group's members differ from this rank only along its axis
            others = [plan.ranks[m].coords for m in r.groups[axis]]
            assert {o[axis] for o in others} == set(range(getattr(d, axis)))
            assert all(o[a] == r.coords[a] for o in others for a in MESH_AXES if a != axis)
    # tp innermost: a tensor-parallel group is adjacent ranks.
    for r in plan.ranks:
        g = r.groups[TP]
        assert g == list(range(g[0], g[0] + d.tp))


def _max(plan, key: str) -> int:
    return max(r.state_bytes[key] for r in plan.ranks)


def test_model_state_bytes_shrink_with_tp_pp_and_sharding():
    base = plan_of(16, tp=1, pp=1, dp=-1)
    full = base.num_params * 4
    assert _max(base, "params") == full and _max(base, "optimizer") == 2 * full  # AdamW: two fp32 moments
    tp = plan_of(16, tp=2, pp=1, dp=-1)
    pp = plan_of(16, tp=1, pp=2, dp=-1)
    both = plan_of(16, tp=2, pp=2, dp=-1)
    sharded = plan_of(16, tp=2, pp=1, sharding=4, dp=-1)
    assert _max(tp, "params") < full and _max(pp, "params") < full
    assert _max(both, "params") < min(_max(tp, "params"), _max(pp, "params"))
    # FSDP2 (ZeRO-3) divides all three exactly by the sharding degree (fractional bytes rounded down).
    for key in ("params", "grads", "optimizer"):
        assert abs(_max(sharded, key) - _max(tp, key) / 4) <= 1
    # Traffic: no pipeline → no p2p; no replicas → no dp all-reduce; sharding → reduce-scatter + all-gathers.
    assert all(r.comm_bytes[PP] == 0 for r in tp.ranks) and all(r.comm_bytes[PP] > 0 for r in both.ranks)
    assert all(r.comm_bytes[SHARDING] > 0 for r in sharded.ranks) and all(r.comm_bytes[TP] == 0 for r in pp.ranks)
    assert all(r.comm_bytes[EP] == 0 for r in both.ranks)


def test_per_rank_params_equal_a_direct_count_on_the_split_model():
    """tp=2 × pp=2 on 4 ranks: apply the real TP plan and pipeline cut to a CPU model as each rank would
    (fake backend), and count the local bytes of what is left."""
    from parallelkit.distributed.tensor_parallel import apply_tp
    from parallelkit.models.gpt.model import GPT
    from parallelkit.models.gpt.parallelize import pipeline_blocks, pipeline_stages, tensor_parallel_plan
    from parallelkit.distributed.pipeline_parallel import stage_blocks

    plan = build_plan([*TINY, "strategy=hybrid4d", "strategy.tp=2", "strategy.pp=2", "strategy.dp=1", "trainer.devices=4"])
    vocab = 128  # the chars data's vocabulary padded to a multiple of 64 (what the plan's model got)
    counted = []
    for rank in range(4):
        with fake_world(4, rank):
            mesh = plan.dims.build_mesh("cpu")
            model = GPT(vocab_size=vocab, block_size=16, n_layer=2, n_head=2, n_embd=32)
            assert sum(p.numel() for p in model.parameters()) == plan.num_params
            apply_tp(model, mesh["tp"], tensor_parallel_plan(model, 2))
            pp_rank = plan.dims.coordinates(rank)[PP]
            pipeline_stages(model, stage_blocks(pipeline_blocks(model), 2), [pp_rank])
            counted.append(sum(p.to_local().numel() * 4 for p in model.parameters()))
    assert [r.state_bytes["params"] for r in plan.ranks] == counted
    assert len(set(counted)) > 1  # the two stages differ (embeddings vs head): not a trivial equality


def test_hf_model_per_rank_params_equal_a_direct_count_on_the_split_model():
    """The same count for a Hugging Face Llama (``model=hf``): its plans come from its transformers config."""
    from parallelkit.distributed.pipeline_parallel import stage_blocks
    from parallelkit.distributed.tensor_parallel import apply_tp
    from parallelkit.models.hf import HFCausalLM
    from parallelkit.models.plans import model_plans

    plan = build_plan(["model=hf", "data.seq_len=16", "strategy=hybrid4d", "strategy.tp=2", "strategy.pp=2", "strategy.dp=1",
                       "trainer.devices=4"])
    assert "hidden 64" in plan.notes[0]  # the transformers config's sizes (hidden_size), not a GPT's
    assert all(r.comm_bytes[TP] > 0 and r.comm_bytes[PP] > 0 for r in plan.ranks)
    counted = []
    for rank in range(4):
        with fake_world(4, rank):
            mesh = plan.dims.build_mesh("cpu")
            model = HFCausalLM(vocab_size=128, block_size=16)
            assert sum(p.numel() for p in model.parameters()) == plan.num_params
            plans = model_plans(model)
            apply_tp(model, mesh["tp"], plans.tensor_parallel_plan(2))
            plans.pipeline_stages(stage_blocks(plans.pipeline_blocks(), 2), [plan.dims.coordinates(rank)[PP]])
            counted.append(sum(p.to_local().numel() * 4 for p in model.parameters()))
    assert [r.state_bytes["params"] for r in plan.ranks] == counted and len(set(counted)) > 1


def test_cli_prints_the_64_rank_plan_and_draws_it(tmp_path, capsys):
    png = tmp_path / "plan.png"
    code = main([*TINY, "strategy=hybrid4d", "strategy.tp=2", "strategy.pp=2", "trainer.devices=64", "--png", str(png)])
    out = capsys.readouterr().out
    assert code == 0
    assert "world=64" in out and "'dp': 16" in out
    assert sum(1 for line in out.splitlines() if line.strip()[:2].strip().isdigit()) == 64  # one row per rank
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert not torch.distributed.is_initialized()  # the fake group was torn down


def test_cli_bad_degrees_exit_2(capsys):
    code = main([*TINY, "strategy=hybrid4d", "strategy.tp=3", "strategy.pp=2", "trainer.devices=64"])
    assert code == 2
    assert "tp(3)" in capsys.readouterr().err
