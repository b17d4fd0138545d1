"""A DLRM-style click-through-rate model: one embedding per categorical feature, pairwise dot-product
interactions between the fields' embeddings, and a small MLP on top (Naumov et al., 2019).

Single-device code. All fields share one ``nn.EmbeddingBag`` over one hashed id space (each field owns
a slice of it): under ``strategy=ps`` that one module is the table the servers hold (see
``parallelize.py``). The table is initialised with :func:`parallelkit.ps.table.init_rows`, the same
counter-based initializer the servers use, so a single process and a parameter-server job start from
the same rows. A table too large to hold densely is built on the ``meta`` device: it has no memory, and
only a strategy that replaces it (``strategy=ps``) can run it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from parallelkit.errors import ConfigError
from parallelkit.ps.table import init_rows

TABLE = "embedding"  # the module path of the sparse table (parallelize.py names it)


class CTRModel(nn.Module):
    """``ids (batch, fields) → click logit (batch,)``, trained with binary cross-entropy.

    Args:
        num_fields / num_rows: taken from the data module (fields per sample, size of the id space).
        embedding_dim: width of each feature's embedding.
        hidden: widths of the top MLP.
        init_scale: embedding rows start uniform in ``[-init_scale, init_scale)``.
        embedding_seed: seed of the row initializer (the servers use the same).
        sparse: sparse gradients for the dense table (``torch.optim.SGD``/``Adagrad`` update touched rows only).
        max_dense_bytes: above this size the dense table is built on the ``meta`` device (no memory).

    Example::

        model = CTRModel(num_fields=8, num_rows=8 * 10**5, embedding_dim=16)
        loss = model.loss(model(ids), labels)
    """

    def __init__(
        self,
        num_fields: int = 8,
        num_rows: int = 800000,
        embedding_dim: int = 16,
        hidden: list[int] | tuple[int, ...] = (64, 32),
        init_scale: float = 0.05,
        embedding_seed: int = 0,
        sparse: bool = True,
        max_dense_bytes: int = 2**30,
    ) -> None:
        super().__init__()
        for name, value in (
            ("num_fields", num_fields),
            ("num_rows", num_rows),
            ("embedding_dim", embedding_dim),
            *((f"hidden[{i}]", h) for i, h in enumerate(hidden)),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model.{name} should be an int greater than 0. Got {value!r}.")
        self.num_fields = num_fields
        self.num_rows = num_rows
        self.embedding_dim = embedding_dim
        self.init_scale = float(init_scale)
        self.embedding_seed = int(embedding_seed)
        dense = num_rows * embedding_dim * 4 <= max_dense_bytes
        self.embedding = nn.EmbeddingBag(num_rows, embedding_dim, mode="sum", sparse=sparse, device=None if dense else "meta")
        if dense:
            with torch.no_grad():  # in chunks: the initializer's temporaries are ~10x the rows it makes
                for start in range(0, num_rows, 1 << 16):
                    ids = torch.arange(start, min(start + (1 << 16), num_rows))
                    self.embedding.weight[start : start + len(ids)] = init_rows(self.embedding_seed, TABLE, ids, embedding_dim, self.init_scale)
        pairs = num_fields * (num_fields - 1) // 2
        widths = [num_fields * embedding_dim + pairs, *hidden, 1]
        self.mlp = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        rows, cols = torch.triu_indices(num_fields, num_fields, offset=1)
        self.register_buffer("_pair_rows", rows, persistent=False)
        self.register_buffer("_pair_cols", cols, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        batch, fields = ids.shape
        if fields != self.num_fields:
            raise ValueError(f"expected {self.num_fields} fields per sample, got {fields}")
        if getattr(self.embedding, "weight", None) is not None and self.embedding.weight.is_meta:
            raise ConfigError(
                f"the embedding table ({self.num_rows:,} rows × {self.embedding_dim}) is too large to hold densely "
                "(model.max_dense_bytes); train it with strategy=ps, or use a smaller data.rows_per_field."
            )
        emb = self.embedding(ids.reshape(-1, 1)).view(batch, fields, self.embedding_dim)  # one-id bags
        inter = torch.bmm(emb, emb.transpose(1, 2))[:, self._pair_rows, self._pair_cols]
        x = torch.cat([emb.flatten(1), inter], dim=1)
        for i, layer in enumerate(self.mlp):
            x = layer(x)
            if i < len(self.mlp) - 1:
                x = F.relu(x)
        # (batch, 1) → (batch,) as a new tensor, not a view (squeeze): FSDP2 warns once per rank about a sharded
        # module returning a view (an in-place op on it would skip its backward hook). A sum over one element is exact.
        return x.sum(dim=1)

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(logits, labels)

    # ------------------------------------------------------------------ validation quality, for summary.json
    @torch.no_grad()
    def summary_metrics(self, trainer: Any) -> dict[str, Any]:
        """AUC and log loss of the final model on the whole validation set (all data-parallel ranks)."""
        from parallelkit.data.ctr import log_loss, roc_auc

        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is None or getattr(datamodule, "val_set", None) is None:
            return {}
        was_training = self.training
        self.eval()
        logits, labels = [], []
        device = next((p.device for p in self.parameters() if not p.is_meta), torch.device("cpu"))
        for ids, y in datamodule.val_dataloader():
            logits.append(self(ids.to(device)).float().cpu())
            labels.append(y.float())
        self.train(was_training)
        local = torch.stack([torch.cat(logits), torch.cat(labels)]) if logits else torch.empty(2, 0)
        gathered = trainer.strategy.all_gather(local.to(device)).cpu()
        if gathered.dim() == 3:  # (ranks, 2, n) → (2, ranks·n)
            gathered = gathered.permute(1, 0, 2).reshape(2, -1)
        scores, y = gathered[0], gathered[1]
        quality = {"val_auc": roc_auc(scores, y), "val_log_loss": log_loss(torch.sigmoid(scores), y), "val_samples": int(y.numel())}
        # The data module knows the ceiling (the ground truth's AUC on the same samples): report them side by side.
        if callable(getattr(datamodule, "summary_metrics", None)):
            quality.update(datamodule.summary_metrics(trainer))
        return quality
