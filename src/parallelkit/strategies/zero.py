"""ZeRO data parallelism, native PyTorch: stage 0 (plain DP), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters).

A preset of :class:`~parallelkit.strategies.composed.ComposedStrategy`: data-parallel degrees only
(``sharding_group=K`` shards inside groups of K consecutive ranks, the ``sharding`` mesh axis, and replicates
across groups, the ``dp`` axis); stages 1-2 shard the optimizer once it exists, stage 3 shards the model with
FSDP2 before the optimizer is created (:mod:`parallelkit.distributed.parallelize`, step 7).
"""

from __future__ import annotations

from typing import Any

from parallelkit.distributed.elastic import DEFAULT_TIMEOUT_S
from parallelkit.distributed.parallel_dims import ParallelDims
from parallelkit.distributed.parallelize import ParallelOptions
from parallelkit.errors import ConfigError
from parallelkit.strategies.composed import OFFLOAD_CHOICES, ComposedStrategy


class ZeroStrategy(ComposedStrategy):
    """Shard model state over the data-parallel ranks (ZeRO, Rajbhandari et al. 2020).

    Args:
        stage: 0 = plain data parallel; 1 = optimizer state sharded; 2 = + gradients; 3 = + parameters.
        sharding_group: ranks per sharding group (``None``/-1: all ranks); must divide the world size.
        offload: ``none``; ``optimizer`` (stages 1-2: owned slices and optimizer state on the host, stepped
            there); ``params`` (stage 3: parameter shards, gradients and optimizer state on the host).
        per_block: stage 3 shards the model unit by unit (the policy below) rather than as one unit.
        shard_modules: stage 3 sharding units by class: every module of these classes (names or
            ``module.ClassName`` paths), like FSDP's ``ModuleWrapPolicy``.
        shard_min_params: stage 3 sharding units by size: bottom-up, every module holding at least this many
            parameters not in a smaller unit, like FSDP's ``size_based_auto_wrap_policy``. With neither, the
            units are the model's repeated blocks (children of its ``ModuleList``/``ModuleDict``s), unless the
            LightningModule shards itself in ``configure_model`` (then its own units are kept).
        reshard_after_forward: stage 3 frees gathered parameters after forward and gathers them again
            for backward (ZeRO-3); ``False`` keeps them until after backward (less traffic, more memory).
        prefetch: stage 3 overlaps communication with compute: the next unit's all-gather runs while the
            current one computes (one unit gathered ahead at most), and on gloo each unit's gradient
            reduce-scatter while the next unit's backward runs; ``False``: each collective when its unit needs it.
        bucket_cap_mb: stages 0-2 gradient/parameter bucket size (communication fusion).

    Example::

        Trainer(strategy=ZeroStrategy(stage=2, sharding_group=2), devices=4, accelerator="cpu")
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = 3,
        sharding_group: int | None = None,
        offload: str = "none",
        per_block: bool = True,
        shard_modules: list[str] | None = None,
        shard_min_params: int | None = None,
        reshard_after_forward: bool = True,
        prefetch: bool = True,
        bucket_cap_mb: float = 25.0,
        save_distributed_checkpoint: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        process_group_backend: str | None = None,
    ) -> None:
        if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
            raise ConfigError(f"strategy.stage must be 0, 1, 2 or 3 (0 = plain DP, 1 = optimizer state, 2 = + gradients, 3 = + parameters). Got {stage!r}.")
        if offload not in OFFLOAD_CHOICES:
            raise ConfigError(f"strategy.offload must be one of {', '.join(OFFLOAD_CHOICES)}. Got {offload!r}.")
        if offload == "params" and stage != 3:
            raise ConfigError(
                f"strategy.offload=params needs strategy.stage=3: only stage 3 shards the parameters, so stage {stage} "
                "cannot keep them on the host. Use strategy.stage=3, or strategy.offload=optimizer with stage 1 or 2."
            )
        if offload == "optimizer" and stage in (0, 3):
            hint = (
                "stage 3 offloads with offload=params (FSDP2 moves parameters, gradients and optimizer state together)"
                if stage == 3
                else "stage 0 has no sharded optimizer to offload"
            )
            raise ConfigError(f"strategy.offload=optimizer needs strategy.stage=1 or 2; {hint}.")
        if (
            sharding_group is not None
            and sharding_group != -1
            and (not isinstance(sharding_group, int) or isinstance(sharding_group, bool) or sharding_group < 1)
        ):
            raise ConfigError(f"strategy.sharding_group must be a positive int (ranks per sharding group) or null/-1 (all ranks). Got {sharding_group!r}.")
        if not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
            raise ConfigError(f"strategy.bucket_cap_mb should be a number greater than 0. Got {bucket_cap_mb!r}.")
        check_unit_policy(stage, per_block, shard_modules, shard_min_params)
        check_stage_knobs(stage, sharding_group=sharding_group, per_block=per_block, reshard_after_forward=reshard_after_forward,
                          prefetch=prefetch, bucket_cap_mb=bucket_cap_mb)
        self.stage = stage
        self.sharding_group = None if sharding_group in (None, -1) else sharding_group
        if stage == 0:
            dims = ParallelDims.request(dp=-1)
        elif self.sharding_group is None:
            dims = ParallelDims.request(dp=1, sharding=-1)
        else:
            dims = ParallelDims.request(dp=-1, sharding=self.sharding_group)
        options = ParallelOptions(zero_stage=stage, per_block=per_block, shard_modules=tuple(shard_modules) if shard_modules else None,
                                  shard_min_params=shard_min_params, reshard_after_forward=reshard_after_forward,
                                  prefetch=prefetch, offload=offload, bucket_mb=float(bucket_cap_mb))
        super().__init__(dims, options, save_distributed_checkpoint=save_distributed_checkpoint, timeout_s=timeout_s,
                         process_group_backend=process_group_backend)

    def _requested_dims(self, world_size: int) -> ParallelDims:
        group = self.sharding_group
        if self.stage and group is not None and world_size % group:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ConfigError(
                f"strategy.sharding_group={group} does not divide the world size {world_size} (trainer.devices × "
                f"trainer.num_nodes): ranks are split into groups of sharding_group. Use one of {divisors}."
            )
        return super()._requested_dims(world_size)


# The knobs that act at some stages only: (the stages where they take effect, why not at the others).
# shard_modules / shard_min_params are checked with the unit policy (check_unit_policy).
_STAGE_KNOBS = {
    "sharding_group": ((1, 2, 3), "stage 0 is plain data parallelism: nothing is sharded, so there are no sharding groups"),
    "per_block": ((3,), "only stage 3 shards the parameters, in units"),
    "reshard_after_forward": ((3,), "only stage 3 gathers sharded parameters for forward"),
    "prefetch": ((3,), "only stage 3 gathers parameters unit by unit before they are used"),
    "bucket_cap_mb": ((0, 1, 2), "stage 3 (FSDP2) communicates per sharding unit, not in buckets"),
}


def check_stage_knobs(stage: int, **given: Any) -> None:
    """A knob set away from its default at a stage that ignores it is an error, not a silent no-op:
    the user would believe, say, that ``bucket_cap_mb`` tuned a stage-3 run."""
    import inspect

    defaults = {name: p.default for name, p in inspect.signature(ZeroStrategy.__init__).parameters.items()}
    for name, value in given.items():
        stages, why = _STAGE_KNOBS[name]
        if name in ("per_block", "reshard_after_forward", "prefetch") and not isinstance(value, bool):
            raise ConfigError(f"strategy.{name} should be true or false. Got {value!r}.")
        unset = value == defaults[name] or (name == "sharding_group" and value == -1)  # -1 = null: all ranks
        if stage not in stages and not unset:
            where = ", ".join(str(s) for s in stages[:-1]) + (" or " if len(stages) > 1 else "") + str(stages[-1])
            shown = str(value).lower() if isinstance(value, bool) else value  # as the command line spells it
            raise ConfigError(f"strategy.{name}={shown} cannot take effect with strategy.stage={stage}: {why}. "
                              f"Drop it, or use strategy.stage={where}.")


def check_unit_policy(stage: int, per_block: bool, shard_modules: Any, shard_min_params: Any) -> None:
    """The stage-3 unit policy settings, before any process starts: each must be able to take effect."""
    if shard_modules is not None and (isinstance(shard_modules, str) or not all(isinstance(n, str) and n for n in shard_modules)):
        raise ConfigError(f"strategy.shard_modules should be a list of class names, e.g. [Block] or [mypkg.net.Block]. Got {shard_modules!r}.")
    if shard_min_params is not None and (not isinstance(shard_min_params, int) or isinstance(shard_min_params, bool) or shard_min_params < 1):
        raise ConfigError(f"strategy.shard_min_params should be an int greater than 0 (parameters per sharding unit) or null. Got {shard_min_params!r}.")
    chosen = [name for name, value in (("shard_modules", shard_modules), ("shard_min_params", shard_min_params)) if value]
    if chosen and stage != 3:
        raise ConfigError(
            f"strategy.{chosen[0]} chooses ZeRO-3's sharding units, but strategy.stage={stage} does not shard parameters. Use strategy.stage=3, or drop it."
        )
    if len(chosen) == 2:
        raise ConfigError("strategy.shard_modules and strategy.shard_min_params are two policies for the same units; set one of them.")
    if chosen and not per_block:
        raise ConfigError(f"strategy.per_block=false makes the whole model one sharding unit, so strategy.{chosen[0]} cannot take effect. Drop one of them.")
