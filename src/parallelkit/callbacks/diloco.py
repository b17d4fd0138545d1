"""``callbacks=[diloco]``: DiLoCo and Streaming DiLoCo on a DDP strategy, for slow links between replicas."""

from __future__ import annotations

import copy
from typing import Any, Callable

import lightning.pytorch as pl
import torch.distributed
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from parallelkit.callbacks.comm_hook import CommHookCallback
from parallelkit.callbacks.replica_state import ReplicaState
from parallelkit.callbacks.run_summary import log_step_metrics
from parallelkit.capabilities import DDP_COMM_HOOK, REPLICATED_PARAMS
from parallelkit.distributed.comm_stats import collective_bytes
from parallelkit.distributed.diloco import OUTER_ALLREDUCE, OUTER_DTYPES, DiLoCo
from parallelkit.distributed.local_sgd import GRAD_ALLREDUCE, LocalSGDState, local_sgd_hook
from parallelkit.errors import ConfigError

OWNER = "callbacks=[diloco]"


class DiLoCoCallback(ReplicaState, CommHookCallback):
    """Replicas take ``inner_steps`` steps of the run's optimizer alone, then an outer Nesterov SGD applies their
    mean parameter delta (DiLoCo); with ``fragments`` > 1, ``overlap_steps`` or a half-precision
    ``outer_dtype``, Streaming DiLoCo. See :mod:`parallelkit.distributed.diloco`.

    The DDP gradient all-reduce is switched off for the whole run (a comm hook that sends nothing), so the
    only traffic is the outer all-reduce: DDP's bytes ÷ ``inner_steps`` (× 1/2 in bf16/fp16; int8: an all-gather of
    int8 values and per-256-element fp32 scales, × W/8 on W ranks: × 1/4 on 2). Validation
    sees the global parameters (the anchors, identical on every rank), not a replica. After the last step
    the outer step due then is applied and every other fragment is averaged, so the run ends with one model.
    Checkpoints hold the anchors, the outer optimizer, the in-flight fragment's averaged delta and every
    rank's own parameters and inner optimizer state (gathered to rank 0 at save time:
    :mod:`parallelkit.callbacks.replica_state`), so a run resumed mid-outer-step continues exactly; resumed on
    another number of ranks it restarts the outer step from the anchors (one line says so).

    Args:
        inner_steps: H, inner optimizer steps between two outer steps (of each fragment).
        outer_lr: the outer SGD's learning rate (DiLoCo: 0.7).
        outer_momentum: the outer SGD's momentum (DiLoCo: 0.9); 0 = none.
        nesterov: Nesterov momentum (DiLoCo: yes).
        fragments: Streaming DiLoCo's F: parameter fragments synchronized at staggered steps; must divide H.
        overlap_steps: Streaming DiLoCo's τ: inner steps a fragment's all-reduce overlaps; < H / F.
        mix: weight of the local parameters when an overlapped fragment is merged (τ > 0 only).
        outer_dtype: precision the outer gradients travel in: fp32, bf16, fp16 or int8 (with fp32 scales).

    Example::

        python train.py callbacks=[diloco] callbacks.diloco.inner_steps=16 trainer.devices=2
        python train.py callbacks=[diloco] callbacks.diloco.inner_steps=16 callbacks.diloco.fragments=4 \\
            callbacks.diloco.overlap_steps=1 callbacks.diloco.outer_dtype=int8 trainer.devices=2
    """

    owner = OWNER
    needs = {
        DDP_COMM_HOOK: "it switches the gradient all-reduce off (replicas train alone between outer steps) through a DDP comm hook",
        REPLICATED_PARAMS: "its outer step averages full parameter replicas",
    }

    def __init__(self, inner_steps: int = 16, outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                 fragments: int = 1, overlap_steps: int = 0, mix: float = 0.5, outer_dtype: str = "fp32") -> None:
        for name, value, low in (("inner_steps", inner_steps, 1), ("fragments", fragments, 1), ("overlap_steps", overlap_steps, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"callbacks.diloco.{name} should be an int >= {low}. Got {value!r}.")
        for name, value, ok, interval in (("outer_lr", outer_lr, outer_lr > 0, "(0, inf)"),
                                          ("outer_momentum", outer_momentum, 0 <= outer_momentum < 1, "[0, 1)"),
                                          ("mix", mix, 0 <= mix <= 1, "[0, 1]")):
            if not ok:
                raise ConfigError(f"callbacks.diloco.{name} should be in {interval}. Got {value!r}.")
        if outer_dtype not in OUTER_DTYPES:
            raise ConfigError(f"callbacks.diloco.outer_dtype should be one of {sorted(OUTER_DTYPES)}. Got {outer_dtype!r}.")
        if inner_steps % fragments:
            raise ConfigError(f"callbacks.diloco.fragments ({fragments}) should divide inner_steps ({inner_steps}): "
                              f"the fragments' outer steps are staggered by inner_steps / fragments steps.")
        if overlap_steps >= inner_steps // fragments:
            raise ConfigError(f"callbacks.diloco.overlap_steps ({overlap_steps}) should be < inner_steps / fragments "
                              f"({inner_steps // fragments}): one fragment's all-reduce must land before the next one starts.")
        if nesterov and outer_momentum == 0:
            raise ConfigError("callbacks.diloco.nesterov=true needs outer_momentum > 0; set nesterov=false for plain outer SGD.")
        super().__init__()
        self.options = dict(inner_steps=inner_steps, outer_lr=float(outer_lr), outer_momentum=float(outer_momentum),
                            nesterov=bool(nesterov), fragments=fragments, overlap_steps=overlap_steps, mix=float(mix),
                            outer_dtype=outer_dtype)
        self.diloco: DiLoCo | None = None
        self._loaded: dict | None = None
        self._local: list | None = None  # the replica's parameters while validation holds the anchors
        self._resumable: tuple[dict, dict] | None = None  # after the last step: the state before the end's averaging
        self._sent = 0
        self._last_bytes = 0
        self._dense_step_bytes = 0

    # ---------------------------------------------------------------- setup
    @override
    def build_hook(self, strategy: Any) -> tuple[Callable, LocalSGDState]:
        state = LocalSGDState(strategy.data_parallel_group, strategy.comm_stats)
        state.sync_grads = False  # for the whole run: the outer all-reduce is the only traffic
        return local_sgd_hook, state

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ConfigError(f"{OWNER} drives one inner optimizer; this module configures {len(trainer.optimizers)}.")
        strategy = trainer.strategy
        params = [p for p in pl_module.parameters() if p.requires_grad]
        self.diloco = DiLoCo(params, strategy.data_parallel_group, strategy.comm_stats, **self.options)
        if self._loaded:
            self.diloco.load_state_dict(self._loaded["diloco"])
        self.restore_replicas(trainer)
        grad_bytes = sum(p.numel() * p.element_size() for p in params)
        self._dense_step_bytes = collective_bytes(grad_bytes, "all_reduce", strategy.data_parallel_group)
        self._last_bytes = self._bytes(trainer)
        o = self.options
        rank_zero_info(f"DiLoCo: outer step every {o['inner_steps']} steps (lr {o['outer_lr']}, momentum {o['outer_momentum']}"
                       f"{', Nesterov' if o['nesterov'] else ''}), {o['fragments']} fragment(s), overlap {o['overlap_steps']} "
                       f"step(s), outer gradients in {o['outer_dtype']}.")
        world = torch.distributed.get_world_size(strategy.data_parallel_group)
        if o["outer_dtype"] == "int8" and world >= 8:
            rank_zero_info(f"DiLoCo: outer_dtype=int8 all-gathers every rank's int8 outer gradient: on {world} ranks that is "
                           f"{world / 8:g}× fp32's all-reduce bytes, not fewer; use bf16 (½×) at this size.")

    # ---------------------------------------------------------------- per-replica state (callbacks.replica_state)
    @override
    def shared_state(self) -> dict[str, Any]:
        if self._resumable is not None:
            return self._resumable[0]
        return {"diloco": self.diloco.state_dict()}

    @override
    def replica_entry(self, trainer: pl.Trainer) -> dict[str, Any]:
        if self._resumable is not None:
            return self._resumable[1]
        # the replica's own parameters (not the anchors validation may hold now) and inner optimizer state
        return {"params": [t.detach().clone() for t in (self._local or self.diloco.params)],
                "optimizer": trainer.optimizers[0].state_dict()}

    @override
    def restore_entry(self, trainer: pl.Trainer, entry: dict[str, Any]) -> None:
        # Lightning loaded rank 0's parameters and optimizer state on every rank: put this replica's own back
        for p, saved in zip(self.diloco.params, entry["params"], strict=True):
            p.data.copy_(saved)
        trainer.optimizers[0].load_state_dict(entry["optimizer"])

    @override
    def reset_replicas(self, trainer: pl.Trainer, replicas: list) -> str:
        # the in-flight fragment's averaged delta is the same on every rank and stays valid: it is kept
        self.diloco.swap_back(self.diloco.anchors)
        return "every rank restarts the current outer step from the anchors (the replicas' local progress is lost)."

    def _bytes(self, trainer: pl.Trainer) -> int:
        stats = trainer.strategy.comm_stats
        return stats.bytes(GRAD_ALLREDUCE) + stats.bytes(OUTER_ALLREDUCE)

    # ---------------------------------------------------------------- per step
    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = self._finished_step(trainer)
        if step is None:
            return
        applied = self.diloco.after_step(step)
        if trainer.max_steps is not None and 0 < trainer.max_steps <= trainer.global_step:
            # The final checkpoint keeps the run as it stands before the end's averaging, so that a run taken further
            # continues as the uninterrupted one (which never averaged here); the model trained to is the average.
            self._resumable = (copy.deepcopy(self.shared_state()), copy.deepcopy(self.replica_entry(trainer)))
            self.diloco.end_with_one_model(step)
            applied = True
        now = self._bytes(trainer)
        sent, self._last_bytes = now - self._last_bytes, now
        self._sent += sent
        log_step_metrics(trainer, {"diloco_outer_step": float(applied), "diloco_bytes_sent": float(sent)})

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        diloco = self.diloco
        if diloco is not None and trainer.global_step > 0 and diloco.ended_at != trainer.global_step - 1:
            diloco.end_with_one_model(trainer.global_step - 1)  # stopped before max_steps: still one model

    # Validation judges the global model, which every rank holds identically, not one replica's drift.
    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.diloco is not None and not trainer.sanity_checking:
            self._local = self.diloco.swap_in_anchors()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._local is not None:
            self.diloco.swap_back(self._local)
            self._local = None

    # ---------------------------------------------------------------- summary and checkpoints
    def summary_metrics(self, trainer: pl.Trainer) -> dict[str, Any]:
        steps = max(self._steps, 1)
        return {"diloco": {
            **self.options,
            "bytes_sent_per_step": self._sent / steps,
            "dense_bytes_per_step": self._dense_step_bytes,
            "compression_ratio": self._dense_step_bytes * steps / self._sent if self._sent else None,
            "outer_steps": len(self.diloco.outer_steps) if self.diloco else 0,
            "fragment_numel": [sum(self.diloco.params[i].numel() for i in idx) for idx in self.diloco.fragments] if self.diloco else [],
            "extra_memory_bytes": self.diloco.memory_bytes() if self.diloco else {},
            "extra_memory_note": "measured from the tensors held (numel × element size); every fragment's fp32 anchor is "
                                 "held (each is needed until that fragment's next outer step), plus the fp32 outer momentum; "
                                 "in_flight and peak are the most held during the run, in this process",
        }}
