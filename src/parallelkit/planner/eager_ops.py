"""Memory-bound work of a Llama block run op by op in eager PyTorch (``Runtime.unfused_elementwise``).

The planner's default counts each memory-bound step once, as fused kernels run it (a norm reads its input and writes
its output). Model code run eagerly, without ``torch.compile`` or fused kernels, moves more: torchtitan's Llama
(``torchtitan/models/llama/model.py`` and its ``RMSNorm``, as of its published A100 performance numbers) computes

- **RMSNorm** as ``(x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).type_as(x) * weight``: a cast to fp32
  (read ``e``, write 4), the square (4 + 4), the mean (4), the scaling (4 + 4), the cast back (4 + ``e``) and the weight
  (``e`` + ``e``) — ``28 + 4e`` bytes per element, against ``2e`` fused;
- **rotary embeddings** through complex fp32 on q and k: ``xq.float()`` (``e`` + 4), the complex product (4 + 4), the
  cast back (4 + ``e``) — ``16 + 2e`` bytes per element of q and k;
- **repeated key/value heads** (``repeat_kv``: ``expand`` then ``reshape``, a copy when ``kv_heads < heads``): k and v
  read at ``kv_heads``, written at ``heads``;
- the attention output's ``transpose(1, 2).contiguous()``: a copy (``2e`` per element);
- **SwiGLU** ``silu(w1(x)) * w3(x)``: the SiLU (``e`` + ``e``) and the product (``2e`` + ``e``) — ``5e`` per element of
  the MLP width; the two residual adds ``3e`` each (as fused).

Backward moves twice the forward's bytes (the planner's convention for memory-bound work).
"""

from __future__ import annotations

from parallelkit.planner.shapes import ModelShape


def eager_block_bytes(shape: ModelShape, e: int, rows: float, tp: int, sequence_parallel: bool, mlp_rows: float,
                      ffn_width: float) -> float:
    """Bytes the forward's memory-bound ops of one block read and write for ``rows`` tokens on one tp rank."""
    h, a, kv, d = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim
    shard = tp if sequence_parallel else 1
    norms = 2 * (28 + 4 * e) * rows * h / shard
    residual = 2 * 3 * e * rows * h / shard
    rotary = (16 + 2 * e) * rows * (a + kv) * d / tp
    repeat = 2 * e * rows * (kv + a) * d / tp if kv < a else 0.0
    contiguous = 2 * e * rows * a * d / tp
    activation = (5 if shape.gated else 2) * e * mlp_rows * ffn_width
    return norms + residual + rotary + repeat + contiguous + activation


#: Kernels of an eager block's memory-bound forward (2 norms × 7, rotary 2 × 3, 2 repeats, 1 copy, 2 activation, 2 adds).
EAGER_KERNELS = 27
