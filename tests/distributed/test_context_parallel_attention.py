"""Context-parallel attention (ring and all-to-all) on real gloo ranks against one process's SDPA.

Every rank builds the same global q, k, v and upstream gradient from one seed, keeps its load-balanced shard,
and returns its outputs and input gradients; the test reassembles them and compares with
``scaled_dot_product_attention(is_causal=True)`` of the whole sequence, computed here. It also checks the
load balance (blocks per rank), that fully masked blocks were skipped, the exact traffic, and a negative
control (blocks merged without the log-sum-exp correction) that the comparison must catch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from parallelkit.distributed.comm_stats import (
    GLOO_RECV_OVERHEAD,
    GLOO_SEND_OVERHEAD,
    CommStats,
)
from parallelkit.distributed.context_parallel import (
    CP_ALL_TO_ALL,
    CP_RING_P2P,
    RingCounts,
    check_ulysses_heads,
    load_balanced_positions,
    load_balanced_shard,
    load_balanced_unshard,
    ring_attention,
    ring_payload_bytes,
    ulysses_attention,
)
from parallelkit.errors import ConfigError
from tests.distributed.harness import run_ranks

BATCH, HEADS, SEQ, HEAD_DIM = 2, 8, 256, 16
KV_HEADS = (2, 4)  # grouped-query attention: 4 and 2 query heads per key/value head
SEED = 1234
TOL = {"rtol": 0, "atol": 1e-5}


def _global_inputs(kv_heads: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED + kv_heads)
    shapes = {"q": (BATCH, HEADS, SEQ, HEAD_DIM), "k": (BATCH, kv_heads, SEQ, HEAD_DIM),
              "v": (BATCH, kv_heads, SEQ, HEAD_DIM), "dout": (BATCH, HEADS, SEQ, HEAD_DIM)}
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def _attend(rank: int, cp: int, fn, kv_heads: int, **kwargs) -> dict:
    data = _global_inputs(kv_heads)
    q, k, v = (load_balanced_shard(data[n], cp, rank, dim=2).requires_grad_() for n in ("q", "k", "v"))
    stats, counts = CommStats(), RingCounts()
    extra = {"counts": counts} if fn is ring_attention else {}
    out = fn(q, k, v, None, stats=stats, **extra, **kwargs)
    forward_bytes, forward_calls = stats.bytes(), stats.calls()
    out.backward(load_balanced_shard(data["dout"], cp, rank, dim=2))
    return {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad, "forward_bytes": forward_bytes, "forward_calls": forward_calls,
            "bytes": stats.bytes(), "calls": stats.calls(), "kinds": sorted(stats.totals()["by_kind"]),
            "forward_blocks": counts.forward_blocks, "backward_blocks": counts.backward_blocks, "skipped_blocks": counts.skipped_blocks}


def _rank(rank: int, world_size: int) -> dict:
    results = {}
    for kv_heads in KV_HEADS:
        results[f"ring/{kv_heads}"] = _attend(rank, world_size, ring_attention, kv_heads)
        results[f"ulysses/{kv_heads}"] = _attend(rank, world_size, ulysses_attention, kv_heads)
    results["ring_noncausal/4"] = _attend(rank, world_size, ring_attention, 4, causal=False)
    results["ring_no_lse/4"] = _attend(rank, world_size, ring_attention, 4, _lse_merge=False)
    dist.barrier()
    return results


def _reference(kv_heads: int, causal: bool = True) -> dict[str, torch.Tensor]:
    data = _global_inputs(kv_heads)
    q, k, v = (data[n].clone().requires_grad_() for n in ("q", "k", "v"))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    out.backward(data["dout"])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _gathered(results: list[dict], key: str, cp: int) -> dict[str, torch.Tensor]:
    return {name: load_balanced_unshard([r[key][name] for r in results], cp, dim=2) for name in ("out", "dq", "dk", "dv")}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda cp: f"cp{cp}")
def cp_run(request, tmp_path_factory):
    cp = request.param
    return cp, run_ranks(_rank, cp, tmp_path_factory.mktemp(f"cp{cp}"))


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@pytest.mark.parametrize("kv_heads", KV_HEADS)
def test_matches_single_process_sdpa(cp_run, mode, kv_heads):
    cp, results = cp_run
    got, want = _gathered(results, f"{mode}/{kv_heads}", cp), _reference(kv_heads)
    for name in ("out", "dq", "dk", "dv"):
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m, name=name: f"{mode} cp={cp} kv_heads={kv_heads} {name}: {m}")


def test_ring_non_causal_matches_sdpa(cp_run):
    cp, results = cp_run
    got, want = _gathered(results, "ring_noncausal/4", cp), _reference(4, causal=False)
    for name in ("out", "dq", "dk", "dv"):
        torch.testing.assert_close(got[name], want[name], **TOL)


def test_negative_control_without_lse_correction_fails(cp_run):
    # Averaging block outputs instead of reweighting them by their normalisers must be caught by the very
    # comparison the real runs pass.
    cp, results = cp_run
    got, want = _gathered(results, "ring_no_lse/4", cp), _reference(4)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got["out"], want["out"], **TOL)
    assert (got["out"] - want["out"]).abs().max() > 1e-2


def test_ring_blocks_balanced_and_masked_blocks_skipped(cp_run):
    cp, results = cp_run
    for kv_heads in KV_HEADS:
        blocks = [r[f"ring/{kv_heads}"]["forward_blocks"] for r in results]
        # Every rank computes the same causal work: its two diagonal blocks, its own tail against its head,
        # and two blocks per other rank's keys.
        assert max(blocks) - min(blocks) <= 1 and blocks == [2 * cp + 1] * cp
        # Each rank sees 2 query chunks × 2·cp key chunks; the fully masked ones were skipped ...
        assert all(b < 4 * cp for b in blocks)
        assert [r[f"ring/{kv_heads}"]["skipped_blocks"] for r in results] == [2 * cp - 1] * cp
        # ... and together the ranks computed exactly the causal triangle of (2·cp)² chunk blocks, nothing twice.
        assert sum(blocks) == (2 * cp) * (2 * cp + 1) // 2
        assert [r[f"ring/{kv_heads}"]["backward_blocks"] for r in results] == blocks
    assert [r["ring_noncausal/4"]["forward_blocks"] for r in results] == [4 * cp] * cp


def test_ring_traffic_matches_formula(cp_run):
    # Per rank, one message of k and v together (2·|k_local| bytes) per hop: cp − 1 hops forward; backward
    # cp − 1 hops of k, v again plus cp hops of their gradients (the last one brings them home). On gloo each
    # hop is a send (payload + 2 preambles) and a receive (1 preamble) — comm_stats.wire_bytes.
    cp, results = cp_run
    for kv_heads in KV_HEADS:
        kv_bytes = BATCH * kv_heads * (SEQ // cp) * HEAD_DIM * 4
        hop = 2 * kv_bytes + GLOO_SEND_OVERHEAD + GLOO_RECV_OVERHEAD
        for r in results:
            res = r[f"ring/{kv_heads}"]
            assert res["kinds"] == [CP_RING_P2P]
            assert res["forward_bytes"] == (cp - 1) * hop > 0
            assert res["bytes"] == (3 * cp - 2) * hop
            assert res["bytes"] - (3 * cp - 2) * (GLOO_SEND_OVERHEAD + GLOO_RECV_OVERHEAD) == ring_payload_bytes(kv_bytes, cp)
            assert res["calls"] == 2 * (3 * cp - 2)  # a send and a receive per hop


def test_ulysses_traffic_matches_formula(cp_run):
    # Four equal all-to-alls forward (q, k, v, output) and four backward (their gradients); each keeps 1/cp of
    # its buffer home and sends the rest in cp − 1 messages (2 preambles sent, 1 received per message).
    cp, results = cp_run
    overhead = (cp - 1) * (GLOO_SEND_OVERHEAD + GLOO_RECV_OVERHEAD)
    for kv_heads in KV_HEADS:
        q_bytes = BATCH * HEADS * (SEQ // cp) * HEAD_DIM * 4
        kv_bytes = BATCH * max(kv_heads, cp) * (SEQ // cp) * HEAD_DIM * 4  # repeated up to cp heads if fewer
        forward = sum(2 * (p - p // cp + overhead) for p in (q_bytes, kv_bytes))
        for r in results:
            res = r[f"ulysses/{kv_heads}"]
            assert res["kinds"] == [CP_ALL_TO_ALL]
            assert (res["forward_bytes"], res["forward_calls"]) == (forward, 4)
            assert (res["bytes"], res["calls"]) == (2 * forward, 8)


# ------------------------------------------------------------------------------------- no process group
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_shard_unshard_positions_round_trip(cp):
    x = torch.arange(2 * 16 * 3).view(2, 16, 3)
    parts = [load_balanced_shard(x, cp, r, dim=1) for r in range(cp)]
    assert torch.equal(load_balanced_unshard(parts, cp, dim=1), x)
    positions = [load_balanced_positions(16, cp, r) for r in range(cp)]
    for r in range(cp):
        assert torch.equal(parts[r], x[:, positions[r]])  # the positions are the tokens' places in the sequence
    assert sorted(torch.cat(positions).tolist()) == list(range(16))
    if cp == 2:
        assert positions[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
        assert positions[1].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    # the same along another dimension (the (batch, heads, seq, head_dim) layout of attention)
    y = torch.randn(1, 2, 16, 4)
    assert torch.equal(load_balanced_unshard([load_balanced_shard(y, cp, r, dim=2) for r in range(cp)], cp, dim=2), y)


def test_config_errors():
    with pytest.raises(ConfigError, match=r"data.seq_len=100 must divide by 2·cp = 8"):
        load_balanced_positions(100, 4, 0)
    with pytest.raises(ConfigError, match=r"data.seq_len=12 must divide by 2·cp = 8"):
        load_balanced_shard(torch.zeros(1, 12), 4, 0)
    with pytest.raises(ConfigError, match=r"model heads=6 must divide by cp=4"):
        check_ulysses_heads(6, 6, 4)
    with pytest.raises(ConfigError, match=r"key/value heads=3 must divide by cp=2"):
        check_ulysses_heads(6, 3, 2)
    with pytest.raises(ConfigError, match=r"heads=8 must be a multiple of the key/value heads=3"):
        check_ulysses_heads(8, 3, 2)
    check_ulysses_heads(8, 2, 4)  # fewer kv heads than cp, dividing it: repeated
    check_ulysses_heads(8, 4, 2)
    with pytest.raises(ValueError, match="rank 2 is not in the cp group"):
        load_balanced_positions(16, 2, 2)
