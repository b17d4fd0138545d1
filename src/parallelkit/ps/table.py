"""One shard of a sparse embedding table: rows created on first touch, updated per row by an optimizer.

A parameter server holds the rows its hash partition owns and nothing else, so memory grows with the
rows that training touched, not with the id space (``10^7`` or ``2^63`` ids cost the same). Rows are
created with a counter-based initializer (:func:`init_rows`): a row's initial value is a function of
``(seed, table, id)`` only, so it does not depend on which server holds the row, on the order of
requests, or on the number of servers, and a single-process model can build the very same dense table.

The optimizers reproduce torch's sparse-gradient semantics row by row (``torch.optim.SGD`` and
``torch.optim.Adagrad`` given a coalesced sparse gradient), so a parameter-server run in sync mode
matches single-process training. ``adam`` is *lazy* Adam with ``torch.optim.SparseAdam``'s arithmetic but
a step count per row (a row's bias correction counts the updates *it* got): equal to SparseAdam when
every row is touched every step, and different from dense Adam/AdamW on purpose (untouched rows keep
their moments, and no weight decay, which would have to touch every row every step).
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np
import torch

from parallelkit.errors import ConfigError
from parallelkit.hashing import MASK64, splitmix64

OPTIMIZERS = ("sgd", "adagrad", "adam")
_GROWTH = 2  # the row store doubles when full: amortised O(1) inserts, at most 2x the live rows


def table_key(name: str) -> int:
    """A stable 32-bit number for a table name (Python's ``hash`` of a str changes per process)."""
    return zlib.crc32(name.encode())


def init_rows(seed: int, table: str, ids: torch.Tensor, dim: int, scale: float) -> torch.Tensor:
    """Initial values of rows ``ids`` (int64): uniform in ``[-scale, scale)``, a pure function of ``(seed, table, id, column)``."""
    ids_np = ids.detach().cpu().numpy().astype(np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        base = splitmix64(np.uint64(seed & 0xFFFFFFFF) << np.uint64(32) | np.uint64(table_key(table)))
        keys = splitmix64(ids_np ^ base)[:, None] * np.uint64(dim) + np.arange(dim, dtype=np.uint64)[None, :]
    bits = splitmix64(keys & MASK64) >> np.uint64(40)  # 24 random bits: exact in float32
    unit = torch.from_numpy((bits.astype(np.float64) / float(1 << 24)).astype(np.float32))
    return (unit * 2 - 1) * scale


@dataclass(frozen=True)
class TableSpec:
    """What a table is: its width, initializer and per-row optimizer (the same on every server and worker).

    Args:
        name: table name (requests name it).
        dim: row width.
        optimizer: ``sgd``, ``adagrad`` or ``adam`` (lazy); the learning rate comes with each push.
        seed / init_scale: the row initializer (:func:`init_rows`).
        eps / initial_accumulator_value / betas / weight_decay: optimizer hyperparameters, as in torch.
    """

    name: str
    dim: int
    optimizer: str = "adagrad"
    seed: int = 0
    init_scale: float = 0.01
    eps: float = 1e-10
    initial_accumulator_value: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"table {self.name!r}: optimizer must be one of {OPTIMIZERS}. Got {self.optimizer!r}.")
        if not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"table {self.name!r}: dim should be an int greater than 0. Got {self.dim!r}.")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def state_slots(self) -> int:
        """Optimizer state tensors per row (each ``dim`` wide), besides the step count of lazy Adam."""
        return {"sgd": 0, "adagrad": 1, "adam": 2}[self.optimizer]


def table_optimizer(factory: Callable[..., torch.optim.Optimizer]) -> dict[str, Any]:
    """The per-row optimizer matching the run's optimizer (kind and hyperparameters, as :class:`TableSpec` fields)."""
    probe = factory([torch.nn.Parameter(torch.zeros(1))])
    group = probe.param_groups[0]
    name = type(probe).__name__
    if isinstance(probe, torch.optim.SGD):
        if group.get("momentum", 0) or group.get("nesterov"):
            raise ConfigError("strategy=ps applies SGD per row without momentum; set optim.optimizer.momentum=0 (or use optim=adagrad).")
        return {"optimizer": "sgd", "weight_decay": float(group.get("weight_decay", 0.0))}
    if isinstance(probe, torch.optim.Adagrad):
        if group.get("lr_decay", 0):
            raise ConfigError("strategy=ps: Adagrad's lr_decay is not applied per row; use a learning-rate schedule instead (optim.schedule).")
        return {
            "optimizer": "adagrad",
            "eps": float(group["eps"]),
            "initial_accumulator_value": float(group.get("initial_accumulator_value", 0.0)),
            "weight_decay": float(group.get("weight_decay", 0.0)),
        }
    if isinstance(probe, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SparseAdam)):
        beta1, beta2 = group["betas"]
        # Weight decay would have to touch every row every step; lazy Adam on the tables skips it.
        return {"optimizer": "adam", "eps": float(group["eps"]), "beta1": float(beta1), "beta2": float(beta2)}
    raise ConfigError(f"strategy=ps: the servers implement SGD, Adagrad and Adam per row, not {name}. Use optim=adagrad or optim=sgd (momentum=0).")


class TableShard:
    """The rows of one table that one server owns (or that a geo-mode worker caches).

    Example::

        shard = TableShard(TableSpec("emb", dim=16))
        rows = shard.pull(torch.tensor([3, 10**12]))       # created on first touch
        shard.apply(torch.tensor([3]), grad, lr=0.1)        # grad: (1, 16), summed over the batch
    """

    def __init__(self, spec: TableSpec) -> None:
        self.spec = spec
        self.slot_of: dict[int, int] = {}
        self.ids = torch.empty(0, dtype=torch.int64)
        self.weights = torch.empty(0, spec.dim)
        self.state = [torch.empty(0, spec.dim) for _ in range(spec.state_slots)]
        self.steps = torch.empty(0, dtype=torch.int64)  # per-row update count (lazy Adam's bias correction)
        self.num_rows = 0

    # ------------------------------------------------------------------ rows
    def slots(self, ids: torch.Tensor, initial: torch.Tensor | None = None) -> torch.Tensor:
        """Slots of ``ids`` (unique int64), creating missing rows from ``initial`` rows or the initializer."""
        slot_of = self.slot_of
        id_list = ids.tolist()
        missing = [i for i, row_id in enumerate(id_list) if row_id not in slot_of]
        if missing:
            new_ids = ids[missing]
            values = initial[missing] if initial is not None else init_rows(self.spec.seed, self.spec.name, new_ids, self.spec.dim, self.spec.init_scale)
            self._append(new_ids, values)
        return torch.tensor([slot_of[row_id] for row_id in id_list], dtype=torch.int64)

    def _append(self, new_ids: torch.Tensor, values: torch.Tensor) -> None:
        need = self.num_rows + len(new_ids)
        if need > len(self.weights):
            capacity = max(need, _GROWTH * len(self.weights), 16)
            fill = self.spec.initial_accumulator_value
            self.weights = _grow(self.weights, capacity, 0.0)
            self.state = [_grow(s, capacity, fill if k == 0 and self.spec.optimizer == "adagrad" else 0.0) for k, s in enumerate(self.state)]
            self.steps = _grow(self.steps, capacity, 0)
            self.ids = _grow(self.ids, capacity, 0)
        start = self.num_rows
        self.weights[start:need] = values
        self.ids[start:need] = new_ids
        for offset, row_id in enumerate(new_ids.tolist()):
            self.slot_of[row_id] = start + offset
        self.num_rows = need

    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        slots = self.slots(ids)  # first: creating rows may reallocate self.weights
        return self.weights[slots]

    def peek(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` without creating missing ones (reads outside training must not grow the table)."""
        spec = self.spec
        out = init_rows(spec.seed, spec.name, ids, spec.dim, spec.init_scale)
        known = [(i, self.slot_of[row_id]) for i, row_id in enumerate(ids.tolist()) if row_id in self.slot_of]
        if known:
            pos, slots = zip(*known)
            out[list(pos)] = self.weights[list(slots)]
        return out

    # ------------------------------------------------------------------ updates
    def apply(self, ids: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
        """One optimizer step for rows ``ids`` (unique) with their summed gradient ``grad``.

        All new values are computed before any is stored: an update that fails half-way leaves the rows
        and their optimizer state as they were (a push is applied whole or not at all).
        """
        spec = self.spec
        w, old_state, old_steps = self._current(ids)
        state: list[torch.Tensor] = []
        step = None
        if spec.weight_decay:
            grad = grad + spec.weight_decay * w
        if spec.optimizer == "sgd":
            w = w - lr * grad
        elif spec.optimizer == "adagrad":
            # torch.optim.Adagrad on a sparse gradient: the accumulator, then grad / (sqrt(acc) + eps).
            acc = old_state[0] + grad * grad
            state = [acc]
            w = w - lr * (grad / (acc.sqrt() + spec.eps))
        else:
            step = old_steps + 1
            m = old_state[0] * spec.beta1 + (1 - spec.beta1) * grad
            v = old_state[1] * spec.beta2 + (1 - spec.beta2) * grad * grad
            state = [m, v]
            # torch.optim.SparseAdam's arithmetic (eps outside the bias correction), with the corrections in
            # float64: 1 - 0.999**1 in float32 is off by 5e-5 relative.
            step_f = step.to(torch.float64)[:, None]
            step_size = (lr * (1 - spec.beta2**step_f).sqrt() / (1 - spec.beta1**step_f)).to(grad.dtype)
            w = w - step_size * (m / (v.sqrt() + spec.eps))
        # Commit: create the rows new to this shard, then plain copies into their storage.
        slots = self.slots(ids)
        for k, value in enumerate(state):
            self.state[k][slots] = value
        if step is not None:
            self.steps[slots] = step
        self.weights[slots] = w

    def _current(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """Values, optimizer state and step counts of rows ``ids`` as they are or would be created, creating none."""
        spec = self.spec
        known = torch.tensor([row_id in self.slot_of for row_id in ids.tolist()], dtype=torch.bool)
        if bool(known.all()):
            slots = self.slots(ids)
            return self.weights[slots], [s[slots] for s in self.state], self.steps[slots]
        fill = [spec.initial_accumulator_value if k == 0 and spec.optimizer == "adagrad" else 0.0 for k in range(spec.state_slots)]
        w = self.peek(ids)
        state = [torch.full((len(ids), spec.dim), f) for f in fill]
        steps = torch.zeros(len(ids), dtype=torch.int64)
        if bool(known.any()):
            slots = self.slots(ids[known])
            for k, s in enumerate(self.state):
                state[k][known] = s[slots]
            steps[known] = self.steps[slots]
        return w, state, steps

    def add(self, ids: torch.Tensor, delta: torch.Tensor) -> None:
        """Add ``delta`` to rows ``ids`` (geo mode: a worker's parameter change since its last sync)."""
        slots = self.slots(ids)
        self.weights[slots] = self.weights[slots] + delta

    def overwrite(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        slots = self.slots(ids, initial=values)
        self.weights[slots] = values

    # ------------------------------------------------------------------ accounting and snapshots
    def stats(self) -> dict[str, int]:
        """Rows held; bytes of their values and optimizer state; bytes allocated (at most 2x, growth)."""
        per_row = self.spec.dim * 4 * (1 + self.spec.state_slots)
        allocated = sum(t.numel() * t.element_size() for t in (self.weights, *self.state, self.steps, self.ids))
        return {"rows": self.num_rows, "row_bytes": self.num_rows * per_row, "allocated_bytes": allocated}

    def state_dict(self) -> dict[str, Any]:
        n = self.num_rows
        return {
            "spec": self.spec.as_dict(),
            "ids": self.ids[:n].clone(),
            "weights": self.weights[:n].clone(),
            "state": [s[:n].clone() for s in self.state],
            "steps": self.steps[:n].clone(),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> TableShard:
        shard = cls(TableSpec(**state["spec"]))
        n = len(state["ids"])
        if n:
            shard._append(state["ids"], state["weights"])
            for k, s in enumerate(state["state"]):
                shard.state[k][:n] = s
            shard.steps[:n] = state["steps"]
        return shard


def _grow(tensor: torch.Tensor, rows: int, fill: float) -> torch.Tensor:
    out = torch.full((rows, *tensor.shape[1:]), fill, dtype=tensor.dtype)
    out[: len(tensor)] = tensor
    return out
