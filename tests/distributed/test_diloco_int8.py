"""Streaming DiLoCo's int8 outer gradients on 2 real gloo ranks.

The exchange (:mod:`parallelkit.distributed.diloco_quantize`): every rank quantizes its own outer gradient,
the packed buffers are all-gathered, every rank averages them in fp32. Checked here: both ranks end with
bit-identical means; the mean is within the replicas' mean ``scale / 2`` of the fp32 mean of both ranks'
inputs (the reference, computed in the test from what each rank returned); the bytes counted are what gloo's
all-gather writes for ``n + 4⌈n / CHUNK⌉`` bytes and what the process wrote (``/proc/self/io``), and a
quarter of an fp32 all-reduce's (+ the scales and headers). Negative control: an int8 all-reduce of the
payloads (what "just all-reduce the int8 tensor" would do) wraps around.

DiLoCo with ``outer_dtype=int8`` (2 fragments, τ = 1): anchors and the end's model bit-identical on both
ranks, close to (and not equal to) the fp32 run of the same drifts; the in-flight and peak extra memory it
reports equal the tensors it is known to hold; checkpointed with a fragment's all-gather in flight (through
bytes, as a file) and reloaded into fresh parameters, it continues bit for bit (negative control: a
checkpoint whose in-flight buffer lost one rank's bytes does not).
"""

from __future__ import annotations

import io
import warnings

import torch
import torch.distributed as dist

from parallelkit.distributed.comm_counting import counting
from parallelkit.distributed.comm_stats import CommStats, wire_bytes
from parallelkit.distributed.diloco import OUTER_ALLREDUCE, DiLoCo
from parallelkit.distributed.diloco_quantize import (
    CHUNK,
    finish_int8_mean,
    mean_of_gathered,
    pack,
    packed_bytes,
    quantize,
    start_int8_mean,
)
from parallelkit.process_stats import os_bytes_written

from .harness import run_ranks

WORLD_SIZE = 2
NUMEL = 50_123  # gloo's headers are < 1 % of the payload; not a multiple of the chunk


def _delta(rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(NUMEL, generator=gen) * (1 + rank)
    x[:CHUNK] *= 1e-3  # a chunk of small deltas
    return x


def _exchange(rank: int, world: int) -> dict:
    warnings.simplefilter("ignore", FutureWarning)
    stats = CommStats()
    delta = _delta(rank)
    dist.barrier()
    before = os_bytes_written()
    with counting(stats, "int8"):
        exchange = start_int8_mean(delta, dist.group.WORLD)
    finish_int8_mean(exchange)
    written = os_bytes_written() - before
    dist.barrier()
    mean = mean_of_gathered(exchange["gathered"], NUMEL)
    fp32 = delta.clone()
    with counting(stats, "fp32"):
        dist.all_reduce(fp32)
    # negative control: all-reduce the int8 payloads themselves (sums in int8)
    q, _ = quantize(delta)
    summed = q.clone()
    dist.all_reduce(summed)
    return {"delta": delta, "mean": mean, "counted": stats.bytes("int8"), "written": written,
            "fp32_counted": stats.bytes("fp32"), "own_q": q, "int8_summed": summed,
            "expected": wire_bytes("all_gather", packed_bytes(NUMEL), world, rank, "gloo", element_size=1)}


def test_int8_exchange_is_identical_on_every_rank_close_to_fp32_and_counted_as_written(tmp_path):
    a, b = run_ranks(_exchange, WORLD_SIZE, tmp_path)
    assert torch.equal(a["mean"], b["mean"])  # bit-identical on both ranks
    reference = (a["delta"] + b["delta"]) / 2
    bound = sum(quantize(r["delta"])[1].repeat_interleave(CHUNK)[:NUMEL] for r in (a, b)) / 4  # mean of scale / 2
    assert torch.all((a["mean"] - reference).abs() <= bound * (1 + 1e-5))
    assert not torch.equal(a["mean"], reference)
    # the reference recomputed from both ranks' inputs, in rank order: the same bits
    assert torch.equal(mean_of_gathered(torch.stack([pack(*quantize(r["delta"])) for r in (a, b)]), NUMEL), a["mean"])
    for r in (a, b):
        assert r["counted"] == r["written"] == r["expected"]
        ratio = r["fp32_counted"] / r["counted"]
        assert 4 / (1 + 4 / CHUNK) * 0.99 < ratio < 4, ratio  # a quarter of fp32's, the scales and headers aside
    # negative control: an int8 sum of the payloads wraps where both ranks' values have the same sign and are large
    q0, q1, summed = a["own_q"].int(), b["own_q"].int(), a["int8_summed"].int()
    overflow = (q0 + q1).abs() > 127
    assert overflow.any() and not torch.equal(summed[overflow], (q0 + q1)[overflow])


STREAM = dict(inner_steps=4, outer_lr=0.7, outer_momentum=0.9, nesterov=True, fragments=2, overlap_steps=1, mix=0.5)
STEPS = 11  # fragment 0 starts after 1, 5, 9; fragment 1 after 3, 7; step 10 ends the run with fragment 0 in flight
RESUME_AT = 6  # steps done before the checkpoint: fragment 0's all-gather (started after step 5) in flight


def _new(dtype: str, seed: int = 0) -> tuple[list[torch.nn.Parameter], DiLoCo, CommStats]:
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (3000, 5000, 2500, 6000)]  # fragments [0, 1] and [2, 3]
    stats = CommStats()
    return params, DiLoCo(params, dist.group.WORLD, stats, **STREAM, outer_dtype=dtype), stats


def _drift(params: list[torch.nn.Parameter], rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * rank + step)  # each rank moves its own way, a function of the step
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)


def _resumed(rank: int, damage: bool) -> list[torch.Tensor]:
    params, diloco, _ = _new("int8")
    for step in range(RESUME_AT):
        _drift(params, rank, step)
        diloco.after_step(step)
    assert diloco.pending is not None and "gathered" in diloco.pending
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "diloco": diloco.state_dict()}, buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    if damage:  # negative control: rank 1's bytes lost from the in-flight buffer
        saved["diloco"]["pending"]["gathered"][1].zero_()
    params, diloco, _ = _new("int8", seed=1)  # another init: the load must overwrite it
    with torch.no_grad():
        for p, v in zip(params, saved["params"]):
            p.copy_(v)
    diloco.load_state_dict(saved["diloco"])
    for step in range(RESUME_AT, STEPS):
        _drift(params, rank, step)
        diloco.after_step(step, force=step == STEPS - 1)
    return [p.detach().clone() for p in params]


def _drifting(rank: int, world: int) -> dict:
    out = {"resumed": _resumed(rank, damage=False), "resumed_damaged": _resumed(rank, damage=True)}
    for dtype in ("int8", "fp32"):
        params, diloco, stats = _new(dtype)
        anchors, memory = [], None
        for step in range(STEPS):
            _drift(params, rank, step)
            diloco.after_step(step, force=step == STEPS - 1)
            anchors.append([a.clone() for a in diloco.anchors])
            if step == STEPS - 2:
                memory = diloco.memory_bytes()
        f0, f1 = (sum(params[i].numel() for i in idx) for idx in diloco.fragments)
        if dtype == "int8":
            exchange = [wire_bytes("all_gather", packed_bytes(f), world, rank, "gloo", element_size=1) for f in (f0, f1)]
        else:
            exchange = [wire_bytes("all_reduce", 4 * f, world, rank, "gloo", element_size=4) for f in (f0, f1)]
        # fragment 0 exchanged after steps 1, 5, 9, fragment 1 after 3, 7; the end averages fragment 1 in fp32
        expected = 3 * exchange[0] + 2 * exchange[1] + wire_bytes("all_reduce", 4 * f1, world, rank, "gloo", element_size=4)
        out[dtype] = {"anchors": anchors, "params": [p.detach().clone() for p in params], "memory": memory,
                      "outer_steps": list(diloco.outer_steps), "bytes": stats.bytes(OUTER_ALLREDUCE),
                      "expected_bytes": expected, "exchange_bytes": 3 * exchange[0] + 2 * exchange[1],
                      "fragment_numel": [f0, f1]}
    return out


def test_diloco_int8_identical_on_both_ranks_close_to_fp32_resumes_exactly_and_memory_as_held(tmp_path):
    a, b = run_ranks(_drifting, WORLD_SIZE, tmp_path)
    for dtype in ("int8", "fp32"):
        for step in range(STEPS):
            assert all(torch.equal(x, y) for x, y in zip(a[dtype]["anchors"][step], b[dtype]["anchors"][step])), (dtype, step)
        assert all(torch.equal(x, y) for x, y in zip(a[dtype]["params"], b[dtype]["params"]))  # the end: one model
    assert a["int8"]["outer_steps"] == a["fp32"]["outer_steps"] == [(2, 0), (4, 1), (6, 0), (8, 1), (10, 0)]
    for r in (a, b):  # resumed with fragment 0's all-gather in flight: bit for bit; a damaged buffer is caught
        assert all(torch.equal(x, y) for x, y in zip(r["resumed"], r["int8"]["params"]))
        assert not all(torch.equal(x, y) for x, y in zip(r["resumed_damaged"], r["int8"]["params"]))
    # close to fp32: the outer steps moved the anchors by ~0.05; int8 errs by <= 1/254 of a chunk's absmax per outer step
    diff = max((x - y).abs().max().item() for x, y in zip(a["int8"]["params"], a["fp32"]["params"]))
    moved = max((x - y).abs().max().item() for x, y in zip(a["fp32"]["params"], a["fp32"]["anchors"][0]))
    assert 0 < diff < moved / 20, (diff, moved)
    # memory: every fragment's fp32 anchor and momentum; in flight: the send buffer and both ranks' gathered copies
    total = sum(a["int8"]["fragment_numel"])
    f0, f1 = a["int8"]["fragment_numel"]
    for dtype, in_flight in (("int8", (1 + WORLD_SIZE) * max(packed_bytes(f0), packed_bytes(f1))), ("fp32", 4 * max(f0, f1))):
        m = a[dtype]["memory"]
        assert m["anchors"] == m["outer_momentum"] == 4 * total
        assert m["in_flight"] == in_flight, (dtype, m)
        # the outer step's moment: anchors, momentum, the gathered buffers (fp32: the all-reduced flat) and the fp32 mean
        fp32_mean = 4 * max(f0, f1)
        held = WORLD_SIZE * max(packed_bytes(f0), packed_bytes(f1)) + fp32_mean if dtype == "int8" else fp32_mean
        assert m["peak"] == 8 * total + held, (dtype, m)
    # bytes: 5 fragment exchanges, then the end's fp32 average of fragment 1 (fragment 0 completes at the end)
    for r in (a, b):
        for dtype in ("int8", "fp32"):
            assert r[dtype]["bytes"] == r[dtype]["expected_bytes"], (dtype, r[dtype]["bytes"], r[dtype]["expected_bytes"])
        # a quarter of fp32's, but for the scales (4 B per CHUNK) and gloo's headers (288 B per all-gather of ~8 KB here)
        ratio = r["fp32"]["exchange_bytes"] / r["int8"]["exchange_bytes"]
        assert 4 / (1 + 4 / CHUNK) * 0.96 < ratio < 4 / (1 + 4 / CHUNK), ratio
