"""A next-character model written for one device, as a parallelkit user writes one.

Every position sees its character and the ``context - 1`` before it (a window, like makemore's MLP), and
residual MLP blocks mix them. parallelkit's contract for an ``nn.Module``: ``forward(inputs) -> outputs``
and ``loss(outputs, targets)``; the sizes the data decides (``vocab_size``, ``block_size``) come as
constructor arguments. Nothing here knows about parallelism: the plans are in ``parallelize.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embed(nn.Module):
    """Characters → the window of the last ``context`` embeddings at every position → the model width."""

    def __init__(self, vocab_size: int, dim: int, context: int, width: int) -> None:
        super().__init__()
        self.context = context
        self.tokens = nn.Embedding(vocab_size, dim)
        self.proj = nn.Linear(dim * context, width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        emb = self.tokens(idx)
        window = [F.pad(emb, (0, 0, shift, 0))[:, : idx.shape[1]] for shift in range(self.context)]
        return self.proj(torch.cat(window, dim=-1))


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Head(nn.Module):
    def __init__(self, width: int, vocab_size: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class CharMLP(nn.Module):
    """``vocab_size``/``block_size`` from the data; ``context`` characters per prediction; ``n_blocks`` blocks."""

    def __init__(self, vocab_size: int, block_size: int, dim: int = 16, context: int = 4, width: int = 64,
                 hidden: int = 256, n_blocks: int = 4) -> None:
        super().__init__()
        self.block_size = block_size
        self.embed = Embed(vocab_size, dim, context, width)
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(n_blocks))
        self.head = Head(width, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
