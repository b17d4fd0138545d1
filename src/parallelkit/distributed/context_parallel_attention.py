"""Context parallelism's attention: over a sequence split across the ranks of a ``cp`` process group.

(:mod:`parallelkit.distributed.context_parallel` applies it to a model: ``apply_cp``.)

Every layer but attention works token by token, so a sequence cut into ``cp`` shards needs help only in
attention, where each query looks at every earlier key. Two ways to give it that:

- **Ring attention** (:func:`ring_attention`): the key/value shards travel around the ring of ``cp`` ranks,
  one hop per step, while each rank computes its queries against the block it holds. Block results are
  merged with the log-sum-exp rule (online softmax), so the result is exact and no rank ever holds the whole
  sequence. Backward recomputes each block from the saved per-row log-sum-exp, and the key/value gradients
  travel around the ring behind the keys/values they belong to, arriving home after ``cp`` hops.
- **All-to-all attention** (:func:`ulysses_attention`, DeepSpeed-Ulysses): one all-to-all trades sequence
  shards for head shards, each rank attends over the whole sequence for ``heads / cp`` heads, and a second
  all-to-all trades back. Cheaper in messages, but ``cp`` is bounded by the head count.

**Load-balanced layout.** Under a causal mask, a rank holding the *last* contiguous shard does ``2cp − 1``
times the work of the first one. The sequence is therefore cut into ``2·cp`` chunks and rank ``r`` holds
chunks ``r`` and ``2·cp − 1 − r`` (a head and the mirrored tail): every rank then computes exactly
``2·cp + 1`` (query chunk, key chunk) blocks, the ``cp·(2cp + 1)`` blocks of the causal triangle shared
evenly, and none of the fully masked ones. :func:`load_balanced_shard` / :func:`load_balanced_unshard` /
:func:`load_balanced_positions` implement it; the data (token ids, targets, position ids) must be laid out
the same way before the model sees it.

Traffic is counted under ``cp_ring_p2p`` (ring sends/receives) and ``cp_all_to_all``
(:func:`~parallelkit.distributed.comm_counting.counting`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

from parallelkit.distributed.comm_counting import counting
from parallelkit.distributed.comm_stats import CommStats
from parallelkit.errors import ConfigError

CP_RING_P2P = "cp_ring_p2p"
CP_ALL_TO_ALL = "cp_all_to_all"
# Distinct tags keep the key/value messages and the gradient messages apart: both can be in flight between the
# same two ranks at once in backward.
_KV_TAG, _GRAD_TAG = 11, 12


# ------------------------------------------------------------------------------------------ the layout
def _check_divisible(seq_len: int, cp: int) -> int:
    if cp < 1:
        raise ConfigError(f"cp={cp} should be an int greater than 0.")
    if seq_len % (2 * cp):
        raise ConfigError(f"data.seq_len={seq_len} must divide by 2·cp = {2 * cp}: context parallelism cuts the sequence "
                          f"into 2·cp chunks (a head and a mirrored tail per rank, so causal work is balanced). "
                          f"Pick a sequence length that is a multiple of {2 * cp}, or another cp.")
    return seq_len // (2 * cp)


def load_balanced_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Position ids (in the full sequence) of the tokens rank ``rank`` holds in the load-balanced layout.

    Example::

        load_balanced_positions(8, cp=2, rank=0)     # tensor([0, 1, 6, 7])
    """
    chunk = _check_divisible(seq_len, cp)
    _check_rank(rank, cp)
    tail = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk), torch.arange(tail * chunk, (tail + 1) * chunk)])


def load_balanced_shard(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` (the sequence): chunks ``rank`` and ``2·cp − 1 − rank`` of ``2·cp``.

    Autograd-aware (a concatenation of two slices).

    Example::

        local = load_balanced_shard(tokens, cp=4, rank=1)     # (batch, seq / 4): chunks 1 and 6 of 8
    """
    chunk = _check_divisible(x.shape[dim], cp)
    _check_rank(rank, cp)
    return torch.cat([x.narrow(dim, rank * chunk, chunk), x.narrow(dim, (2 * cp - 1 - rank) * chunk, chunk)], dim=dim)


def load_balanced_unshard(parts: list[torch.Tensor] | tuple[torch.Tensor, ...], cp: int, dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's part (``parts[r]`` from :func:`load_balanced_shard` on rank ``r``).

    Example::

        full = load_balanced_unshard([load_balanced_shard(x, 2, r) for r in range(2)], cp=2)   # == x
    """
    if len(parts) != cp:
        raise ValueError(f"load_balanced_unshard: got {len(parts)} parts for cp={cp}")
    chunks: list[Any] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        if part.shape[dim] % 2:
            raise ValueError(f"load_balanced_unshard: part {rank} has odd length {part.shape[dim]} along dim {dim}")
        chunks[rank], chunks[2 * cp - 1 - rank] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def _check_rank(rank: int, cp: int) -> None:
    if not 0 <= rank < cp:
        raise ValueError(f"rank {rank} is not in the cp group of size {cp}")


def _chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


# --------------------------------------------------------------------------------- shared checks and math
def check_gqa(num_heads: int, num_kv_heads: int) -> int:
    """Query heads per key/value head; :class:`ConfigError` if the key/value heads do not divide the query heads.

    Example::

        check_gqa(8, 2)     # 4
    """
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ConfigError(f"model heads={num_heads} must be a multiple of the key/value heads={num_kv_heads} (grouped-query attention).")
    return num_heads // num_kv_heads


def check_ulysses_heads(num_heads: int, num_kv_heads: int, cp: int) -> None:
    """:class:`ConfigError` unless all-to-all attention can give each of ``cp`` ranks whole heads.

    Query heads must divide by ``cp``; key/value heads too, or (fewer of them than ``cp``) divide ``cp`` so
    that each can be repeated up to ``cp`` heads.

    Example::

        check_ulysses_heads(8, 2, cp=4)     # fine: each key/value head is repeated twice
    """
    check_gqa(num_heads, num_kv_heads)
    if num_heads % cp:
        raise ConfigError(f"model heads={num_heads} must divide by cp={cp} for all-to-all (Ulysses) context parallelism: "
                          f"each rank attends over the whole sequence for heads / cp heads. Use ring attention or a cp that divides {num_heads}.")
    if num_kv_heads % cp and cp % num_kv_heads:
        raise ConfigError(f"model key/value heads={num_kv_heads} must divide by cp={cp}, or divide it, for all-to-all (Ulysses) "
                          f"context parallelism. Use ring attention or another cp.")


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # Query head i uses key/value head i // groups: SDPA's enable_gqa and transformers' repeat_kv agree.
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sum_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`_repeat_kv`: sum each group of repeated heads."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // groups, groups, s, d).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, diagonal: bool) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if diagonal:  # same chunk for queries and keys: the usual lower triangle, diagonal included
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _sequence_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` (batch, heads, seq, dim) stored as (batch, seq, heads, dim), as SDPA returns it: the model's
    ``transpose(1, 2).reshape(batch, seq, -1)`` before its output projection is then a view, not a second copy kept
    for backward."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _flash(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, diagonal: bool,
                   flash: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One (query chunk, key chunk) block: its output normalised over its own keys, and the rows' log-sum-exp.

    On CPU torch's tiled (flash) kernel, whose memory grows with the chunk length, not its square: a ring rank then
    holds no more than one process's SDPA does. Elsewhere the plain matrices (a GPU's flash kernels take other paths)."""
    if _flash(q) if flash is None else flash:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q.contiguous(), k.contiguous(), v.contiguous(), 0.0,
                                                                              diagonal, scale=scale)
        return out, lse
    scores = _scores(q, k, scale, diagonal)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v), lse


def _block_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                    scale: float, diagonal: bool, flash: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's share of dq, dk, dv, given the whole attention's output and row log-sum-exp (``out``, ``lse``): its
    probabilities recomputed with the final normaliser are the block of the full softmax, so the usual attention
    backward applies block by block (softmax's row term ``rowsum(dO ∘ O)`` from the whole output)."""
    if _flash(q) if flash is None else flash:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse.contiguous(), 0.0, diagonal, scale=scale)
    p = torch.exp(_scores(q, k, scale, diagonal) - lse.unsqueeze(-1))
    ds = p * (torch.matmul(do, v.transpose(-1, -2)) - (do * out).sum(-1, keepdim=True))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, torch.matmul(p.transpose(-1, -2), do)


@dataclass
class RingCounts:
    """(query chunk, key chunk) blocks one rank computed and skipped (fully masked) in :func:`ring_attention`.

    Pass one as ``counts=`` and read it after forward (and backward): with the load-balanced layout every
    rank computes ``2·cp + 1`` blocks per pass out of ``4·cp``.

    Example::

        counts = RingCounts()
        ring_attention(q, k, v, group, counts=counts).backward(grad)
        counts.forward_blocks, counts.skipped_blocks     # (2·cp + 1, 2·cp − 1)
    """

    forward_blocks: int = 0
    backward_blocks: int = 0
    skipped_blocks: int = 0


def _block_pairs(rank: int, src: int, cp: int, causal: bool) -> list[tuple[int, int, bool]]:
    """``(query half, key half, diagonal)`` for the blocks rank ``rank`` computes against rank ``src``'s keys.

    Chunk ids give the mask: keys of a later chunk are all masked (skipped), of an earlier chunk all
    visible, of the same chunk causal within it.
    """
    pairs = []
    for qi, q_chunk in enumerate(_chunk_ids(rank, cp)):
        for ki, k_chunk in enumerate(_chunk_ids(src, cp)):
            if not causal or k_chunk < q_chunk:
                pairs.append((qi, ki, False))
            elif k_chunk == q_chunk:
                pairs.append((qi, ki, True))
    return pairs


class _Ring:
    """One ring exchange: send a buffer to the next group rank, receive the same shape from the previous one."""

    def __init__(self, group: Any, stats: CommStats | None) -> None:
        self.group, self.stats = group, stats
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def start(self, buffer: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        received = torch.empty_like(buffer)
        ops = [dist.P2POp(dist.isend, buffer, group=self.group, group_peer=(self.rank + 1) % self.size, tag=tag),
               dist.P2POp(dist.irecv, received, group=self.group, group_peer=(self.rank - 1) % self.size, tag=tag)]
        with counting(self.stats, CP_RING_P2P):
            works = dist.batch_isend_irecv(ops)
        return received, works

    @staticmethod
    def finish(pending: tuple[torch.Tensor, list]) -> torch.Tensor:
        received, works = pending
        for work in works:
            work.wait()
        return received


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, stats, counts, lse_merge):
        ring = _Ring(group, stats)
        groups = q.shape[1] // k.shape[1]
        work_dtype = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        q_halves = q.to(work_dtype).chunk(2, dim=2)
        # k and v travel as one buffer: one message per hop instead of two.
        kv = torch.stack([k, v]).contiguous()
        outs: list[Any] = [None, None]
        lses: list[Any] = [None, None]
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            # Start the next hop before computing on this block: the transfer overlaps the compute.
            pending = ring.start(kv, _KV_TAG) if step < ring.size - 1 else None
            k_halves, v_halves = (t.to(work_dtype).chunk(2, dim=2) for t in kv)
            pairs = _block_pairs(ring.rank, src, ring.size, causal)
            if counts is not None:
                counts.forward_blocks += len(pairs)
                counts.skipped_blocks += 4 - len(pairs)
            for qi, ki, diagonal in pairs:
                out, lse = _block_forward(q_halves[qi], _repeat_kv(k_halves[ki], groups), _repeat_kv(v_halves[ki], groups), scale, diagonal)
                if outs[qi] is None:
                    outs[qi], lses[qi] = out, lse
                elif lse_merge:
                    # Each block's softmax was normalised over its own keys only; reweight both sides by their
                    # share of the combined normaliser exp(lse_total).
                    total = torch.logaddexp(lses[qi], lse)
                    outs[qi] = outs[qi] * torch.exp(lses[qi] - total).unsqueeze(-1) + out * torch.exp(lse - total).unsqueeze(-1)
                    lses[qi] = total
                else:  # the negative control of the tests: blocks averaged, normalisers ignored (wrong)
                    outs[qi] = (outs[qi] + out) / 2
            if pending is not None:
                kv = _Ring.finish(pending)
        out = _sequence_major(torch.cat(outs, dim=2))
        lse = torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.stats, ctx.counts = group, causal, scale, stats, counts
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group, ctx.stats)
        groups = q.shape[1] // k.shape[1]
        work_dtype = out.dtype
        q_halves = q.to(work_dtype).chunk(2, dim=2)
        do = grad_out.to(work_dtype)
        do_halves = do.chunk(2, dim=2)
        lse_halves = lse.chunk(2, dim=2)
        out_halves = out.chunk(2, dim=2)
        dq_halves = [torch.zeros_like(h) for h in q_halves]
        kv = torch.stack([k, v]).contiguous()
        grad_pending = None  # the gradient accumulated so far for the keys/values this rank holds now
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            kv_pending = ring.start(kv, _KV_TAG) if step < ring.size - 1 else None
            k_halves, v_halves = (t.to(work_dtype).chunk(2, dim=2) for t in kv)
            dkv = torch.zeros(kv.shape, dtype=work_dtype, device=kv.device)  # this step's contributions
            pairs = _block_pairs(ring.rank, src, ring.size, ctx.causal)
            if ctx.counts is not None:
                ctx.counts.backward_blocks += len(pairs)
            for qi, ki, diagonal in pairs:
                kr, vr = _repeat_kv(k_halves[ki], groups), _repeat_kv(v_halves[ki], groups)
                dq, dk, dv = _block_backward(do_halves[qi], q_halves[qi], kr, vr, out_halves[qi], lse_halves[qi], ctx.scale, diagonal)
                dq_halves[qi] += dq
                half = slice(ki * kv.shape[3] // 2, (ki + 1) * kv.shape[3] // 2)
                dkv[0, :, :, half] += _sum_kv(dk, groups)
                dkv[1, :, :, half] += _sum_kv(dv, groups)
            if grad_pending is not None:  # received while this step computed: the earlier ranks' contributions
                dkv += _Ring.finish(grad_pending)
            # Pass the gradient on behind its keys/values; after cp hops it is back on the rank that owns them.
            grad_pending = ring.start(dkv, _GRAD_TAG) if ring.size > 1 else (dkv, [])
            if kv_pending is not None:
                kv = _Ring.finish(kv_pending)
        dkv = _Ring.finish(grad_pending)
        dq = torch.cat(dq_halves, dim=2).to(q.dtype)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None


def _check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"expected q (batch, heads, local_seq, head_dim) and k, v (batch, kv_heads, local_seq, head_dim) "
                         f"with the same batch, local_seq and head_dim; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % 2:
        raise ConfigError(f"the local sequence ({q.shape[2]} tokens) must be two chunks of the load-balanced layout: "
                          f"shard with load_balanced_shard (data.seq_len must divide by 2·cp).")
    return check_gqa(q.shape[1], k.shape[1])


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any = None, *, causal: bool = True,
                   scale: float | None = None, stats: CommStats | None = None, counts: RingCounts | None = None,
                   _lse_merge: bool = True) -> torch.Tensor:
    """Exact attention over a sequence split across ``group`` in the load-balanced layout, by ring exchange.

    Args:
        q: this rank's queries, (batch, heads, local_seq, head_dim), in the layout of :func:`load_balanced_shard`.
        k, v: this rank's keys and values, (batch, kv_heads, local_seq, head_dim); ``kv_heads`` divides ``heads``
            (grouped-query attention: they travel un-repeated, and are repeated only for the compute).
        group: the ``cp`` process group (``None``: the default group).
        causal: mask each query from later positions (of the full sequence).
        scale: score scale, ``1 / sqrt(head_dim)`` by default (as SDPA).
        stats: counts the sends/receives under ``cp_ring_p2p``; ``None``: not counted.
        counts: a :class:`RingCounts` the blocks computed/skipped are added to (forward and backward).
        _lse_merge: tests only: ``False`` merges blocks by plain averaging (deliberately wrong).

    Returns:
        This rank's attention output, like ``q`` (the same layout).

    Traffic per rank (forward + backward): keys and values (one buffer of ``2·|k|`` bytes) hop ``cp − 1`` times
    in forward and again in backward, and their gradients (``2·|k|``) ``cp`` times: ``(3·cp − 2)`` messages of
    ``2·|k|`` bytes (:func:`ring_payload_bytes`).

    Example::

        q_local = load_balanced_shard(q, cp, rank, dim=2)          # likewise k, v
        out = ring_attention(q_local, k_local, v_local, cp_group)   # == shard of SDPA(q, k, v, is_causal=True)
    """
    _check_attention_inputs(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, group, causal, scale, stats, counts, _lse_merge)


def ring_payload_bytes(kv_bytes: int, cp: int, backward: bool = True, grad_kv_bytes: int | None = None) -> int:
    """Payload bytes one rank sends in :func:`ring_attention` (``kv_bytes``: its local ``k`` in bytes; ``v`` the same).

    Forward: ``(cp − 1)`` hops of ``k`` and ``v``; backward: ``(cp − 1)`` again plus ``cp`` hops of their gradients,
    which travel in fp32 when the inputs are bf16/fp16 (they are summed over the hops): ``grad_kv_bytes`` is then
    twice ``kv_bytes`` (default: equal). Transport overheads (gloo's message preambles) are not included: see
    ``comm_stats.wire_bytes``.

    Example::

        ring_payload_bytes(k_local.numel() * k_local.element_size(), cp=4)   # 10 hops × 2·|k|
    """
    if cp == 1:
        return 0
    grad = kv_bytes if grad_kv_bytes is None else grad_kv_bytes
    return 2 * ((cp - 1) * kv_bytes + ((cp - 1) * kv_bytes + cp * grad if backward else 0))


# ---------------------------------------------------------------------------------------- all-to-all
class _AllToAll(torch.autograd.Function):
    """Equal-split ``all_to_all_single`` along dim 0; its gradient is the same exchange (it is its own inverse)."""

    @staticmethod
    def forward(ctx, x, group, stats):
        ctx.group, ctx.stats = group, stats
        return _all_to_all(x, group, stats)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.stats), None, None


def _all_to_all(x: torch.Tensor, group: Any, stats: CommStats | None) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    with counting(stats, CP_ALL_TO_ALL):
        dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, cp: int, group: Any, stats: CommStats | None) -> torch.Tensor:
    """(b, h, local_seq, d), load-balanced sequence shard → (b, h / cp, seq, d), head shard, natural order."""
    b, h, s, d = x.shape
    # Block j of dim 0 goes to rank j: heads [j·h/cp, (j+1)·h/cp).
    received = _AllToAll.apply(x.reshape(b, cp, h // cp, s, d).transpose(0, 1), group, stats)
    return load_balanced_unshard(list(received.unbind(0)), cp, dim=2)


def _heads_to_seq(x: torch.Tensor, cp: int, group: Any, stats: CommStats | None) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`."""
    send = torch.stack([load_balanced_shard(x, cp, r, dim=2) for r in range(cp)])  # block r: rank r's tokens
    received = _AllToAll.apply(send, group, stats)  # block j: head shard j of my tokens
    cp_, b, hl, s, d = received.shape
    return received.permute(1, 3, 0, 2, 4).reshape(b, s, cp_ * hl, d).transpose(1, 2)  # sequence-major, as SDPA's


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any = None, *, causal: bool = True,
                      scale: float | None = None, stats: CommStats | None = None) -> torch.Tensor:
    """Exact attention over a sequence split across ``group``, by trading sequence shards for head shards.

    Args:
        q, k, v: as for :func:`ring_attention` (load-balanced layout; ``heads`` must divide by ``cp``; the
            key/value heads must divide by ``cp``, or divide ``cp`` and are then repeated up to ``cp`` heads).
        group: the ``cp`` process group (``None``: the default group).
        causal: causal mask over the full sequence.
        scale: score scale, ``1 / sqrt(head_dim)`` by default.
        stats: counts the all-to-alls under ``cp_all_to_all`` (four in forward: q, k, v, the output; four in
            backward: their gradients).

    Returns:
        This rank's attention output, like ``q``.

    Example::

        out = ulysses_attention(q_local, k_local, v_local, cp_group)   # heads % cp == 0
    """
    groups = _check_attention_inputs(q, k, v)
    cp = dist.get_world_size(group)
    check_ulysses_heads(q.shape[1], k.shape[1], cp)
    if k.shape[1] < cp:
        # Fewer key/value heads than ranks: repeat each so that every rank receives the one its query heads use.
        k, v = _repeat_kv(k, cp // k.shape[1]), _repeat_kv(v, cp // k.shape[1])
        groups = q.shape[1] // cp
    qh, kh, vh = (_seq_to_heads(t, cp, group, stats) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, _repeat_kv(kh, groups), _repeat_kv(vh, groups), is_causal=causal, scale=scale)
    return _heads_to_seq(out, cp, group, stats)
