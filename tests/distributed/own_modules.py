"""LightningModules that are not parallelkit's, and one Trainer run of them on any strategy, for the tests of
"your own model" (``test_own_lightning_module.py``).

- :class:`SeededBoring`: Lightning's own demo ``BoringModel`` (one ``Linear(32, 2)``, SGD with a StepLR
  schedule, a dict returned from ``training_step``), with only its data made reproducible: ``BoringModel``
  draws its ``RandomDataset`` from the global generator when the loader is built, which a strategy's set-up
  may have advanced, and feeds one sample per batch.
- :class:`TinyRegressor`: written as a Lightning user writes one — repeated blocks in an ``nn.ModuleList``,
  ``self.log(..., sync_dist=True)``, AdamW with a per-step LR schedule, a validation loop.

:func:`fit` trains either under a strategy inside a rank of the test harness (Lightning sees ``LOCAL_RANK`` and
takes the processes as started by a launcher, and the process group as already there) or in one process, with
Lightning's own ``DistributedSampler`` (no shuffling), and returns per-step losses, the logged metrics, the
full final parameters and the traffic parallelkit counted.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel
from torch.utils.data import DataLoader, TensorDataset

SAMPLES = 64
FEATURES = 6
STEPS = 6


def _tensors(n: int, features: int, seed: int, target_dim: int | None = None) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return TensorDataset(x) if target_dim is None else TensorDataset(x, (x[:, :1] * 2 - x[:, 1:2]).squeeze(-1) + 0.1 * torch.randn(n, generator=g))


class SeededBoring(BoringModel):
    """Lightning's ``BoringModel`` with a fixed data set and a chosen batch size (its model, steps, loss,
    optimizer and schedule untouched)."""

    def __init__(self, batch_size: int = 2) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_tensors(SAMPLES, 32, seed=3), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_tensors(16, 32, seed=4), batch_size=self.batch_size)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return super().training_step(batch[0], batch_idx)  # BoringModel expects the bare tensor

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        return super().validation_step(batch[0], batch_idx)


class TinyRegressor(pl.LightningModule):
    """A residual MLP regressor with its blocks in a ModuleList, logging with ``sync_dist=True``."""

    def __init__(self, batch_size: int = 4, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.inp = torch.nn.Linear(FEATURES, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(depth))
        self.out = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h).squeeze(-1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x).float(), y)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x).float(), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.01)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_tensors(SAMPLES, FEATURES, seed=5, target_dim=1), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_tensors(16, FEATURES, seed=6, target_dim=1), batch_size=self.batch_size)


class ManualTiny(TinyRegressor):
    """The regressor with manual optimization (two optimizers: blocks and the rest)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        for optimizer in self.optimizers():
            optimizer.zero_grad()
        self.manual_backward(loss)
        for optimizer in self.optimizers():
            optimizer.step()
        return loss.detach()

    def configure_optimizers(self) -> Any:
        blocks = list(self.blocks.parameters())
        ids = {id(p) for p in blocks}
        rest = [p for p in self.parameters() if id(p) not in ids]
        return [torch.optim.SGD(blocks, lr=0.05), torch.optim.SGD(rest, lr=0.05)]


class SelfShardingTiny(TinyRegressor):
    """The regressor sharding its own blocks in ``configure_model``, as Lightning's ModelParallelStrategy asks."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if self.device_mesh is None:  # one process: nothing to shard
            return
        for block in self.blocks:
            fully_shard(block, mesh=self.device_mesh["data_parallel"])


MODELS: dict[str, Callable[..., pl.LightningModule]] = {"boring": SeededBoring, "tiny": TinyRegressor, "manual": ManualTiny,
                                                        "self_sharding": SelfShardingTiny}
# Per-rank batch of each model; one process trains on world × this.
BATCH = {"boring": 2, "tiny": 4, "manual": 4, "self_sharding": 4}


class _Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))


def full_parameters(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a DTensor shard gathered), on every rank."""
    out = {}
    for name, param in module.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[name] = value.detach().clone().float()
    return out


class MirroredBatches:
    """The global batches that ``world`` ranks see under Lightning's automatic ``DistributedSampler`` (which
    always shuffles training data: seed 0, reseeded per epoch): step k is rank 0's k-th batch, then rank 1's, ...
    A batch sampler for the one-process reference; Lightning sets its epoch as it does the ranks' samplers'."""

    def __init__(self, size: int, world: int, per_rank: int) -> None:
        self.size, self.world, self.per_rank, self.epoch = size, world, per_rank, 0
        self.sampler = self  # Lightning sets the epoch of ``batch_sampler.sampler``

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        from torch.utils.data import DistributedSampler

        per_rank_batches = []
        for rank in range(self.world):
            sampler = DistributedSampler(range(self.size), num_replicas=self.world, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(self.epoch)
            indices = list(sampler)
            per_rank_batches.append([indices[i : i + self.per_rank] for i in range(0, len(indices) - self.per_rank + 1, self.per_rank)])
        return [sum(step, []) for step in zip(*per_rank_batches)]

    def __iter__(self):
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())


def fit(model_name: str, world: int, make_strategy: Callable[[], Any] | None, callbacks: Callable[[], list] | None = None,
        prepare: Callable[[pl.LightningModule], None] | None = None, steps: int = STEPS, seed: int = 0,
        shard_data: bool = True) -> dict[str, Any]:
    """Train ``model_name`` for ``steps`` steps under ``make_strategy()`` (None: one process, batch × world)."""
    pl.seed_everything(seed, verbose=False)
    module = MODELS[model_name](batch_size=BATCH[model_name] * (1 if make_strategy else world))
    if prepare is not None:
        prepare(module)
    record = _Record()
    if make_strategy is not None:
        os.environ.update(LOCAL_RANK=str(torch.distributed.get_rank()), NODE_RANK="0")
        strategy, devices = make_strategy(), world
    else:  # one process on the same global batches: the union of what the ranks' samplers give them
        strategy, devices = "auto", 1
        dataset = module.train_dataloader().dataset
        batches = MirroredBatches(len(dataset), world, BATCH[model_name])
        module.train_dataloader = lambda: DataLoader(dataset, batch_sampler=batches)
    trainer = pl.Trainer(
        strategy=strategy, devices=devices, accelerator="cpu", max_steps=steps, val_check_interval=3,
        num_sanity_val_steps=0, limit_val_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[record, *(callbacks() if callbacks else [])], use_distributed_sampler=shard_data,
    )
    trainer.fit(module)
    comm = getattr(trainer.strategy, "comm_stats", None)
    return {
        "losses": record.losses,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "params": full_parameters(module) if not getattr(trainer.strategy, "engine", None) else gathered_deepspeed(trainer.strategy.engine),
        "bytes": comm.bytes() if comm is not None else 0,
        "by_kind": dict(comm.per_step(1)["by_kind"]) if comm is not None else {},
        "module": type(module).__name__,
        "fsdp_units": sorted(n for n, m in module.named_modules() if type(m).__name__.startswith("FSDP")),
    }


def gathered_deepspeed(engine: Any) -> dict[str, torch.Tensor]:
    """The engine's parameters whole: ZeRO-3 partitions gathered for the copy, earlier stages as they are."""
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {name: p.detach().clone().float() for name, p in params.items()}
