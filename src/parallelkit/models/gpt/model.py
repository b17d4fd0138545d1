"""A small GPT (decoder-only transformer), single-device code in the spirit of nanoGPT.

Parallel plans (tensor-parallel layouts, pipeline split points) live in ``parallelize.py`` beside this
file, never in ``forward``. The token embedding and the output head are separate matrices by default;
``tie_embeddings=True`` makes them one (``lm_head.weight is tok_emb.weight``, as nanoGPT and GPT-2 do). A tied
model still splits: tensor parallelism shards the one weight over the vocabulary once, for both uses; pipeline
parallelism keeps a copy on the first stage (embedding) and one on the last (head), and
:mod:`parallelkit.distributed.tied_weights` sums their gradients after each backward so both stay equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 128
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        # Separate q/k/v projections (not one fused qkv matrix): tensor parallelism shards each by heads.
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.out_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_head / tp of them.
        q, k, v = (proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.down_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.gelu(self.up_proj(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer language model.

    Args:
        vocab_size: number of token ids (taken from the data module).
        block_size: maximum sequence length (taken from the data module).
        n_layer / n_head / n_embd: depth, attention heads, width (``n_embd`` divisible by ``n_head``).
        dropout: dropout probability (0 keeps every strategy bit-comparable).
        bias: use biases in linear layers and LayerNorms.
        tie_embeddings: the output head reuses the token embedding's weight (one ``Parameter`` under both
            ``tok_emb.weight`` and ``lm_head.weight``; ``vocab_size × n_embd`` fewer parameters). Off by default.

    Example::

        model = GPT(vocab_size=128, block_size=64, n_layer=2)
        logits = model(idx)                      # (batch, seq, vocab)
        loss = model.loss(logits, targets)
    """

    def __init__(
        self,
        vocab_size: int = 128,
        block_size: int = 64,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
        tie_embeddings: bool = False,
    ) -> None:
        super().__init__()
        from parallelkit.errors import ConfigError

        for name, value in (("vocab_size", vocab_size), ("block_size", block_size), ("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"model.{name} should be an int greater than 0. Got {value!r}.")
        if n_embd % n_head:
            raise ConfigError(f"model.n_embd={n_embd} must be divisible by model.n_head={n_head} (each head gets n_embd / n_head channels).")
        if not isinstance(tie_embeddings, bool):
            raise ConfigError(f"model.tie_embeddings should be true or false. Got {tie_embeddings!r}.")
        self.config = cfg = GPTConfig(vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias)
        self.tie_embeddings = tie_embeddings
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        # A ModuleDict keyed by layer index keeps parameter names stable when a pipeline stage keeps a subset.
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        if tie_embeddings:
            # After the init, so every other weight draws the same numbers as in an untied model; the tied weight
            # is the embedding's (both had the same N(0, 0.02) init).
            self.lm_head.weight = self.tok_emb.weight
        # GPT-2's scaled init of residual projections keeps the residual stream's variance flat with depth.
        for name, param in self.named_parameters():
            if name.endswith(("out_proj.weight", "down_proj.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ValueError(f"sequence length {seq} exceeds block_size {self.config.block_size}")
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.layers.values():
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over all positions."""
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
