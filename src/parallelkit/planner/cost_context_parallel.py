"""Context parallelism's communication per layer (``cp``): ring attention's key/value hops or Ulysses' all-to-alls.

**Ring** (``cp_mode=ring``): each rank runs ``2·cp`` blocks of ``(s/2cp)²`` (``2·cp + 1`` for dense kernels) while the
keys and values, one buffer of ``2·|k_local|`` bytes, hop to the next rank: ``cp − 1`` hops forward, ``cp − 1`` of
them and ``cp`` of their gradients backward — ``(3·cp − 2)·2·|k_local|`` bytes per layer in fp32, the gradients' ``cp``
hops in fp32 also under bf16 (``context_parallel_attention.ring_payload_bytes``). Each hop overlaps one ring step's
block compute; exposed is what exceeds it, and the last gradient hop, which has nothing left to hide behind.
**All-to-all** (Ulysses): the whole sequence on ``heads/cp`` heads between 4 all-to-alls forward (q, k, v, the output)
and 4 backward of ``(cp − 1)/cp`` of each, in line. The attention blocks' compute is
:meth:`~parallelkit.planner.cost_model.CostModel.layer`'s.
"""

from __future__ import annotations

from parallelkit.planner.hardware import Hardware
from parallelkit.planner.workload import Workload


def kv_local_bytes(w: Workload, b: int, tp: int, cp: int) -> float:
    """``|k_local|``: one rank's keys of one layer and micro-batch (its ``s/cp`` tokens, its ``kv_heads/tp`` heads)."""
    return w.precision.activation * b * w.seq_len / cp * w.shape.kv_heads * w.shape.head_dim / tp


def context_parallel_time(w: Workload, hw: Hardware, b: int, tp: int, cp: int, mode: str, cross: bool,
                          core: float) -> tuple[float, float, float, float]:
    """Exposed seconds (forward, backward) and bytes sent (forward, backward) of one layer's context parallelism."""
    if cp == 1:
        return 0.0, 0.0, 0.0, 0.0
    shape = w.shape
    k = kv_local_bytes(w, b, tp, cp)
    if mode == "ring":
        # One buffer of k and v per hop; a hop overlaps one ring step's blocks (core / cp forward, twice that
        # backward). Backward sends the keys/values on and their gradients behind them: two messages per step,
        # and the last gradient hop home after the last block, exposed.
        # The gradients travel in fp32 (summed over the hops), twice a bf16 key's bytes.
        g = k * 4 / w.precision.activation
        hop, hop_g = hw.collective_time("p2p", 2 * k, 2, cross), hw.collective_time("p2p", 2 * g, 2, cross)
        step_f, step_b = core / cp, 2 * core / cp
        exposed_f = (cp - 1) * max(0.0, hop - step_f)
        exposed_b = (cp - 1) * max(0.0, hop + hop_g - step_b) + hop_g
        return exposed_f, exposed_b, (cp - 1) * 2 * k, (cp - 1) * 2 * k + cp * 2 * g
    # Ulysses: q, k, v and the output each through one all-to-all forward, their gradients backward (key/value
    # heads fewer than cp are repeated up to cp first).
    q = k * shape.heads / shape.kv_heads
    kv = k * max(1.0, cp / max(shape.kv_heads / tp, 1))
    tensors = (q, kv, kv, q)
    seconds = sum(hw.collective_time("all_to_all", x, cp, cross) for x in tensors)
    sent = sum(tensors) * (cp - 1) / cp
    return seconds, seconds, sent, sent
