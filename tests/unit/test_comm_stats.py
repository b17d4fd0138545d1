"""``CommStats`` without a process group: phases, per-backend algorithms, the shapes of gloo's algorithms.

What gloo really writes is checked against the kernel's byte count on real ranks in
tests/distributed/test_comm_stats.py; here, the bookkeeping and the NCCL (ring) figures, which no machine
here can measure.
"""

from __future__ import annotations

import pytest
import torch

from parallelkit.distributed.comm_stats import (
    GLOO_PREAMBLE,
    REPORT,
    TRAIN,
    VALIDATION,
    CommStats,
    sent_bytes,
    wire_bytes,
)

S = 1 << 20


def test_phases_keep_validation_and_reporting_out_of_the_training_figure():
    stats = CommStats()
    stats.record("grad", torch.zeros(256), "all_reduce", 2)
    with stats.counting_as(VALIDATION):
        stats.record("val", torch.zeros(1024), "all_reduce", 2)
        with stats.counting_as(REPORT):
            stats.record("summary", 40)
        assert stats.phase == VALIDATION
    assert stats.phase == TRAIN
    assert stats.bytes() == 1024 and stats.per_step(2)["bytes_sent_per_step"] == 512
    assert set(stats.per_step(1)["by_kind"]) == {"grad"}
    assert stats.bytes(phase=VALIDATION) == 4096 and stats.bytes(phase=REPORT) == 40
    with pytest.raises(ValueError, match="unknown phase"), stats.counting_as("eval"):
        pass


@pytest.mark.parametrize("n", [2, 4, 8])
def test_nccl_is_counted_at_the_ring_figures(n):
    assert wire_bytes("all_reduce", S, n, backend="nccl") == pytest.approx(2 * (n - 1) / n * S, abs=1)
    assert wire_bytes("reduce_scatter", S, n, backend="nccl") == pytest.approx((n - 1) / n * S, abs=1)
    assert wire_bytes("all_gather", S, n, backend="nccl") == (n - 1) * S
    # a ring broadcast: every rank forwards the buffer but the one before the root; a reduce: all but the root
    assert [wire_bytes("broadcast", S, n, r, "nccl", root=1) for r in range(n)] == [0 if r == 0 else S for r in range(n)]
    assert [wire_bytes("reduce", S, n, r, "nccl", root=1) for r in range(n)] == [0 if r == 1 else S for r in range(n)]
    assert sent_bytes("reduce_scatter", S, n) == pytest.approx((n - 1) / n * S)


def test_gloo_reduce_scatter_is_an_allreduce_and_headers_are_counted():
    ring = wire_bytes("all_reduce", S, 2, backend="gloo")
    assert wire_bytes("reduce_scatter", S, 2, backend="gloo") == ring
    # 2 ranks, 4 segments: 4 sends (2 headers each) and 4 receives (1 each) around S of payload
    assert ring == S + 12 * GLOO_PREAMBLE
    assert wire_bytes("all_to_all", S, 2, backend="gloo") == S // 2 + 3 * GLOO_PREAMBLE
    # a 4-byte all-reduce: one segment in range of 2n, so a rank sends it once (and headers dominate) ...
    assert [wire_bytes("all_reduce", 4, 2, r, "gloo") for r in range(2)] == [4 + 3 * GLOO_PREAMBLE] * 2
    # ... and on 4 ranks the segment's ring passes only some of them
    assert len({wire_bytes("all_reduce", 4, 4, r, "gloo") for r in range(4)}) > 1


def test_gloo_broadcast_is_a_binomial_tree():
    sends = [wire_bytes("broadcast", S, 8, r, "gloo", root=3) // S for r in range(8)]
    # virtual ranks from the root: 0 sends 3 copies, 1 sends 2, 2 and 3 send 1, 4-7 are leaves
    by_virtual = [sends[(v + 3) % 8] for v in range(8)]
    assert by_virtual == [3, 2, 1, 1, 0, 0, 0, 0]


def test_an_int_group_is_theory_without_a_process_group():
    stats = CommStats()
    assert stats.record("x", S, "all_gather", 4) == 3 * S
    with pytest.raises(ValueError, match="unknown collective"):
        stats.record("x", S, "scan", 4)
