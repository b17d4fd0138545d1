"""int8 outer gradients of Streaming DiLoCo (``outer_dtype=int8``), no process group: quantize → pack → (all-gather,
simulated by stacking the packed buffers) → unpack → dequantize → mean.

Reference computed here: the fp32 mean of the replicas' outer gradients; each element of the int8 mean must be
within the mean of the replicas' ``scale / 2`` of it (round to nearest, per chunk of ``CHUNK``). Negative controls:
summing the int8 payloads themselves (what an int8 all-reduce would do) wraps around, and a per-tensor scale
loses a small chunk next to an outlier that the per-chunk scale keeps. The exchange on 2 real gloo ranks
(identical result on both ranks, counted = written): tests/distributed/test_diloco_int8.py.
"""

from __future__ import annotations

import pytest
import torch

from parallelkit.distributed.diloco_quantize import (
    CHUNK,
    QMAX,
    dequantize,
    mean_of_gathered,
    num_chunks,
    pack,
    packed_bytes,
    quantize,
    unpack,
)


def _delta(seed: int, numel: int = 3 * CHUNK + 77) -> torch.Tensor:
    """An outer gradient with chunks of very different magnitudes, a zero chunk and an outlier."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen)
    x[:CHUNK] *= 1e-4  # a chunk of tiny deltas (a LayerNorm bias that hardly moved)
    x[CHUNK : 2 * CHUNK] = 0.0  # a chunk that did not move at all
    x[2 * CHUNK + 5] = 40.0  # an outlier
    return x


def _scale_per_element(scale: torch.Tensor, numel: int) -> torch.Tensor:
    return scale.repeat_interleave(CHUNK)[:numel]


def test_round_trip_errs_by_at_most_half_a_scale_per_element():
    x = _delta(0)
    q, scale = quantize(x)
    assert q.dtype == torch.int8 and q.numel() == x.numel()
    assert scale.dtype == torch.float32 and scale.numel() == num_chunks(x.numel()) == 4
    assert int(q.abs().max()) == QMAX  # the absmax element of every non-zero chunk maps to ±127
    assert int(q.min()) >= -QMAX  # -128 is never produced
    back = dequantize(q, scale)
    bound = _scale_per_element(scale, x.numel()) / 2
    assert torch.all((back - x).abs() <= bound * (1 + 1e-6) + 1e-12)
    assert torch.equal(back[CHUNK : 2 * CHUNK], torch.zeros(CHUNK))  # a zero chunk: scale 0, exact zeros
    assert scale[1] == 0
    assert (back - x).abs().max() > 0  # it is a lossy code: the check above is not vacuous


def test_per_chunk_scale_keeps_small_chunks_a_per_tensor_scale_loses():
    x = _delta(1)
    per_chunk = dequantize(*quantize(x))
    per_tensor = dequantize(*quantize(x, chunk=x.numel()))  # one scale for the whole tensor (negative control)
    tiny = slice(0, CHUNK)
    assert torch.allclose(per_chunk[tiny], x[tiny], rtol=0, atol=x[tiny].abs().max().item() / QMAX)
    assert torch.equal(per_tensor[tiny], torch.zeros(CHUNK))  # 40 / 127 per step: every 1e-4 delta rounds to 0


def test_pack_and_unpack_are_exact_and_sized_as_the_wire_formula():
    x = _delta(2)
    q, scale = quantize(x)
    buffer = pack(q, scale)
    assert buffer.dtype == torch.int8 and buffer.numel() == packed_bytes(x.numel()) == x.numel() + 4 * 4
    q2, scale2 = unpack(buffer, x.numel())
    assert torch.equal(q2, q) and torch.equal(scale2, scale)
    # a row of a gathered buffer whose scales start at an offset that is not a multiple of 4
    odd = torch.cat([torch.zeros(3, dtype=torch.int8), buffer])[3:]
    assert torch.equal(unpack(odd, x.numel())[1], scale)
    with pytest.raises(ValueError, match="holds"):
        unpack(buffer[:-1], x.numel())


@pytest.mark.parametrize("world", [2, 3])
def test_mean_of_gathered_is_within_half_a_scale_of_the_fp32_mean(world):
    deltas = [_delta(10 + r) * (r + 1) for r in range(world)]
    quantized = [quantize(d) for d in deltas]
    gathered = torch.stack([pack(q, s) for q, s in quantized])  # what the all-gather hands every rank
    mean = mean_of_gathered(gathered, deltas[0].numel())
    reference = torch.stack(deltas).mean(0)
    bound = sum(_scale_per_element(s, d.numel()) for (_, s), d in zip(quantized, deltas)) / (2 * world)
    assert torch.all((mean - reference).abs() <= bound * (1 + 1e-5) + 1e-12)
    assert (mean - reference).abs().max() > 0
    # the same bytes give the same bits (what makes every rank's result identical)
    assert torch.equal(mean_of_gathered(gathered.clone(), deltas[0].numel()), mean)


def test_negative_control_summing_int8_payloads_overflows():
    # two replicas that moved the same way: both quantize to +127 at the absmax; an int8 sum wraps to -2
    a, b = torch.full((8,), 1.0), torch.full((8,), 1.0)
    (qa, sa), (qb, sb) = quantize(a), quantize(b)
    wrapped = qa + qb  # int8 arithmetic, as an int8 all-reduce would add
    assert wrapped.dtype == torch.int8 and int(wrapped[0]) == -2
    assert not torch.allclose(dequantize(wrapped, sa) / 2, (a + b) / 2)
    good = mean_of_gathered(torch.stack([pack(qa, sa), pack(qb, sb)]), 8)
    assert torch.allclose(good, (a + b) / 2, rtol=0, atol=1e-6)


def test_non_finite_deltas_reach_the_average():
    x = torch.ones(2 * CHUNK)
    x[3] = float("nan")
    back = dequantize(*quantize(x))
    assert torch.isnan(back[:CHUNK]).all() and torch.equal(back[CHUNK:], x[CHUNK:])
