"""``apply_ep`` on real gloo ranks against a single-process MoE GPT trained on the whole batch.

Every rank trains the same initial MoE GPT on its *own* rows of each global batch; experts are sharded over
the expert-parallel group, tokens travel by all-to-all, dense gradients are averaged over all ranks and
expert gradients over the ranks holding the same experts (as ``strategy=moe`` composes it). The run must
equal one process on the whole batch: local losses average to the full-batch loss, gradients and stepped
weights match, with and without dropped tokens (capacity is decided over the global batch). The token
all-to-alls are counted: 2 per MoE layer in forward, 2 in backward, with exactly the routed tokens' bytes.

Negative control: experts placed on the wrong rank (each rank holds the other's weights) must be caught.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from parallelkit.callbacks.run_summary import os_bytes_written
from parallelkit.distributed.comm_stats import CommStats
from parallelkit.distributed.expert_parallel import MOE_ALL_TO_ALL, apply_ep, local_expert_ids
from parallelkit.distributed.grad_sync import apply_grad_allreduce
from parallelkit.distributed.parallel_dims import ParallelDims
from parallelkit.models.moe_gpt import MoEGPT
from parallelkit.models.moe_gpt.parallelize import expert_parallel_plan

from .harness import run_ranks

VOCAB, SEQ, EMBD, EXPERTS, TOP_K, LAYERS = 32, 8, 16, 4, 2, 2
LOCAL_BATCH = 3
STEPS = 2
SEED, DATA_SEED = 0, 11
NO_DROPS = EXPERTS / TOP_K  # a capacity factor that can never drop
DROPS = 0.75
STARVED = 0.01  # capacity 1 per expert: most exchanges are empty, some ranks send or receive no token at all
RTOL, ATOL = 1e-5, 1e-6


def _model(capacity_factor: float, top_k: int = TOP_K, idle_experts: bool = False) -> MoEGPT:
    torch.manual_seed(SEED)
    model = MoEGPT(
        vocab_size=VOCAB,
        block_size=SEQ,
        n_layer=LAYERS,
        n_head=2,
        n_embd=EMBD,
        num_experts=EXPERTS,
        top_k=top_k,
        capacity_factor=capacity_factor,
        aux_loss_weight=0.05,
    )
    if idle_experts:  # top-1 routing that never picks experts 2 and 3: their rank computes nothing
        with torch.no_grad():
            for layer in model.moe_layers().values():
                w = layer.router.weight
                w[1] = -w[0]  # max(logit_0, logit_1) = |logit_0| >= 0 = logit_2 = logit_3
                w[0] *= 100
                w[1] *= 100
                w[2:] = 0
    return model


def _batches(world: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(DATA_SEED)
    return torch.randint(0, VOCAB, (STEPS, world * LOCAL_BATCH, SEQ + 1), generator=gen)


def _rows(rank: int) -> slice:
    return slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # SGD, not Adam: Adam divides by the gradient's own size, so it amplifies the round-off of gradients that
    # are zero in exact arithmetic (the attention key bias) into visible weight differences.
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train_ep(rank: int, world: int, variants: dict[str, dict]) -> dict:
    data = _batches(world)
    out = {}
    for name, spec in variants.items():
        dims = ParallelDims.from_degrees(world, dp=-1, ep=spec["ep"])
        ep_group, _ = dist.new_subgroups_by_enumeration(dims.expert_parallel_groups())
        expert_dp_group, _ = dist.new_subgroups_by_enumeration(dims.expert_data_parallel_groups())
        model = _model(spec["capacity_factor"], spec.get("top_k", TOP_K), spec.get("idle_experts", False))
        stats = CommStats()
        handle = apply_ep(model, expert_parallel_plan(model), ep_group=ep_group, routing_group=dist.group.WORLD, comm_stats=stats)
        if spec.get("swap_experts"):  # broken on purpose: this rank's experts get another rank's weights
            other = _model(spec["capacity_factor"])
            ids = local_expert_ids(EXPERTS, spec["ep"], (dist.get_rank(ep_group) + 1) % spec["ep"])
            for layer, other_layer in zip(model.moe_layers().values(), other.moe_layers().values()):
                for key, src in zip(list(layer.experts.experts.keys()), ids):
                    layer.experts.experts[key].load_state_dict(other_layer.experts.experts[str(src)].state_dict())
        syncs = [apply_grad_allreduce(handle.dense_params, dist.group.WORLD), apply_grad_allreduce(handle.expert_params, expert_dp_group)]
        optimizer = _optimizer(model)
        record = {"local_experts": handle.local_experts, "loss": [], "grads": [], "fwd": [], "bwd": [], "dropped": []}
        for step in range(STEPS):
            batch = data[step, _rows(rank)]
            optimizer.zero_grad(set_to_none=True)
            before = (stats.calls(MOE_ALL_TO_ALL), stats.bytes(MOE_ALL_TO_ALL), stats.bytes(), os_bytes_written())
            loss = model.loss(model(batch[:, :-1]), batch[:, 1:])
            mid = (stats.calls(MOE_ALL_TO_ALL), stats.bytes(MOE_ALL_TO_ALL), stats.bytes(), os_bytes_written())
            loss.backward()
            after = (stats.calls(MOE_ALL_TO_ALL), stats.bytes(MOE_ALL_TO_ALL), stats.bytes(), os_bytes_written())
            for sync in syncs:
                sync.sync()
            optimizer.step()
            record["loss"].append(loss.detach())
            record["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
            # (token all-to-alls, their bytes, all bytes counted, bytes the process wrote)
            record["fwd"].append(tuple(m - b for m, b in zip(mid, before)))
            record["bwd"].append(tuple(a - m for a, m in zip(after, mid)))
            record["dropped"].append(sum(layer.last_stats["dropped"] for layer in model.moe_layers().values()))
        record["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[name] = record
    return out


def _reference(world: int, capacity_factor: float, top_k: int = TOP_K, idle_experts: bool = False) -> dict:
    """One process, the whole batch; records per-step routing to know which tokens travel."""
    data = _batches(world)
    model = _model(capacity_factor, top_k, idle_experts)
    routes: list[torch.Tensor] = []
    for layer in model.moe_layers().values():
        layer.router.register_forward_hook(lambda mod, args, logits: routes.append(logits.detach().topk(top_k, dim=-1).indices))
    optimizer = _optimizer(model)
    ref = {"loss": [], "grads": [], "routes": [], "dropped": []}
    for step in range(STEPS):
        routes.clear()
        optimizer.zero_grad(set_to_none=True)
        loss = model.loss(model(data[step, :, :-1]), data[step, :, 1:])
        loss.backward()
        optimizer.step()
        ref["loss"].append(loss.detach())
        ref["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        ref["routes"].append(list(routes))
        ref["dropped"].append(sum(layer.last_stats["dropped"] for layer in model.moe_layers().values()))
    ref["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return ref


def _assert_matches(results: list[dict], ref: dict) -> None:
    for step in range(STEPS):
        # Each rank's loss is its rows' mean (plus its share of the aux loss): their mean is the global loss.
        assert_close(torch.stack([r["loss"][step] for r in results]).mean(), ref["loss"][step], rtol=RTOL, atol=ATOL)
        for rank, result in enumerate(results):
            assert result["dropped"][step] == ref["dropped"][step]
            for name, grad in result["grads"][step].items():  # a rank's own experts and all dense params
                assert_close(grad, ref["grads"][step][name], rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"rank {rank} step {step} grad {n}: {m}")
    for rank, result in enumerate(results):
        held = {n for n in result["params"] if ".experts.experts." in n}
        assert held == {n for n in ref["params"] if any(f".experts.experts.{e}." in n for e in result["local_experts"])}
        for name, value in result["params"].items():
            assert_close(value, ref["params"][name], rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"rank {rank} weights {n}: {m}")


def _assert_all_to_all_traffic(results: list[dict], ref: dict, ep: int) -> None:
    """2 token all-to-alls per MoE layer each way; bytes = the routed rows that leave the rank (no drops) plus
    gloo's headers (3 of 48 bytes per message, one message to and one from every peer); and everything counted
    in forward and backward (routing statistics too) is what the process wrote."""
    row_bytes = EMBD * 4
    headers = 2 * LAYERS * (ep - 1) * 3 * 48
    for rank, result in enumerate(results):
        ep_rank, group_start = rank % ep, rank - rank % ep
        mine = set(local_expert_ids(EXPERTS, ep, ep_rank))
        for step in range(STEPS):
            assert result["fwd"][step][0] == 2 * LAYERS and result["bwd"][step][0] == 2 * LAYERS, result
            expected = 0
            for route in ref["routes"][step]:  # (tokens, top_k) expert ids of one layer, whole batch
                per_rank = route.view(len(results), LOCAL_BATCH * SEQ, TOP_K)
                outgoing = sum(int(e) not in mine for e in per_rank[rank].flatten())
                incoming = sum(int(e) in mine for peer in range(group_start, group_start + ep) if peer != rank for e in per_rank[peer].flatten())
                expected += (outgoing + incoming) * row_bytes  # dispatch sends `outgoing`, combine returns `incoming`
            assert result["fwd"][step][1] == expected + headers, (rank, step, result["fwd"][step][1], expected)
            assert result["bwd"][step][1] == expected + headers  # backward: the same exchanges reversed
            assert result["fwd"][step][2] == result["fwd"][step][3], (rank, step, result["fwd"][step])
            assert result["bwd"][step][2] == result["bwd"][step][3], (rank, step, result["bwd"][step])


VARIANTS_2 = {
    "no_drops": {"ep": 2, "capacity_factor": NO_DROPS},
    "drops": {"ep": 2, "capacity_factor": DROPS},
    "swapped": {"ep": 2, "capacity_factor": NO_DROPS, "swap_experts": True},
    "starved": {"ep": 2, "capacity_factor": STARVED},
    "idle_rank": {"ep": 2, "capacity_factor": float(EXPERTS), "top_k": 1, "idle_experts": True},
}
VARIANTS_4 = {"ep2_dp2": {"ep": 2, "capacity_factor": DROPS}, "ep4": {"ep": 4, "capacity_factor": NO_DROPS}}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, list[dict]]:
    per_rank = run_ranks(_train_ep, 2, tmp_path_factory.mktemp("ep2"), VARIANTS_2)
    return {name: [r[name] for r in per_rank] for name in VARIANTS_2}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> dict[str, list[dict]]:
    per_rank = run_ranks(_train_ep, 4, tmp_path_factory.mktemp("ep4"), VARIANTS_4)
    return {name: [r[name] for r in per_rank] for name in VARIANTS_4}


def test_ranks_see_different_data_and_hold_different_experts(two_ranks):
    a, b = two_ranks["no_drops"]
    assert (a["loss"][0] - b["loss"][0]).abs() > 1e-3
    assert a["local_experts"] == [0, 1] and b["local_experts"] == [2, 3]


def test_ep2_matches_single_process_without_drops(two_ranks):
    ref = _reference(2, NO_DROPS)
    assert ref["dropped"] == [0] * STEPS
    _assert_matches(two_ranks["no_drops"], ref)
    _assert_all_to_all_traffic(two_ranks["no_drops"], ref, ep=2)


def test_ep2_drops_exactly_what_single_process_drops(two_ranks):
    ref = _reference(2, DROPS)
    assert all(d > 0 for d in ref["dropped"])
    _assert_matches(two_ranks["drops"], ref)
    for result in two_ranks["drops"]:  # fewer rows travel than without drops, still 2 + 2 per layer
        assert all(calls == 2 * LAYERS for calls, *_ in result["fwd"] + result["bwd"])


def test_empty_exchanges_when_almost_everything_is_dropped(two_ranks):
    ref = _reference(2, STARVED)
    results = two_ranks["starved"]
    # 2 layers × 4 experts × capacity 1 = 8 of the 2 × 48 × 2 assignments per step survive.
    assert ref["dropped"] == [LAYERS * (2 * LOCAL_BATCH * SEQ * TOP_K - EXPERTS)] * STEPS
    _assert_matches(results, ref)
    # Each surviving assignment travels at most there and back: at most 2 × 8 rows leave the ranks per step
    # (plus gloo's headers: every all-to-all is a message to and from the peer, empty or not).
    headers = len(results) * 2 * LAYERS * 3 * 48
    for step in range(STEPS):
        assert sum(r["fwd"][step][1] for r in results) <= 2 * LAYERS * EXPERTS * EMBD * 4 + headers
        assert all(r["fwd"][step][0] == 2 * LAYERS for r in results)


def test_a_rank_whose_experts_get_no_token(two_ranks):
    """Rank 1's experts are never chosen: it receives nothing, its experts run on empty input, it sends back nothing."""
    ref = _reference(2, float(EXPERTS), top_k=1, idle_experts=True)
    results = two_ranks["idle_rank"]
    _assert_matches(results, ref)
    for step in range(STEPS):
        for route in ref["routes"][step]:
            assert set(route.unique().tolist()) <= {0, 1}
        # Rank 1 dispatches all its tokens (2 layers × 24 rows) and gets no expert's work to return (its
        # combine all-to-all is an empty message: headers only).
        assert results[1]["fwd"][step][:2] == (2 * LAYERS, LAYERS * LOCAL_BATCH * SEQ * EMBD * 4 + 2 * LAYERS * 3 * 48)
        assert results[1]["fwd"][step][2] == results[1]["fwd"][step][3]  # counted = written


def test_negative_control_experts_on_the_wrong_rank_are_caught(two_ranks):
    ref = _reference(2, NO_DROPS)
    with pytest.raises(AssertionError):
        _assert_matches(two_ranks["swapped"], ref)
    # Tokens still travel (2 + 2 all-to-alls per layer), yet the loss is off.
    assert all(calls == 2 * LAYERS for r in two_ranks["swapped"] for calls, *_ in r["fwd"] + r["bwd"])
    losses = torch.stack([r["loss"][0] for r in two_ranks["swapped"]]).mean()
    assert (losses - ref["loss"][0]).abs() > 1e-4


def test_ep2_dp2_on_four_ranks_matches_with_drops(four_ranks):
    ref = _reference(4, DROPS)
    assert all(d > 0 for d in ref["dropped"])
    results = four_ranks["ep2_dp2"]
    _assert_matches(results, ref)
    assert [r["local_experts"] for r in results] == [[0, 1], [2, 3], [0, 1], [2, 3]]


def test_ep4_one_expert_per_rank(four_ranks):
    ref = _reference(4, NO_DROPS)
    _assert_matches(four_ranks["ep4"], ref)
    _assert_all_to_all_traffic(four_ranks["ep4"], ref, ep=4)
