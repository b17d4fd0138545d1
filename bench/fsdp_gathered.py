"""A callback that measures the bytes of full (gathered) parameters a ZeRO-3 rank holds at its peak.

FSDP2 all-gathers a unit's parameters into a flat buffer, copies them out into its ``all_gather_outputs`` when
the unit is about to run (a prefetched unit waits in the flat buffer until then) and frees their storage (resized
to 0) when it reshards. The callback sums the storage those tensors hold, over every unit of the
model, at every unit's forward (after FSDP2's own pre-forward: the unit and whatever it prefetched are
gathered) and whenever backward hands a sharded gradient back (the unit being reduced and the prefetched
previous one), and keeps the peak. With ``strategy.prefetch=true`` the peak is the root unit, the unit
computing and the next one; without, the root and the unit computing. The difference is what prefetching
costs in memory: one unit's full parameters.

    python train.py strategy=zero strategy.stage=3 trainer.devices=2 trainer.max_steps=10 \\
        '+callbacks.gathered={_target_:bench.fsdp_gathered.GatheredPeak,out:/tmp/gathered.json}'
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl


class GatheredPeak(pl.Callback):
    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.peak = 0
        self._params: list[Any] = []
        self._groups: list[Any] = []
        self.unit_bytes: dict[str, int] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from torch.distributed.fsdp import FSDPModule

        units = [(name, m) for name, m in pl_module.named_modules() if isinstance(m, FSDPModule)]
        if not units:
            raise RuntimeError("GatheredPeak measures FSDP2 (strategy=zero strategy.stage=3): the model has no FSDP2 unit")
        for i, (name, unit) in enumerate(units):  # pre-order: the root unit first
            groups = unit._get_fsdp_state()._fsdp_param_groups
            params = [fp for group in groups for fp in group.fsdp_params]
            self.unit_bytes[f"{name} (root)" if i == 0 else name] = sum(fp._orig_size.numel() * fp.sharded_param.element_size() for fp in params)
            self._params += params
            self._groups += groups
            unit.register_forward_pre_hook(lambda module, args: self._sample())
            for fp in params:
                fp.sharded_param.register_post_accumulate_grad_hook(lambda param: self._sample())

    def _sample(self) -> None:
        # A unit's full parameters (after its all-gather was waited for and copied out), and the flat buffers of
        # all-gathers issued and not yet waited for (a prefetched unit: it lives there until its turn).
        held = sum(t.untyped_storage().nbytes() for fp in self._params for t in getattr(fp, "all_gather_outputs", ()))
        held += sum(g._all_gather_result.all_gather_output.untyped_storage().nbytes() for g in self._groups
                    if g._all_gather_result is not None)
        self.peak = max(self.peak, held)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps({"peak_gathered_bytes": self.peak, "unit_full_bytes": self.unit_bytes}, indent=1))
