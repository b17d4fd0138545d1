"""Parallel plans for :mod:`parallelkit.models.ctr`: which tables the parameter servers hold.

``strategy=ps`` calls :func:`parameter_server_tables` and swaps each named ``nn.EmbeddingBag`` for a
:class:`~parallelkit.ps.embedding.ShardedEmbedding` with the same initializer; everything else (the
MLP) stays on the workers and is averaged by all-reduce. Other strategies train the dense table.
"""

from __future__ import annotations

from parallelkit.models.ctr.model import TABLE, CTRModel
from parallelkit.ps.table import TableSpec


def parameter_server_tables(model: CTRModel, optimizer: dict) -> dict[str, TableSpec]:
    """Module path → table spec; ``optimizer`` is the per-row optimizer (kind and hyperparameters)."""
    spec = TableSpec(name=TABLE, dim=model.embedding_dim, seed=model.embedding_seed, init_scale=model.init_scale, **optimizer)
    return {TABLE: spec}
