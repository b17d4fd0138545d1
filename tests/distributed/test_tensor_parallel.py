"""Tensor parallel on 2 real gloo ranks, against the same layers computed whole in each rank's process.

What is checked: a column+row parallel pair equals the unsplit layers (outputs, input and weight
gradients), with each rank feeding its own rows; a GPT split by its plan equals the single-process GPT
(loss, every gradient, the weights after an optimizer step), with and without sequence parallel; and the
collectives DTensor issues are counted per transformer block (2 all-reduces forward + 2 backward, or
their all-gather/reduce-scatter halves), with Megatron-LM's 8·b·s·h·(t−1)/t elements per layer, and the
count equals what each rank's process wrote in forward and in backward (``/proc/self/io`` ``wchar``). On
gloo a reduce-scatter is an all-reduce of the whole input (twice Megatron's reduce-scatter bytes), and every
collective adds 48-byte message headers: the expectations say so.
Negative controls: a row-parallel layer that skips its reduction is caught by the comparison, and a plan
without the shared attention input issues 3 backward all-reduces in attention, which the counter sees.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from parallelkit.callbacks.run_summary import os_bytes_written
from parallelkit.distributed.comm_counting import uncounted
from parallelkit.distributed.comm_stats import CommStats, collective_bytes
from parallelkit.distributed.tensor_parallel import TensorParallelPlan, apply_tp
from parallelkit.errors import ConfigError
from parallelkit.models.gpt import GPT
from parallelkit.models.gpt.parallelize import TP_BLOCK_KIND, check_tensor_parallel, tensor_parallel_plan

from .harness import run_ranks

TINY = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
BATCH = 4
TOL = dict(rtol=1e-5, atol=1e-6)


# gloo on 2 ranks: headers (48 bytes each) of a ring all-reduce (4 messages each way, 3 headers per message)
# and of an all-gather (2 half-shards each way).
AR_HEADERS, AG_HEADERS = 12 * 48, 6 * 48


def _settled(stats: CommStats, group, marks: list) -> tuple[int, int]:
    """(bytes counted, bytes written not by these barriers) once every collective issued so far has finished:
    a gloo barrier runs after all prior work of its group. ``marks`` keeps the barriers' own bytes."""
    marks.append(collective_bytes(0, "barrier", group))
    with uncounted():  # the measuring instrument, not the traffic measured
        torch.distributed.barrier(group=group)
    return stats.bytes(), os_bytes_written() - sum(marks)


def _counts(stats: CommStats) -> dict[str, tuple[int, int]]:
    return {kind: (v["collectives"], v["bytes"]) for kind, v in stats.totals()["by_kind"].items()}


def _minus(after: dict, before: dict) -> dict:
    out = {}
    for kind, (calls, nbytes) in after.items():
        c0, b0 = before.get(kind, (0, 0))
        if calls - c0:
            out[kind] = (calls - c0, nbytes - b0)
    return out


def _waited(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: the result of an asynchronous functional collective must be waited for before it leaves."""
    return t.wait() if hasattr(t, "wait") else t


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# --------------------------------------------------------------------------- a column + row pair
class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _pair(rank: int, world_size: int, sharded_batch: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    reference = Pair()
    x_all = torch.randn(8, 16)
    upstream = torch.randn(8, 16)  # the gradient arriving at the pair's output
    # Each rank feeds its own rows (Shard(0)), or, Megatron's f/g layout, the same replicated input.
    rows = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size) if sharded_batch else slice(None)
    layout = Shard(0) if sharded_batch else Replicate()
    out = {}
    variants = [("split", layout)]
    if not sharded_batch:  # negative control: the row-parallel layer hands on its partial sums unreduced
        variants.append(("no_reduce", Partial()))
    for name, down_out in variants:
        model = copy.deepcopy(reference)
        plan = TensorParallelPlan({"up": ColwiseParallel(input_layouts=layout), "down": RowwiseParallel(output_layouts=down_out)})
        stats = CommStats()
        tp = apply_tp(model, mesh, plan, comm_stats=stats)
        x = x_all[rows].clone().requires_grad_(True)
        marks: list = []
        start = _settled(stats, mesh.get_group(), marks)
        with tp.context():
            y = model(x)
            forward = _counts(stats)
            mid = _settled(stats, mesh.get_group(), marks)
            (y * upstream[rows]).sum().backward()
        end = _settled(stats, mesh.get_group(), marks)
        out[name] = {
            "wire": [(b[0] - a[0], b[1] - a[1]) for a, b in ((start, mid), (mid, end))],  # (counted, written) fwd, bwd
            "y": _waited(y),
            "x_grad": _waited(x.grad),
            "grads": {n: _full(p.grad) for n, p in model.named_parameters()},
            "forward": forward,
            "backward": _minus(_counts(stats), forward),
        }
    x = x_all.clone().requires_grad_(True)
    y = reference(x)
    (y * upstream).sum().backward()
    out["reference"] = {"y": y[rows], "x_grad": x.grad[rows], "grads": {n: p.grad for n, p in reference.named_parameters()}}
    return out


def _max_error(result: dict, reference: dict) -> float:
    if result["y"].shape != reference["y"].shape:
        return float("inf")
    errors = [(result["y"] - reference["y"]).abs().max(), (result["x_grad"] - reference["x_grad"]).abs().max()]
    errors += [(result["grads"][n] - g).abs().max() for n, g in reference["grads"].items()]
    return float(max(errors))


@pytest.mark.parametrize("sharded_batch", [True, False], ids=["rows_per_rank", "replicated_input"])
def test_column_row_pair_matches_unsplit_layers(tmp_path, sharded_batch):
    results = run_ranks(_pair, 2, tmp_path, sharded_batch)
    for rank, result in enumerate(results):
        assert _max_error(result["split"], result["reference"]) < 1e-5, rank
        if "no_reduce" in result:  # negative control: without the reduction each rank has a partial sum
            assert _max_error(result["no_reduce"], result["reference"]) > 1e-3, rank
        split = result["split"]
        assert all(counted == written for counted, written in split["wire"]), (rank, split["wire"])
        payload = 8 * 16 * 4  # the (8, 16) fp32 activation
        if sharded_batch:  # batch gathered into the column layer, output reduce-scattered; mirrored in backward
            # gloo's reduce-scatter all-reduces the whole (8, 16) input: S, not S·(t−1)/t
            expected = {"tp.all_gather": (1, payload // 2 + AG_HEADERS), "tp.reduce_scatter": (1, payload + AR_HEADERS)}
            assert split["forward"] == expected and split["backward"] == expected
        else:  # Megatron's g (forward all-reduce) and f (backward all-reduce)
            expected = {"tp.all_reduce": (1, payload + AR_HEADERS)}  # ring: 2·S·(t−1)/t = S at t = 2
            assert split["forward"] == expected and split["backward"] == expected


# --------------------------------------------------------------------------- a GPT split by its plan
def _gpt(rank: int, world_size: int, sequence_parallel: bool, shared_attention_input: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    reference = GPT(**TINY)
    model = copy.deepcopy(reference)
    # Tensor-parallel peers read the same batch (data parallelism is across groups).
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, TINY["vocab_size"], (BATCH, TINY["block_size"]), generator=gen)
    targets = torch.randint(0, TINY["vocab_size"], (BATCH, TINY["block_size"]), generator=gen)

    plan = tensor_parallel_plan(model, world_size, sequence_parallel=sequence_parallel)
    if not shared_attention_input:  # each of q/k/v converts its input itself
        plan.layout = {k: v for k, v in plan.layout.items() if k not in ("layers.*.attn", "layers.*.mlp")}
    stats = CommStats()
    tp = apply_tp(model, mesh["tp"], plan, comm_stats=stats)
    group, marks = mesh["tp"].get_group(), []
    start = _settled(stats, group, marks)
    with tp.context():
        logits = model(idx)
        loss = model.loss(logits, targets)
        forward = _counts(stats)
        loss.backward()
    backward = _counts(stats)
    tp.sync()
    synced = _counts(stats)
    end = _settled(stats, group, marks)

    ref_loss = reference.loss(reference(idx), targets)
    ref_loss.backward()
    grads = {n: (_full(p.grad), q.grad) for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters())}
    grad_layouts_match = all(p.grad.placements == p.placements for p in model.parameters())
    # SGD, not Adam: Adam's first step divides by |grad|, so round-off in near-zero gradients becomes
    # O(lr) weight differences; SGD keeps the comparison about the gradients' layout.
    for params in (model.parameters(), reference.parameters()):
        torch.optim.SGD(list(params), lr=0.5).step()
    weights = {n: (_full(p), q) for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters())}
    return {
        "loss": (_full(loss), ref_loss),
        "grads": grads,
        "weights": weights,
        "grad_layouts_match": grad_layouts_match,
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "logits": (type(logits).__name__, str(logits.placements), tuple(logits.to_local().shape)),
        "forward": forward,
        "backward": _minus(backward, forward),
        "sync": _minus(synced, backward),
        "wire": (end[0] - start[0], end[1] - start[1]),  # (counted, written) over forward, backward and sync
    }


def _assert_matches_reference(result: dict) -> None:
    torch.testing.assert_close(*result["loss"], **TOL)
    for name, (got, want) in result["grads"].items():
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, name=name: f"grad {name}: {m}")
    for name, (got, want) in result["weights"].items():
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, name=name: f"weight {name}: {m}")
    assert result["grad_layouts_match"] and result["all_dtensor"]


def _megatron_bytes_per_layer(tp: int) -> float:
    """8·b·s·h·(t−1)/t elements per layer per step (Megatron-LM), in fp32 bytes."""
    return 8 * BATCH * TINY["block_size"] * TINY["n_embd"] * (tp - 1) / tp * 4


def _block_headers(counts: dict) -> int:
    """gloo's message headers in a phase's block collectives (2 ranks)."""
    headers = {"all_reduce": AR_HEADERS, "reduce_scatter": AR_HEADERS, "all_gather": AG_HEADERS}
    return sum(calls * headers[op] for op, (calls, _) in _block(counts).items())


def _block(counts: dict) -> dict:
    return {k.split(".", 1)[1]: v for k, v in counts.items() if k.startswith(TP_BLOCK_KIND + ".")}


def test_gpt_plan_matches_single_process_and_counts_two_allreduces_per_block(tmp_path):
    results = run_ranks(_gpt, 2, tmp_path, False, True)
    layers = TINY["n_layer"]
    for result in results:
        _assert_matches_reference(result)
        assert result["wire"][0] == result["wire"][1], result["wire"]  # counted = written
        # Vocabulary-parallel output: each rank holds vocab / tp logits; nothing gathers them.
        assert result["logits"] == ("DTensor", "(Shard(dim=2),)", (BATCH, TINY["block_size"], TINY["vocab_size"] // 2))
        assert not any("all_gather" in kind for kind in {**result["forward"], **result["backward"]})
        for phase in ("forward", "backward"):
            calls, nbytes = _block(result[phase])["all_reduce"]
            assert calls == 2 * layers, (phase, result[phase])
            assert set(_block(result[phase])) == {"all_reduce"}
        headers = sum(_block_headers(result[phase]) for phase in ("forward", "backward"))
        per_layer = (_block(result["forward"])["all_reduce"][1] + _block(result["backward"])["all_reduce"][1] - headers) / layers
        assert per_layer == pytest.approx(_megatron_bytes_per_layer(2), rel=0.05)
        # Without sequence parallel every gradient already has its parameter's layout: sync sends nothing.
        assert result["sync"] == {}


def test_sequence_parallel_turns_each_allreduce_into_allgather_and_reducescatter(tmp_path):
    results = run_ranks(_gpt, 2, tmp_path, True, True)
    layers = TINY["n_layer"]
    for result in results:
        _assert_matches_reference(result)
        assert result["wire"][0] == result["wire"][1], result["wire"]  # counted = written
        for phase in ("forward", "backward"):
            block = _block(result[phase])
            assert set(block) == {"all_gather", "reduce_scatter"}, (phase, result[phase])
            assert block["all_gather"][0] == block["reduce_scatter"][0] == 2 * layers
        phases = ("forward", "backward")
        gathered = sum(_block(result[p])["all_gather"][1] - _block(result[p])["all_gather"][0] * AG_HEADERS for p in phases) / layers
        scattered = sum(_block(result[p])["reduce_scatter"][1] - _block(result[p])["reduce_scatter"][0] * AR_HEADERS for p in phases) / layers
        # Megatron's split: all-gathers and reduce-scatters each half of 8·b·s·h·(t−1)/t. gloo's reduce-scatter
        # is an all-reduce (2(t−1)/t of the input): its half costs twice that, 1.5× the formula in all.
        assert gathered == pytest.approx(_megatron_bytes_per_layer(2) / 2, rel=0.05)
        assert scattered == pytest.approx(_megatron_bytes_per_layer(2), rel=0.05)
        # LayerNorm weights see only their sequence shard: their partial gradients are summed, in one call.
        assert list(result["sync"]) == ["tp_grad_allreduce"] and result["sync"]["tp_grad_allreduce"][0] == 1


def test_negative_control_plan_without_shared_attention_input_costs_more_allreduces(tmp_path):
    """The count is measured: q, k and v converting their input separately reduce 3 gradients, not 1."""
    results = run_ranks(_gpt, 2, tmp_path, False, False)
    for result in results:
        _assert_matches_reference(result)  # still correct, only more traffic
        assert _block(result["forward"])["all_reduce"][0] == 2 * TINY["n_layer"]
        assert _block(result["backward"])["all_reduce"][0] == 4 * TINY["n_layer"]  # 3 (q, k, v) + 1 (MLP)


# --------------------------------------------------------------------------- bad input, no process group
def test_sizes_that_tp_does_not_divide_are_named():
    model = GPT(**{**TINY, "n_head": 3, "n_embd": 36, "vocab_size": 66})
    with pytest.raises(ConfigError, match=r"strategy.tp=4 does not divide model.n_head=3 .*; vocab_size=66 "):
        check_tensor_parallel(model.config, 4)
    with pytest.raises(ConfigError, match=r"model.n_head=2 .*data.seq_len \(block_size\)=16"):
        check_tensor_parallel(GPT(**TINY).config, 3, sequence_parallel=True)
    check_tensor_parallel(GPT(**TINY).config, 2, sequence_parallel=True)  # fits: no error


def test_strategy_rejects_bad_degrees_and_models_before_launch():
    from parallelkit.strategies.tp import TensorParallelStrategy

    with pytest.raises(ConfigError, match=r"strategy.tp=4 is larger than the 2 process"):
        TensorParallelStrategy(tp=4).plan(2)
    with pytest.raises(ConfigError, match=r"strategy.pp=2 would be ignored"):
        TensorParallelStrategy(tp=2, pp=2)
    strategy = TensorParallelStrategy(tp=2)
    assert strategy.plan(4).as_dict() == {"dp": 2, "sharding": 1, "cp": 1, "tp": 2, "pp": 1, "ep": 1}
    with pytest.raises(ConfigError, match=r"model.n_head=3"):
        strategy.check_model(GPT(**{**TINY, "n_head": 3, "n_embd": 48}), 4)
    with pytest.raises(ConfigError, match=r"needs a tensor parallel plan for Linear"):
        strategy.check_model(nn.Linear(4, 4), 4)
    strategy.check_model(GPT(**TINY), 4)  # fits: no error
