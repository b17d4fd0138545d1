"""Bytes one rank holds at its peak: model state, the gathered parameters of ZeRO-3, activations, logits.

**Model state** (the ZeRO paper, Rajbhandari et al. 2020, §5): per parameter this rank keeps, ``param`` +
``grad`` + ``master`` + ``slots × state`` bytes (:class:`~parallelkit.planner.workload.Precision`); ZeRO stage 1
divides the optimizer state and master weights by the sharding degree, stage 2 also the gradients, stage 3 also
the weights. Tensor parallelism divides the layers it splits by ``tp``, expert parallelism the experts by ``ep``,
the pipeline keeps the rank's stages (the first holds the embedding, the last the head; with tied embeddings the
last keeps its own copy of the embedding, as Megatron does).

**Activations per layer and micro-batch** (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", §4): the tensors a layer saves for backward, counted one by one so the published total comes
out for their GPT (16-bit, dropout, dense attention): ``s·b·h·(10 + 24/t + 5·a·s/(h·t))``, and with sequence
parallelism ``s·b·h·(34/t + 5·a·s/(h·t))``. The same count generalises to grouped-query attention (K and V of
``kv_heads``), gated MLPs (two ``ffn``-wide inputs), no dropout (no masks), fp32 activations, and fused
(flash) attention, which keeps the output and its log-sum-exp instead of the ``a·s²`` score matrices.
Recompute: ``selective`` drops the attention-score tensors (what Korthikanti et al. recompute); ``selective_op``
keeps what torchtitan's selective op checkpointing saves (:mod:`~parallelkit.planner.selective_op`: the block's input,
every other matmul's output, the fused attention's output), and one layer's full set once; ``full`` keeps each
layer's input (``2·s·b·h``, ``/t`` with sequence parallelism) for every layer and micro-batch in flight, and the
full set of one layer once — the layer being recomputed.

**Pipeline stage outputs**: a pipeline schedule that calls backward on a chunk's output keeps that output (the
next layer's input: ``2·s·b·h``, ``/t`` with sequence parallelism) for every chunk-micro-batch in flight —
``torch.distributed.pipelining`` (parallelkit's pipeline) holds it in ``fwd_cache`` until the chunk's backward —
unless the runtime frees it once sent (``Runtime.deallocate_stage_outputs``: Megatron-LM's
``deallocate_pipeline_outputs``, Llama 3 §3.3.2). A stage's input is the first block's saved norm input: no extra.

**Context parallelism** (``cp``): each rank holds ``s/cp`` tokens of every sequence, so every activation above —
the layers', the stage outputs, the embedding's output and the logits — is that of ``s/cp`` tokens: ÷ cp. Attention
keeps no score matrix under ring attention (blocks are recomputed from the saved log-sum-exp, as a fused kernel does);
all-to-all (Ulysses) attention runs the model's own attention on ``heads/cp`` heads of the whole sequence: dense
scores ``(s/cp)·s`` per head-row instead of ``s²``. The model state is sharded over ``sharding × cp`` (hybrid4d's
FSDP2 mesh with cp), whole on each rank without sharding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from parallelkit.planner.layout import Layout, Stages
from parallelkit.planner.selective_op import saved_bytes_per_token
from parallelkit.planner.shapes import ModelShape
from parallelkit.planner.workload import Workload


def layer_activation_bytes(w: Workload, micro_batch: int, tp: int, *, moe: bool = False, recompute: str | None = None,
                           sequence_parallel: bool = False, cp: int = 1, cp_mode: str = "ring") -> float:
    """Bytes one layer saves for backward for one micro-batch, on one of ``cp`` ranks (see the module docstring)."""
    shape, s, b = w.shape, w.seq_len / cp, micro_batch  # s: this rank's tokens of each sequence
    recompute = w.recompute if recompute is None else recompute
    e = w.precision.activation
    h, a, d = shape.hidden, shape.heads, shape.head_dim
    if h == 0:
        return 0.0
    sp = sequence_parallel
    if recompute == "selective_op" and (w.attention == "flash" or (cp > 1 and cp_mode == "ring")):
        return s * b * saved_bytes_per_token(shape, w.precision.activation, tp, moe, sp)
    sbh = s * b * h
    mask = 1 if shape.dropout else 0  # dropout masks: one byte per element
    # Stored whole on every tp rank unless sequence parallel splits them: the two norm inputs, the attention and
    # MLP inputs, and the two residual dropout masks.
    replicated = sbh * (2 * e + e + e + 2 * mask)
    replicated /= tp if sp else 1
    q, kv = s * b * a * d, s * b * shape.kv_heads * d
    attention = e * (q + 2 * kv) / tp  # Q, K, V
    if w.attention == "dense" and not (cp > 1 and cp_mode == "ring"):  # ring attention saves only out and lse
        scores = s * w.seq_len * b * a / tp  # Ulysses: heads/cp heads of whole rows; s·s without cp
        attention += scores * (e + mask + (e if mask else 0)) if recompute != "selective" else 0.0  # softmax, mask, dropout out
        attention += e * q / tp  # the context (input of the output projection)
    else:
        attention += e * q / tp + 4 * s * b * a / tp  # flash: output O (= the projection's input) and fp32 log-sum-exp
    ffn = shape.ffn if not moe else shape.ffn * shape.top_k  # MoE: every token's top_k experts each save their MLP input
    mlp = e * s * b * ffn * (2 if shape.gated else 1) / (1 if moe else tp)  # activation-function input(s)
    mlp += e * s * b * ffn / (1 if moe else tp)  # second linear's input
    if moe:
        mlp += e * sbh * shape.top_k  # routed copies of the tokens
    return replicated + attention + mlp


def layer_input_bytes(w: Workload, micro_batch: int, tp: int, sequence_parallel: bool = False, cp: int = 1) -> float:
    """What full recompute keeps per layer and micro-batch: the layer's input (a sequence shard under sequence
    parallelism; ``s/cp`` tokens under context parallelism). Also a pipeline stage's output and the embedding's output:
    the same tensor between layers, at the run's activation precision (2 bytes under bf16/fp16 mixed precision, 4
    under fp32)."""
    return w.precision.activation * w.seq_len / cp * micro_batch * w.shape.hidden / (tp if sequence_parallel else 1)


def logits_bytes(w: Workload, micro_batch: int, tp: int, cp: int = 1) -> float:
    """The head's logits (activation dtype) and the fp32 copy the loss takes and differentiates, vocabulary-split by tp,
    for this rank's ``s/cp`` tokens."""
    return (w.precision.activation + 2 * 4) * w.seq_len / cp * micro_batch * w.shape.vocab / tp


# ------------------------------------------------------------------------------------ parameters of a rank
def rank_param_elements(shape: ModelShape, layout: Layout, layers: list[int], first: bool, last: bool) -> tuple[float, float, float, float]:
    """``(elements this rank holds, of which experts, the largest layer's elements, of which outside the layers)``
    after tp/ep/pp (the last: embeddings, head and the rest, FSDP2's root unit)."""
    tp, ep = layout.tp, layout.ep
    n_moe = sum(1 for layer in layers if shape.is_moe(layer)) if shape.moe_layer_ids else 0
    dense = (shape.dense_layer - shape.dense_layer_replicated) / tp + shape.dense_layer_replicated
    moe = (shape.moe_layer - shape.moe_layer_replicated) / tp + shape.moe_layer_replicated + shape.expert_params / ep
    experts = n_moe * shape.expert_params / ep
    total = (len(layers) - n_moe) * dense + n_moe * moe
    largest = max(dense if len(layers) > n_moe else 0.0, moe if n_moe else 0.0)
    in_layers = total
    if first:
        total += shape.embed_params / tp + shape.first_extra
    if last:
        total += shape.head_params / tp + shape.last_extra
        if shape.tied and layout.pp > 1:  # the output layer's copy of the tied embedding
            total += shape.embed_params / tp
    return total, experts, largest, total - in_layers


@dataclass
class RankMemory:
    """Peak bytes of one pipeline rank, by term."""

    params: float
    grads: float
    master: float
    optimizer: float
    gathered: float
    activations: float
    logits: float
    param_elements: float
    expert_elements: float
    units: float = 1.0  # FSDP units this rank holds: its blocks, and one for the rest of its modules
    root_elements: float = 0.0  # of param_elements, those outside the layers (that one unit: the FSDP2 root)

    @property
    def state(self) -> float:
        return self.params + self.grads + self.master + self.optimizer

    @property
    def total(self) -> float:
        return self.state + self.gathered + self.activations + self.logits

    def as_dict(self) -> dict[str, float]:
        return {"params": self.params, "grads": self.grads, "master": self.master, "optimizer": self.optimizer,
                "state": self.state, "gathered": self.gathered, "activations": self.activations, "logits": self.logits,
                "total": self.total}


def rank_memory(w: Workload, layout: Layout, stages: Stages, i: int) -> RankMemory:
    """The peak of pipeline rank ``stages``' ``i``-th entry (see the module docstring)."""
    shape, p = w.shape, w.precision
    elements, experts, largest, outside = rank_param_elements(shape, layout, stages.layers[i], stages.first[i], stages.last[i])
    s, z = layout.shard_group, layout.zero_stage if layout.sharding > 1 else 0
    dense = elements - experts  # experts are kept out of sharding (averaged over the ranks holding them)
    sharded = {k: dense / (s if z >= stage else 1) + experts for k, stage in (("p", 3), ("g", 2), ("o", 1))}
    params = sharded["p"] * p.param
    grads = sharded["g"] * p.grad
    master = sharded["o"] * p.master
    optimizer = sharded["o"] * w.optimizer_slots * p.state
    gathered = 0.0
    if z >= 3:
        if layout.pp > 1 or not layout.reshard_after_forward:
            # Gathered for the whole step (no reshard between micro-batches), and under a pipeline the gradients are
            # reduce-scattered only after the last micro-batch: the stage's whole weights and gradients.
            gathered = dense * p.param + (dense * p.grad if layout.pp > 1 else largest * p.grad)
        else:  # one unit gathered at a time, the next one prefetched, and its unsharded gradient
            gathered = largest * (2 * p.param + p.grad)
    elif z == 2 and layout.micro_steps > 1:  # gradients accumulate unsharded until the step's reduce-scatter
        gathered = dense * p.grad * (1 - 1 / s)
    b, layers, sp, cp = layout.micro_batch, stages.layers[i], layout.sequence_parallel, layout.cp
    n_moe = sum(1 for layer in layers if shape.is_moe(layer)) if shape.moe_layer_ids else 0
    kinds = [(len(layers) - n_moe, False), (n_moe, True)]
    each = {"sequence_parallel": sp, "cp": cp, "cp_mode": layout.cp_mode}
    between = layer_input_bytes(w, b, layout.tp, sp, cp)  # the tensor between layers
    if w.recompute == "full":
        inputs = stages.in_flight_layers[i] * between
        worst = max((layer_activation_bytes(w, b, layout.tp, moe=moe, recompute="none", **each) for count, moe in kinds if count), default=0.0)
        activations = inputs + worst
    else:
        per_layer = sum(count * layer_activation_bytes(w, b, layout.tp, moe=moe, **each) for count, moe in kinds if count) / max(len(layers), 1)
        activations = stages.in_flight_layers[i] * per_layer
        if w.recompute == "selective_op":  # the layer being recomputed holds its full set while its backward runs
            activations += max((layer_activation_bytes(w, b, layout.tp, moe=moe, recompute="none", **each) for count, moe in kinds if count), default=0.0)
    if layout.pp > 1 and not w.runtime.deallocate_stage_outputs:  # each in-flight chunk's output, for its backward
        activations += stages.in_flight_outputs[i] * between
    if stages.first[i]:  # the embedding's output, kept for every micro-batch in flight
        activations += stages.in_flight_head[i] * between
    logits = stages.in_flight_head[i] * logits_bytes(w, b, layout.tp, cp) if stages.last[i] else 0.0
    units = len(layers) + (1 if stages.first[i] or stages.last[i] else 0)
    return RankMemory(params, grads, master, optimizer, gathered, activations, logits, elements, experts, units, outside)


def korthikanti_per_layer(s: int, b: int, h: int, a: int, t: int, sequence_parallel: bool = False) -> float:
    """Korthikanti et al.'s closed form (16-bit, dropout, dense attention), for checking :func:`layer_activation_bytes`."""
    if sequence_parallel:
        return s * b * h * (34 / t + 5 * a * s / (h * t))
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def describe(memory: RankMemory) -> dict[str, Any]:
    return {k: int(v) for k, v in memory.as_dict().items()}
