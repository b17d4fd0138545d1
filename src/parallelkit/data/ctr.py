"""Click-through-rate data: many categorical fields of hashed ids with power-law frequencies.

Each sample has ``num_fields`` categorical features. In field ``f`` the feature's popularity rank ``r``
follows a Zipf law (``P(r) ∝ r^-zipf_exponent`` over ``rows_per_field`` values) and its id is a hash
of ``(f, r)`` into the field's slice ``[f·rows_per_field, (f+1)·rows_per_field)`` of one id space, as
production systems hash raw feature values. With ``values_per_field`` set, ranks range over that many
values instead and are placed into the slice without collisions (a seeded affine permutation): the
samples, labels and unique ids per batch are then the same whatever the id space (``rows_per_field``),
which is how the benchmark shows that traffic does not grow with the table. Labels come from a seeded ground truth: a weight per
feature value (plus a bias and one pairwise interaction of fields 0 and 1), ``P(click) = σ(logit)``.
The true probabilities of the validation samples give the Bayes ceiling of AUC and log loss, which the
module reports in ``summary.json`` next to what the model reached.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset
from typing_extensions import override

from parallelkit.data.base import DataParallelDataModule
from parallelkit.errors import ConfigError
from parallelkit.hashing import splitmix64


def _hash_unit(seed: int, *keys: np.ndarray) -> np.ndarray:
    """A deterministic uniform [0, 1) per element from integer keys."""
    x = np.full(np.broadcast(*keys).shape, np.uint64(seed), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for key in keys:
            x = splitmix64(x ^ np.asarray(key).astype(np.int64).view(np.uint64))
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def zipf_ranks(u: np.ndarray, n: int, s: float) -> np.ndarray:
    """Inverse CDF of a continuous power law on ``[1, n+1)``, floored: ranks ``0..n-1``, ``P(r) ≈ ∝ (r+1)^-s``."""
    if abs(s - 1.0) < 1e-9:
        r = np.exp(u * math.log(n + 1))
    else:
        a = 1.0 - s
        r = (1.0 + u * ((n + 1) ** a - 1.0)) ** (1.0 / a)
    return np.clip(np.floor(r).astype(np.int64) - 1, 0, n - 1)


def _injective_offsets(ranks: np.ndarray, rows_per_field: int, seed: int) -> np.ndarray:
    """``(a_f · r + b_f) mod rows_per_field`` per field ``f``, ``a_f`` coprime with it: distinct ranks, distinct ids."""
    out = np.empty_like(ranks)
    for f in range(ranks.shape[1]):
        a = 1 + int(_hash_unit(seed + 5, np.int64(f)) * (rows_per_field - 1))
        while math.gcd(a, rows_per_field) != 1:
            a += 1
        b = int(_hash_unit(seed + 6, np.int64(f)) * rows_per_field)
        out[:, f] = ((ranks[:, f].astype(object) * a + b) % rows_per_field).astype(np.int64)  # Python ints: no overflow
    return out


def make_ctr(
    num_samples: int, num_fields: int, rows_per_field: int, zipf_exponent: float, signal: float, seed: int, values_per_field: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids [N, F] int64, labels [N] float32, true click probabilities [N] float64)``, all from ``seed``.

    ``values_per_field``: distinct feature values per field (default: ``rows_per_field``, hashed with
    collisions); when set, placed into the id space without collisions (see the module docstring).
    """
    rng = np.random.default_rng(seed)
    fields = np.arange(num_fields, dtype=np.int64)[None, :]
    ranks = zipf_ranks(rng.random((num_samples, num_fields)), values_per_field or rows_per_field, zipf_exponent)
    if values_per_field is None:
        # Hash the rank into the field's slice: popular values are spread over the id space, not at 0..k.
        offset = (_hash_unit(seed + 1, fields, ranks) * rows_per_field).astype(np.int64)
    else:
        offset = _injective_offsets(ranks, rows_per_field, seed)
    ids = fields * rows_per_field + offset
    # Ground truth: a N(0, signal²/F) weight per (field, value), a bias, one interaction.
    gauss = np.sqrt(-2 * np.log(1 - _hash_unit(seed + 2, fields, ranks))) * np.cos(2 * np.pi * _hash_unit(seed + 3, fields, ranks))
    logit = -1.0 + signal / math.sqrt(num_fields) * gauss.sum(axis=1)
    if num_fields >= 2:
        logit += signal * 0.5 * (_hash_unit(seed + 4, ranks[:, 0] % 16, ranks[:, 1] % 16) - 0.5)
    prob = 1.0 / (1.0 + np.exp(-logit))
    labels = (rng.random(num_samples) < prob).astype(np.float32)
    return torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(prob)


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney U, ties counted half)."""
    scores, labels = scores.double().flatten(), labels.double().flatten()
    pos, neg = float(labels.sum()), float(len(labels) - labels.sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    s = scores[order]
    ranks = torch.empty_like(s)
    # Average ranks over ties.
    _, inverse, counts = torch.unique_consecutive(s, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    avg = ends - (counts.double() - 1) / 2
    ranks[order] = avg[inverse]
    return float((ranks[labels > 0.5].sum() - pos * (pos + 1) / 2) / (pos * neg))


def log_loss(prob: torch.Tensor, labels: torch.Tensor) -> float:
    p = prob.double().clamp(1e-12, 1 - 1e-12)
    y = labels.double()
    return float(-(y * p.log() + (1 - y) * (1 - p).log()).mean())


class CTRDataModule(DataParallelDataModule):
    """Synthetic CTR data with a known Bayes ceiling.

    Args:
        num_samples: training samples (validation: ``val_samples`` more from the same distribution).
        num_fields: categorical fields per sample.
        rows_per_field: the id space of each field (``10**7`` is fine: ids are hashed, nothing is dense).
        values_per_field: distinct values per field, placed into the id space without collisions (default:
            ``rows_per_field`` values, hashed with collisions). The same value gives the same samples for
            any ``rows_per_field`` at least as large.
        zipf_exponent: the power law of feature popularity (> 0; ~1.1 is typical of ad logs).
        signal: scale of the ground-truth logits (higher: an easier problem, a higher AUC ceiling).
        val_samples: validation samples.

    Example::

        dm = CTRDataModule(num_samples=20000, num_fields=8, rows_per_field=10**7, global_batch_size=256)
    """

    def __init__(
        self,
        num_samples: int = 20000,
        num_fields: int = 8,
        rows_per_field: int = 100000,
        zipf_exponent: float = 1.1,
        signal: float = 2.0,
        val_samples: int = 4096,
        values_per_field: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        for name, value in (("num_samples", num_samples), ("num_fields", num_fields), ("rows_per_field", rows_per_field), ("val_samples", val_samples)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"data.{name} should be an int greater than 0. Got {value!r}.")
        if not zipf_exponent > 0:
            raise ConfigError(f"data.zipf_exponent should be a number greater than 0. Got {zipf_exponent!r}.")
        if values_per_field is not None and (
            not isinstance(values_per_field, int) or isinstance(values_per_field, bool) or not 1 <= values_per_field <= rows_per_field
        ):
            raise ConfigError(f"data.values_per_field should be an int from 1 to data.rows_per_field ({rows_per_field}), or null. Got {values_per_field!r}.")
        if num_fields * rows_per_field >= 2**62:
            raise ConfigError(f"data.num_fields × data.rows_per_field = {num_fields * rows_per_field} does not fit int64 ids.")
        self.num_samples = num_samples
        self.num_fields = num_fields
        self.rows_per_field = rows_per_field
        self.zipf_exponent = zipf_exponent
        self.signal = signal
        self.val_samples = val_samples
        self.values_per_field = values_per_field
        self.bayes: dict[str, float] = {}

    @override
    def build(self) -> None:
        ids, labels, prob = make_ctr(
            self.num_samples + self.val_samples, self.num_fields, self.rows_per_field, self.zipf_exponent, self.signal, self.seed, self.values_per_field
        )
        n = self.num_samples
        self.train_set = TensorDataset(ids[:n], labels[:n])
        self.val_set = TensorDataset(ids[n:], labels[n:])
        self.bayes = {"bayes_auc": roc_auc(prob[n:], labels[n:]), "bayes_log_loss": log_loss(prob[n:], labels[n:])}

    @override
    def model_kwargs(self) -> dict[str, Any]:
        return {"num_fields": self.num_fields, "num_rows": self.num_fields * self.rows_per_field}

    def summary_metrics(self, trainer: Any) -> dict[str, Any]:
        """The ceiling the model's validation AUC / log loss are measured against (same validation set)."""
        return {"data": {"rows_per_field": self.rows_per_field, "values_per_field": self.values_per_field, "num_fields": self.num_fields, **self.bayes}}
