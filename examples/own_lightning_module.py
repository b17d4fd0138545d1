"""Your own LightningModule under parallelkit's ZeRO-3 with mixed precision: plain Python, no Hydra.

    python examples/own_lightning_module.py      # 2 processes on the CPU (gloo); on a GPU machine: every GPU

The module is ordinary Lightning code. parallelkit's ``ZeroStrategy(stage=3)`` shards it with FSDP2, one
sharding unit per block of its ``nn.ModuleList`` (found by itself; ``shard_modules=[...]`` or
``shard_min_params=N`` choose otherwise, or shard in ``configure_model`` yourself), and the ``AMP`` callback
runs forward in bf16 with fp32 master weights. The same strategy and callback run on CPU/gloo, where
Lightning's own FSDP and DeepSpeed strategies refuse to start, and on GPUs with NCCL.
"""

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from parallelkit.callbacks.amp import AMP
from parallelkit.strategies.zero import ZeroStrategy


class Regressor(pl.LightningModule):
    def __init__(self, features: int = 16, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(features, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU()) for _ in range(depth))
        self.out = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)  # (batch, 1): a fresh tensor (a squeezed view would make FSDP2 warn about in-place ops)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x).float(), y)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x).float(), y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)}

    def _data(self, n: int, seed: int) -> DataLoader:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, self.inp.in_features, generator=g)
        y = (torch.sin(x[:, :4]).sum(-1) + x[:, 4] * x[:, 5]).unsqueeze(-1)
        return DataLoader(TensorDataset(x, y), batch_size=32)

    def train_dataloader(self) -> DataLoader:
        return self._data(4096, seed=0)

    def val_dataloader(self) -> DataLoader:
        return self._data(512, seed=1)


if __name__ == "__main__":
    pl.seed_everything(0)
    trainer = pl.Trainer(
        strategy=ZeroStrategy(stage=3),
        callbacks=[AMP(dtype="bf16")],
        accelerator="auto",
        devices=2 if not torch.cuda.is_available() else "auto",
        max_steps=100,
        val_check_interval=50,
        enable_progress_bar=False,
    )
    trainer.fit(Regressor())
    if trainer.is_global_zero:
        print(f"train_loss {float(trainer.callback_metrics['train_loss']):.4f}  val_loss {float(trainer.callback_metrics['val_loss']):.4f}")
