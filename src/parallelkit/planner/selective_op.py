"""torchtitan's *selective op* activation checkpointing (``recompute=selective_op``), as torchtitan applies it.

Each transformer block runs under ``torch.utils.checkpoint`` with a selective policy
(``torchtitan/parallelisms/parallelize_llama.py``, ``_apply_ac_to_transformer_block`` with
``selective_ac_option="op"``): the outputs of the ops in ``_save_list`` — ``aten.mm``, the fused attention kernels
(``_scaled_dot_product_flash_attention`` / ``_efficient_attention``) and tp's ``reduce_scatter_tensor`` — are saved,
**except every second** ``aten.mm`` (its count per block and pass: the 2nd, 4th, … are recomputed); everything else
(norms, rotary embeddings, the activation function, residual adds, the copies of repeated key/value heads) is
recomputed in backward, as is the input of each recomputed matmul. The block's input is kept (the checkpoint's input).

For a Llama block the forward's matmuls are q, k, v, o, gate (w1), up (w3), down (w2): q, v, gate and down are saved,
k, o and up recomputed (with the memory-bound forward work) — what the planner's ``selective`` is not: that one is
Korthikanti et al.'s (the attention scores of dense attention dropped and recomputed; nothing under fused attention).
Linears with a bias run ``aten.addmm``, not in the list: the planner counts the block's linears as ``mm`` (torchtitan's
Llama has no biases).
"""

from __future__ import annotations

from parallelkit.planner.shapes import ModelShape

FUSED_QKV = ("gpt", "moe_gpt", "hf:gpt2", "hf:bloom")  # one q/k/v projection per block


def block_matmuls(shape: ModelShape, tp: int, moe: bool = False) -> list[tuple[float, float, float]]:
    """``(rows per token, output width, input width)`` of one block's matmuls, per tp rank, in forward order."""
    h, a, kv, d, f = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.ffn
    if shape.family in FUSED_QKV:
        attention = [(1.0, (a + 2 * kv) * d / tp, h)]
    else:
        attention = [(1.0, a * d / tp, h), (1.0, kv * d / tp, h), (1.0, kv * d / tp, h)]
    attention.append((1.0, h, a * d / tp))
    rows, width = (shape.top_k, f) if moe else (1.0, f / tp)
    mlp = ([(rows, width, h), (rows, width, h)] if shape.gated else [(rows, width, h)]) + [(rows, h, width)]
    return attention + mlp


def saved_matmuls(shape: ModelShape, tp: int, moe: bool = False) -> list[tuple[float, float, float]]:
    """The matmuls whose outputs the policy saves: the 1st, 3rd, … of the block."""
    return block_matmuls(shape, tp, moe)[0::2]


def recomputed_matmuls(shape: ModelShape, tp: int, moe: bool = False) -> list[tuple[float, float, float]]:
    """The matmuls backward runs again: the 2nd, 4th, … of the block."""
    return block_matmuls(shape, tp, moe)[1::2]


def saved_bytes_per_token(shape: ModelShape, elem: int, tp: int, moe: bool = False, sequence_parallel: bool = False) -> float:
    """Bytes one block keeps per token under selective op checkpointing: its input (a sequence shard under sequence
    parallelism), the saved matmul outputs, the fused attention's output and its fp32 log-sum-exp."""
    block_input = elem * shape.hidden / (tp if sequence_parallel else 1)
    matmuls = sum(elem * rows * width for rows, width, _ in saved_matmuls(shape, tp, moe))
    attention = elem * shape.heads * shape.head_dim / tp + 4 * shape.heads / tp
    return block_input + matmuls + attention
