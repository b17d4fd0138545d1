"""Gradient synchronisation's communication per step: data parallelism, sharding (ZeRO / FSDP2) and the sums
outside them.

- **data parallel** gradient all-reduce once per step (in 25 MiB buckets) over ``dp × cp`` (cp ranks hold the same
  parameters and saw other tokens).
- **sharding** (ZeRO-3 / FSDP2, over ``sharding × cp``): all-gathers per micro-step (forward, and backward again when
  resharding after forward, but the root unit once) and reduce-scatters (per micro-step without a pipeline, once after
  the last micro-batch with one), one collective per unit (each block and the rest of the model); HSDP's all-reduce of
  the shards over ``dp``. Across nodes a group's ring gets the network share of its members on each node
  (:func:`~parallelkit.planner.layout.members_per_node`; FSDP over every GPU of 8 nodes: 8 GPUs' share).
- **FSDP2's copy-out**: each all-gather's flat buffer is split into the unit's parameters on the compute stream
  (``foreach_all_gather_copy_out``), a memory-bound copy of the gathered weights (:func:`fsdp_copy_out_time`).
- **once per step**, after the last backward: sequence parallel's partial gradients (norms, row-parallel biases) over
  tp; tied embeddings' gradient between the first and the last pipeline stage (Megatron's embedding group).

Overlap with compute is :class:`~parallelkit.planner.cost_model.CostModel`'s (the runtime's).
"""

from __future__ import annotations

import math

from parallelkit.distributed.parallel_dims import DP, PP, SHARDING, TP
from parallelkit.planner.hardware import Hardware
from parallelkit.planner.layout import Layout, Stages
from parallelkit.planner.memory import RankMemory
from parallelkit.planner.workload import Workload

BUCKET_BYTES = 25 * 2**20  # parallelkit's GradAllReduce buckets (grad_sync.DEFAULT_BUCKET_MB)


def data_parallel_time(w: Workload, hw: Hardware, layout: Layout, mem: RankMemory, cross: dict[str, bool],
                   per_node: dict[str, int]) -> tuple[float, float, dict[str, float]]:
    """Seconds of one rank's dp and sharding collectives per step (before overlap), and the bytes it sends."""
    p = w.precision
    # cp ranks hold the same parameters: FSDP2 shards over sharding × cp, the all-reduce spans dp × cp.
    dp, s, z = layout.replica_group, layout.shard_group, layout.zero_stage if layout.sharding > 1 else 0
    dense, experts = mem.param_elements - mem.expert_elements, mem.expert_elements
    sent = {DP: 0.0, SHARDING: 0.0}
    dp_time = sh_time = 0.0
    if s > 1:
        # FSDP reduce-scatters every backward without a pipeline (ZeRO-1 once per step); a pipeline once.
        reductions = layout.micro_steps if (layout.pp == 1 and z >= 2) else 1
        # ZeRO-3 with reshard gathers each block in forward and again in backward, the root (embeddings, head)
        # once: it stays gathered from forward into backward (FSDP2's root default).
        gathers = gathers_per_step(layout, mem)
        grads, params = dense * p.grad, dense * p.param
        # ZeRO-3 (FSDP2) gathers and reduces unit by unit (each block, then the rest): one collective per unit;
        # ZeRO-1/2 reduce and gather the whole flat buffer.
        units = max(1, round(mem.units)) if z >= 3 else 1
        sh_time = reductions * units * hw.collective_time("reduce_scatter", grads / units, s, cross[SHARDING], per_node[SHARDING])
        sh_time += gathers * units * hw.collective_time("all_gather", params / units, s, cross[SHARDING], per_node[SHARDING])
        sent[SHARDING] = (reductions * grads + gathers * params) * (s - 1) / s
        if dp > 1:  # HSDP: replicas all-reduce their shard, unit by unit
            dp_time = reductions * units * hw.collective_time("all_reduce", grads / s / units, dp, cross[DP], per_node[DP])
            sent[DP] = reductions * 2 * grads / s * (dp - 1) / dp
    elif dp > 1:
        grads = dense * p.grad
        buckets = max(1, math.ceil(grads / BUCKET_BYTES))
        dp_time = buckets * hw.collective_time("all_reduce", grads / buckets, dp, cross[DP], per_node[DP])
        sent[DP] = 2 * grads * (dp - 1) / dp
    if experts and layout.dp * layout.sharding * layout.cp > layout.ep:  # expert gradients: the ranks holding the same experts
        g = layout.dp * layout.sharding * layout.cp // layout.ep
        dp_time += hw.collective_time("all_reduce", experts * p.grad, g, cross[DP])
        sent[DP] += 2 * experts * p.grad * (g - 1) / g
    return dp_time, sh_time, sent

def finalize_grads_time(w: Workload, hw: Hardware, layout: Layout, stages: Stages, i: int,
                    cross: dict[str, bool]) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds and bytes of representative rank ``i``'s once-per-step gradient sums outside data parallelism."""
    shape, grad = w.shape, w.precision.grad
    times, sent = dict.fromkeys((TP, PP), 0.0), dict.fromkeys((TP, PP), 0.0)
    tp = layout.tp
    # Both run on the gradients in their parameters' layout: a rank's shard once ZeRO ≥ 2 has reduce-scattered.
    shards = layout.shard_group if layout.sharding > 1 and layout.zero_stage >= 2 else 1
    if layout.sequence_parallel:
        # Parameters tensor parallelism leaves whole (norms, row-parallel biases) see only this rank's sequence
        # shard: their gradients are partial sums, added over tp in one fused all-reduce per step.
        n_moe = sum(1 for layer in stages.layers[i] if shape.is_moe(layer)) if shape.moe_layer_ids else 0
        whole = (len(stages.layers[i]) - n_moe) * shape.dense_layer_replicated + n_moe * shape.moe_layer_replicated
        whole += shape.last_extra if stages.last[i] else 0
        whole /= shards
        times[TP] = hw.collective_time("all_reduce", whole * grad, tp, cross[TP])
        sent[TP] = 2 * whole * grad * (tp - 1) / tp
    if shape.tied and layout.pp > 1 and stages.first[i] != stages.last[i]:
        # Tied embeddings under a pipeline: the first stage's embedding and the last stage's copy (memory.py) sum
        # their gradients once per step — Megatron's embedding group, two ranks of the pp group. (Under tp alone
        # nothing extra: one vocabulary-split weight serves the lookup and the output layer on the same rank.)
        embedding = shape.embed_params / tp / shards * grad
        times[PP] = hw.collective_time("all_reduce", embedding, 2, cross[PP])
        sent[PP] = embedding  # ring all-reduce over two ranks: 2·(2 − 1)/2 = 1× the buffer
    return times, sent


def gathers_per_step(layout: Layout, mem: RankMemory) -> float:
    """How many times a step all-gathers the rank's dense parameters (ZeRO-3 with reshard gathers each block in forward
    and again in backward, the root — embeddings, head — once: it stays gathered from forward into backward, FSDP2's
    root default; per micro-step without a pipeline; once per step otherwise)."""
    z = layout.zero_stage if layout.sharding > 1 else 0
    dense = mem.param_elements - mem.expert_elements
    twice = layout.reshard_after_forward and layout.pp == 1 and z >= 3
    return (2 - mem.root_elements / dense if twice and dense else 1) * (layout.micro_steps if (layout.pp == 1 and z >= 3) else 1)


def fsdp_copy_out_time(w: Workload, hw: Hardware, layout: Layout, mem: RankMemory) -> float:
    """Seconds of FSDP2's all-gather copy-out on the compute stream: after each all-gather the gathered flat buffer is
    split into the unsharded parameters (``foreach_all_gather_copy_out``: ``split_with_sizes_copy``), reading and writing
    the unit's bf16 weights — ``2·param`` bytes per parameter and gather (ZeRO-3 only)."""
    if layout.sharding == 1 or layout.zero_stage < 3 or layout.shard_group == 1:
        return 0.0
    dense = mem.param_elements - mem.expert_elements
    gathers = gathers_per_step(layout, mem)
    return hw.memory_time(gathers * 2 * dense * w.precision.param, gathers * max(1, round(mem.units)))
