"""What the planner's search may vary and what it must respect (``strategy=auto``'s knobs), checked on creation.

Its own module so that :mod:`~parallelkit.planner.pruning` and :mod:`~parallelkit.planner.search` both use it
without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallelkit.distributed.parallel_dims import DEFAULT_MESH_ORDER
from parallelkit.errors import ConfigError
from parallelkit.planner.layout import CP_MODES, SCHEDULES


@dataclass(frozen=True)
class SearchOptions:
    """What the search may vary and what it must respect.

    Args:
        schedule: the pipeline schedule (``strategy.schedule``).
        virtual_stages: stages per rank for interleaved schedules; None: searched (2 … 8).
        max_microbatches: upper bound on pipeline micro-batches (None: any divisor of the per-rank batch).
        search_accumulate: choose gradient accumulation without a pipeline (else keep ``trainer.accumulate_grad_batches``).
        mesh_order: outermost → innermost mesh axes.
        reshard_after_forward: ZeRO-3 option; None: hybrid4d's default (reshard without a pipeline only).
        allow_tp_across_nodes / allow_ep_across_nodes: let tp / ep groups span nodes.
        norm_clipping: ``trainer.gradient_clip_val`` by norm (hybrid4d refuses it with ep > 1).
        zero_stage: what sharding shards (hybrid4d's FSDP2: 3).
        sequence_parallel: ``strategy.sequence_parallel``; None: searched (both ways for every ``tp > 1`` the model
            allows it).
        cp_mode: ``strategy.cp_mode`` (``ring`` or ``ulysses``); None: searched (ring, and ulysses where the heads
            divide) for every ``cp > 1``.
        max_cp: the largest context-parallel degree searched (None: any the sequence and the model allow; 1: none).
    """

    schedule: str = "1f1b"
    virtual_stages: int | None = None
    max_microbatches: int | None = None
    search_accumulate: bool = True
    mesh_order: tuple[str, ...] = DEFAULT_MESH_ORDER
    reshard_after_forward: bool | None = None
    allow_tp_across_nodes: bool = False
    allow_ep_across_nodes: bool = False
    norm_clipping: bool = False
    zero_stage: int = 3
    sequence_parallel: bool | None = None
    cp_mode: str | None = None
    max_cp: int | None = None

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"strategy.schedule={self.schedule!r} is not a pipeline schedule. Use one of {', '.join(SCHEDULES)}.")
        if self.max_microbatches is not None and (not isinstance(self.max_microbatches, int) or self.max_microbatches < 1):
            raise ConfigError(f"strategy.max_microbatches should be an int greater than 0 or null. Got {self.max_microbatches!r}.")
        if self.sequence_parallel not in (None, True, False):
            raise ConfigError(f"strategy.sequence_parallel should be true, false or absent (searched). Got {self.sequence_parallel!r}.")
        if self.cp_mode is not None and self.cp_mode not in CP_MODES:
            raise ConfigError(f"strategy.cp_mode should be one of {', '.join(CP_MODES)} or null (searched). Got {self.cp_mode!r}.")
        if self.max_cp is not None and (not isinstance(self.max_cp, int) or isinstance(self.max_cp, bool) or self.max_cp < 1):
            raise ConfigError(f"strategy.max_cp should be an int greater than 0 or null. Got {self.max_cp!r}.")
