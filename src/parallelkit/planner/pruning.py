"""Pruning: which degree sets and batch cuts the search never costs, and why.

**Degrees** ``dp × sharding × cp × tp × pp (× ep)`` = world, each a :class:`ParallelDims`. They are pruned before
anything is costed (:func:`degree_problem`) for what no strategy can change: tp must divide the sizes the model's
tensor-parallel plan splits (and each rank's ``s/cp`` tokens, under sequence parallelism), pp ≤ its blocks, ep its
experts and ``dp × sharding``, ``dp × sharding`` the global batch, ``2·cp`` the sequence (context parallelism's
load-balanced chunks; all-to-all attention also needs the heads left by tp to divide by cp); for what the model cannot
do (no tensor-parallel plan, no pipeline cut, no sequence parallelism, no context-parallel plan:
:class:`~parallelkit.planner.shapes.ModelShape`); and for tp or ep groups across nodes unless allowed (cp groups may
span nodes: their ring hops overlap block compute, and Llama 3 ran cp 16 over 16 nodes). hybrid4d's own checks confirm the choice before training
(:meth:`parallelkit.strategies.auto.AutoStrategy.resolve`).

**Dominated cuts** are not costed: ``cp > 1`` with a micro-batch ``b`` sharing a factor ``g`` with ``cp`` runs what
moving ``g`` of ``cp`` into data parallelism runs (``sharding × g`` or ``dp × g``: the same ranks and gradient groups)
at micro-batch ``b/g`` — the same tokens per rank, the same GEMM and attention FLOPs, the same memory with fused or
all-to-all attention — with a ring ``g`` times shorter. Context parallelism pays where the sequence is the last thing
left to split. Nor are chunks shorter than :data:`MIN_CP_CHUNK` tokens searched (``cp ≤ s / 256``): a block smaller
than a fused attention kernel's tile of query rows leaves the kernel mostly idle.
"""

from __future__ import annotations

import math

from parallelkit.distributed.parallel_dims import EP, TP
from parallelkit.planner.hardware import Hardware
from parallelkit.planner.layout import Layout, crosses_nodes
from parallelkit.planner.search_options import SearchOptions
from parallelkit.planner.workload import Workload


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


#: Fewest tokens in each of the ``2·cp`` chunks the search considers: flash attention's tiles are 64–128 query rows.
MIN_CP_CHUNK = 128


def context_parallel_degrees(w: Workload, world: int, opts: SearchOptions) -> list[int]:
    """The ``cp`` degrees worth searching: 1, and every divisor of ``world`` with ``2·cp`` dividing the sequence into
    chunks of at least :data:`MIN_CP_CHUNK` tokens (up to ``opts.max_cp``) when the model has a context-parallel plan."""
    if w.shape.cp_refusal or opts.max_cp == 1:
        return [1]
    return [c for c in divisors(world) if w.seq_len % (2 * c) == 0 and (c == 1 or w.seq_len // (2 * c) >= MIN_CP_CHUNK)
            and (opts.max_cp is None or c <= opts.max_cp)]


def dominated_by_less_cp(w: Workload, layout: Layout) -> bool:
    """Whether moving ``g = gcd(micro-batch, cp) > 1`` of ``cp`` into data parallelism runs the same work with a shorter
    ring (module docstring): fused or all-to-all attention (the same memory), an all-to-all the smaller cp allows."""
    g = math.gcd(layout.micro_batch, layout.cp)
    if g == 1 or (w.attention != "flash" and layout.cp_mode != "ulysses"):
        return False
    return layout.cp_mode == "ring" or ulysses_problem(w.shape.heads // layout.tp, max(w.shape.kv_heads // layout.tp, 1), layout.cp // g) is None


def ulysses_problem(heads: int, kv_heads: int, cp: int) -> str | None:
    """Why all-to-all attention cannot split these heads (those one tp rank holds) over ``cp`` ranks (None: it can):
    query heads divide by cp, key/value heads divide by cp or divide it
    (``parallelkit.distributed.context_parallel_attention.check_ulysses_heads``, without torch)."""
    if heads % cp:
        return f"strategy.cp_mode=ulysses: cp={cp} must divide the {heads} attention heads of a tp rank"
    if kv_heads % cp and cp % kv_heads:
        return f"strategy.cp_mode=ulysses: cp={cp} must divide the {kv_heads} key/value heads of a tp rank, or be divided by them"
    return None


def degree_problem(w: Workload, hw: Hardware, layout: Layout, opts: SearchOptions) -> str | None:
    """Why these degrees cannot run (None: they can), in the words of the checks that refuse them: what no strategy
    can change (divisibility, the batch split), what the model cannot do, and groups across nodes unless allowed."""
    shape, tp, pp, ep, cp = w.shape, layout.tp, layout.pp, layout.ep, layout.cp
    dp_size = layout.dp * layout.sharding
    if cp > 1:
        if shape.cp_refusal:
            return f"strategy.cp={cp}: {shape.cp_refusal}"
        if w.seq_len % (2 * cp):
            return f"data.seq_len={w.seq_len} must divide by 2·cp = {2 * cp} (context parallelism's load-balanced chunks)"
        if layout.cp_mode == "ulysses":
            problem = ulysses_problem(shape.heads // tp, max(shape.kv_heads // tp, 1), cp)
            if problem:
                return problem
        if layout.sharding > 1 and layout.zero_stage in (1, 2):
            return f"ZeRO stage {layout.zero_stage} with strategy.cp={cp}: optimizer sharding composes with data parallelism only"
    if tp > 1:
        if shape.tp_plan:
            return shape.tp_plan
        if layout.sequence_parallel and shape.sp_refusal:
            return f"strategy.sequence_parallel=true with model={shape.family}: {shape.sp_refusal}"
        tokens = [(f"data.seq_len / cp ({w.seq_len} / {cp})" if cp > 1 else "data.seq_len (block_size)", w.seq_len // cp)]
        sizes = list(shape.tp_sizes) + (tokens if layout.sequence_parallel else [])
        bad = [f"{name}={value}" for name, value in sizes if value % tp]
        if bad:
            return f"strategy.tp={tp} does not divide " + "; ".join(bad)
        if not opts.allow_tp_across_nodes and crosses_nodes(layout.dims, TP, hw.devices_per_node):
            return f"tp={tp} groups would span nodes of {hw.devices_per_node} ranks (strategy.allow_tp_across_nodes=true allows it)"
    if ep > 1:
        if not shape.experts:
            return f"strategy.ep={ep}: the model has no Mixture-of-Experts layers"
        if shape.experts % ep or dp_size % ep:
            return f"strategy.ep={ep} must divide the {shape.experts} experts and dp × sharding = {dp_size}"
        if opts.norm_clipping:
            return f"strategy.ep={ep} with gradient clipping by norm (each rank holds different experts)"
        if not opts.allow_ep_across_nodes and crosses_nodes(layout.dims, EP, hw.devices_per_node):
            return f"ep={ep} groups would span nodes of {hw.devices_per_node} ranks (strategy.allow_ep_across_nodes=true allows it)"
    if pp > 1:
        if pp > shape.layers:
            return f"The pipeline has {pp} stages but the model has only {shape.layers} blocks to distribute"
        if shape.pp_refusal:
            return shape.pp_refusal
    if w.global_batch is not None and w.global_batch % dp_size:
        return f"data.global_batch_size={w.global_batch} cannot be split evenly over dp × sharding = {dp_size} ranks"
    return None
