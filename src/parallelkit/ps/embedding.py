"""``ShardedEmbedding``: an ``nn.EmbeddingBag`` whose rows live on the parameter servers.

The module holds no parameter. Its forward deduplicates the ids of the batch, fetches those ``U`` rows
through the :class:`~parallelkit.ps.client.PSClient` as a leaf tensor, and runs ``F.embedding_bag``
over them; autograd then leaves, in that leaf's ``.grad``, exactly the per-unique-id sum that a sparse
``nn.EmbeddingBag`` gradient holds after coalescing. The strategy collects these with
:meth:`ShardedEmbedding.take_gradients` after backward and pushes them.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallelkit.ps.client import PSClient
from parallelkit.ps.table import TableSpec


class ShardedEmbedding(nn.Module):
    """Drop-in for ``nn.EmbeddingBag(num_embeddings, dim, mode=...)`` backed by parameter servers.

    Args:
        spec: the table (name, width, initializer, optimizer) as the servers hold it.
        num_embeddings: the id space (informational: servers store only touched rows).
        mode: ``sum``, ``mean`` or ``max``, as in ``nn.EmbeddingBag``.
        client: the worker's :class:`PSClient` (may be attached later with :meth:`attach`).

    Example::

        emb = ShardedEmbedding(TableSpec("emb", dim=16), num_embeddings=10**7, client=client)
        out = emb(ids)                  # ids (batch, bag) → (batch, 16)
    """

    def __init__(self, spec: TableSpec, num_embeddings: int, mode: str = "mean", client: PSClient | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.num_embeddings = num_embeddings
        self.embedding_dim = spec.dim
        self.mode = mode
        self.client = client
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attach(self, client: PSClient) -> None:
        self.client = client

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if self.client is None:
            raise RuntimeError(f"ShardedEmbedding {self.spec.name!r} has no parameter-server client (strategy=ps attaches one)")
        unique, inverse = torch.unique(input.reshape(-1), sorted=True, return_inverse=True)
        training = self.training and torch.is_grad_enabled()
        rows = self.client.lookup(self.spec.name, unique.cpu(), training=training).to(input.device)
        if training:
            rows.requires_grad_(True)
            self._pending.append((unique.cpu(), rows))
        return F.embedding_bag(inverse.view_as(input), rows, offsets, mode=self.mode, per_sample_weights=per_sample_weights)

    def take_gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed gradient per unique id over this step's forwards (several with accumulation); clears them."""
        pending, self._pending = self._pending, []
        parts = [(ids, rows.grad) for ids, rows in pending if rows.grad is not None]
        if not parts:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, self.spec.dim)
        if len(parts) == 1:
            return parts[0][0], parts[0][1].detach().cpu().float()
        unique, inverse = torch.unique(torch.cat([p[0] for p in parts]), return_inverse=True)
        total = torch.zeros(len(unique), self.spec.dim).index_add_(0, inverse, torch.cat([p[1].detach().cpu().float() for p in parts]))
        return unique, total

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}, table={self.spec.name!r}, optimizer={self.spec.optimizer!r}"


def apply_parameter_server(model: nn.Module, tables: dict[str, TableSpec], client: PSClient | None = None) -> dict[str, ShardedEmbedding]:
    """Replace the ``nn.EmbeddingBag`` submodules named in ``tables`` (module path → spec) by :class:`ShardedEmbedding`.

    Returns the new modules by path. The dense table of the replaced module is dropped (on a server
    rank's or worker's copy of the model alike), so a worker never holds the full table.
    """
    sharded = {}
    for path, spec in tables.items():
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        old = getattr(parent, attr)
        if not isinstance(old, nn.EmbeddingBag):
            raise TypeError(f"{path} is a {type(old).__name__}, not an nn.EmbeddingBag")
        if old.embedding_dim != spec.dim:
            raise ValueError(f"{path}: table width {spec.dim} != module width {old.embedding_dim}")
        new = ShardedEmbedding(spec, old.num_embeddings, mode=old.mode, client=client)
        setattr(parent, attr, new)
        sharded[path] = new
    return sharded
