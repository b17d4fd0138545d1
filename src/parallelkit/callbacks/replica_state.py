"""What differs between data-parallel replicas, in checkpoints: gathered to rank 0 at save time, given back to
each rank on resume.

Lightning saves rank 0's parameters, optimizer state and callback state, and loads them on every rank. That is the
whole training state while the replicas are identical (plain DDP), not when a communication callback lets them
differ: DGC's residuals and momenta, PowerSGD's error feedback, Local SGD's and DiLoCo's parameters and inner
optimizer states between two averagings. A callback with such state mixes in :class:`ReplicaState` and says

- :meth:`~ReplicaState.replica_entry`: this rank's own state (called on every rank at save time: Lightning builds
  the checkpoint on all of them and rank 0 writes it);
- :meth:`~ReplicaState.restore_entry`: put this rank's own entry back (a run on as many replicas as were saved);
- :meth:`~ReplicaState.reset_replicas`: reset what cannot carry over to another number of replicas, returning
  what restarts and from what (said in one INFO line, on rank zero).

Its checkpoint holds the callback's shared state (:meth:`~ReplicaState.shared_state`, the same on every rank) and
``replicas``: the list of every rank's entry, gathered to rank 0 with one ``gather_object`` on the data-parallel
group (uncounted: checkpoint traffic, not a step's). The callback calls :meth:`~ReplicaState.restore_replicas`
in ``on_train_start``, once Lightning has loaded the model and optimizer (rank 0's) and the callback has rebuilt
its own objects.

A callback that synchronises the replicas at the end of a run only because the run ends there (Local SGD: "the run
ends with one model") calls :meth:`~ReplicaState.hold_for_continuation` first: the checkpoint of that step then
holds the state the uninterrupted run would have had (replicas apart), so a finished run taken further
(``trainer.max_steps`` raised, ``ckpt_path=last``) continues exactly, while the checkpoint's model is the
synchronised one.
"""

from __future__ import annotations

import copy
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info

from parallelkit.distributed.comm_counting import uncounted

REPLICAS = "replicas"


def group_rank_and_size(group: Any) -> tuple[int, int]:
    """This process's rank in the data-parallel ``group`` and the group's size (0, 1 without a process group)."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def gather_replicas(own: Any, group: Any) -> list | None:
    """Every rank's ``own`` (picklable), gathered to rank 0 of ``group``: the list there, ``None`` elsewhere.

    Every rank of ``group`` must call it (a collective); not counted as training traffic.
    """
    rank, world = group_rank_and_size(group)
    if world == 1:
        return [own]
    gathered = [None] * world if rank == 0 else None
    with uncounted():
        dist.gather_object(own, gathered, dst=dist.get_global_rank(group, 0), group=group)
    return gathered


class ReplicaState:
    """Mixin for a callback whose state differs between data-parallel replicas (see the module docstring).

    The callback sets :attr:`owner` (how the one-line message names it) and implements :meth:`replica_entry`,
    :meth:`restore_entry` and :meth:`reset_replicas`; :meth:`shared_state` if it has state every rank holds alike.
    Its ``state_dict`` / ``load_state_dict`` are these; what was loaded waits in ``self._loaded`` until
    ``on_train_start`` calls :meth:`restore_replicas`.

    Example::

        class Residuals(ReplicaState, CommHookCallback):
            def replica_entry(self, trainer):
                return {"residual": self.residual.clone()}
            def restore_entry(self, trainer, entry):
                self.residual.copy_(entry["residual"])
            def reset_replicas(self, trainer, replicas):
                self.residual.zero_()
                return "residuals restart from zero"
            def on_train_start(self, trainer, pl_module):
                self.restore_replicas(trainer)
    """

    owner: str = ""
    _loaded: dict | None = None
    _replica_trainer: Any = None  # set by restore_replicas: from then on state_dict gathers
    _held: tuple[dict, Any] | None = None

    # ---------------------------------------------------------------- what a callback says
    def replica_entry(self, trainer: Any) -> Any:
        """This rank's own state (tensors, numbers, lists, dicts: what ``torch.load(weights_only=True)`` reads)."""
        raise NotImplementedError

    def shared_state(self) -> dict[str, Any]:
        """The state every rank holds alike (saved as Lightning saves it: rank 0's)."""
        return {}

    def restore_entry(self, trainer: Any, entry: Any) -> None:
        """Put this rank's own ``entry`` back (same number of replicas as saved)."""
        raise NotImplementedError

    def reset_replicas(self, trainer: Any, replicas: list) -> str:
        """Another number of replicas than the checkpoint's ``replicas`` (empty: the checkpoint has none): reset
        what cannot carry over; return what restarts, from what (the tail of the one-line message)."""
        raise NotImplementedError

    def replica_group(self, trainer: Any) -> Any:
        return trainer.strategy.data_parallel_group

    # ---------------------------------------------------------------- the mechanism
    def hold_for_continuation(self, trainer: Any) -> None:
        """Freeze the state the checkpoint of this step will hold (a copy), before a synchronisation that happens
        only because the run ends here. Call at most once, at the last step."""
        self._held = copy.deepcopy((self.shared_state(), self.replica_entry(trainer)))

    def restore_replicas(self, trainer: Any) -> None:
        """From ``on_train_start``: give this rank its own saved entry, or reset (one line on rank zero)."""
        self._replica_trainer = trainer
        self._held = None
        loaded, self._loaded = self._loaded, None
        if not loaded:
            return
        replicas = loaded.get(REPLICAS)
        rank, world = group_rank_and_size(self.replica_group(trainer))
        if replicas is not None and len(replicas) == world:
            self.restore_entry(trainer, replicas[rank])
            return
        what = self.reset_replicas(trainer, list(replicas or []))
        held = (f"holds {len(replicas)} replicas" if replicas is not None
                else "holds no per-replica state (written before parallelkit saved it)")
        rank_zero_info(f"{self.owner}: the checkpoint {held}, this run has {world}: {what}")

    def state_dict(self) -> dict[str, Any]:
        trainer = self._replica_trainer
        if trainer is None:  # not training (yet): what was loaded, unchanged
            return dict(self._loaded or {})
        shared, own = self._held if self._held is not None else (self.shared_state(), self.replica_entry(trainer))
        return {**shared, REPLICAS: gather_replicas(own, self.replica_group(trainer))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict) or None
