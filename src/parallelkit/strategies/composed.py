"""The one composed strategy: every degree, every technique, on Lightning's Trainer.

:class:`ComposedStrategy` holds one requested :class:`~parallelkit.distributed.parallel_dims.ParallelDims` and
one :class:`~parallelkit.distributed.parallelize.ParallelOptions`, and applies them with
:func:`~parallelkit.distributed.parallelize.parallelize` (TP+SP → EP → pipeline split → FSDP/ZeRO/DP → schedule).
``strategy=zero``, ``tp``, ``pp``, ``moe`` and ``hybrid4d`` are presets of it (:mod:`parallelkit.strategies.presets`):
their own arguments and defaults, translated into degrees and options, and nothing else.

The steps follow what the composition made: Lightning's own step inside the TP context
(:class:`~parallelkit.strategies.tp.TensorParallelSteps`), or the pipeline's schedule owning the step when
``pp > 1`` (:class:`~parallelkit.strategies.pipeline_steps.PipelineSteps`); ZeRO stages 1-2 shard the optimizer
once it exists.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from typing_extensions import override

from parallelkit.capabilities import (
    LIGHTNING_BACKWARD,
    MIXED_PRECISION,
    REPLICATED_PARAMS,
)
from parallelkit.distributed.checkpoint_io import (
    fqn_optimizer_states,
    fqn_to_index,
    load_unsharded,
)
from parallelkit.distributed.context_parallel import CP_MODES, check_context_parallel
from parallelkit.distributed.elastic import DEFAULT_TIMEOUT_S
from parallelkit.distributed.expert_parallel import (
    MOE_ALL_TO_ALL,
    check_expert_parallel,
)
from parallelkit.distributed.parallel_dims import DEFAULT_MESH_ORDER, ParallelDims
from parallelkit.distributed.parallelize import (
    ParallelOptions,
    apply_optimizer_sharding,
    expert_plan_if_moe,
    parallelize,
)
from parallelkit.distributed.pipeline_parallel import (
    check_pipeline_config,
    default_virtual_stages,
)
from parallelkit.distributed.zero_optimizer import ZeroOptimizer
from parallelkit.errors import ConfigError
from parallelkit.models.plans import model_plans
from parallelkit.strategies.mesh import MeshStrategy
from parallelkit.strategies.pipeline_steps import PipelineSteps
from parallelkit.strategies.tensor_parallel_steps import (
    TensorParallelSteps,
    say_if_experts_replicated,
)

OFFLOAD_CHOICES = ("none", "optimizer", "params")


class ComposedStrategy(TensorParallelSteps, PipelineSteps, MeshStrategy):
    """Any combination of ``dp × sharding × cp × tp (+SP) × pp × ep`` on one named mesh.

    Args:
        dims: the requested degrees (``ParallelDims.request(...)``, a ``-1`` takes the remaining ranks).
        options: how the techniques are applied (:class:`~parallelkit.distributed.parallelize.ParallelOptions`).
        plan: where the model's plans are (``mypkg.parallelize``); ``None``: the model's own methods, then the
            ``parallelize`` module beside its class (:mod:`parallelkit.models.plans`).
        name: the strategy's name in messages and ``summary.json`` (the preset's).
        accumulate_grad_batches: the gradient accumulation this layout was planned with (``strategy=auto``'s
            choice), set as ``trainer.accumulate_grad_batches``; ``None``: the Trainer's own.
        auto_plan: what chose this layout (``strategy=auto``'s ranking and estimates), kept in ``summary.json``
            beside what was measured.
        save_distributed_checkpoint / timeout_s / process_group_backend: see :class:`MeshStrategy`.

    Example::

        ComposedStrategy(ParallelDims.request(dp=-1, tp=2, pp=2), ParallelOptions(sequence_parallel=True))
    """

    strategy_name = "composed"

    def __init__(self, dims: ParallelDims, options: ParallelOptions | None = None, *, plan: str | None = None,
                 name: str | None = None, accumulate_grad_batches: int | None = None, auto_plan: dict[str, Any] | None = None,
                 save_distributed_checkpoint: bool = True, timeout_s: float = DEFAULT_TIMEOUT_S,
                 process_group_backend: str | None = None) -> None:
        super().__init__(dims=dims, save_distributed_checkpoint=save_distributed_checkpoint, timeout_s=timeout_s,
                         process_group_backend=process_group_backend)
        if name is not None:
            self.strategy_name = name
        self.options = options = options if options is not None else ParallelOptions()
        self.plan_source = plan
        self.accumulate_grad_batches = accumulate_grad_batches
        self.auto_plan = auto_plan
        check_options(dims, options)
        self.capabilities = capabilities_of(dims, options)
        self.zero_optimizers: list[ZeroOptimizer] = []
        self.tensor_parallel = None
        self.context_parallel = None
        self.ep_handle = None
        self.expert_dp_group = None
        self._all_to_all_bytes_seen = 0

    # ---------------------------------------------------------------- before launch
    @override
    def default_devices(self, accelerator: str) -> int:
        """On CPU without ``trainer.devices``: the smallest world the degrees fit (a ``-1`` degree takes 1; 2 for plain
        data parallelism)."""
        if accelerator == "gpu":
            return super().default_devices(accelerator)
        fixed = math.prod(v for v in self.requested_dims.degrees.values() if v != -1)
        return fixed if fixed > 1 else 2

    @override
    def check_lightning_module(self, module: Any) -> None:
        if self.requested_dims.pp_enabled:
            self.check_pipeline_lightning_module(module)

    @override
    def check_model(self, model: torch.nn.Module, world_size: int) -> None:
        """Before launch: the model can be split as planned (heads % tp, experts % ep; the pipeline's blocks are
        checked by :meth:`check_workload`)."""
        dims = self.plan(world_size)
        plans = model_plans(model, self.plan_source)
        if dims.tp_enabled:
            plans.tensor_parallel_plan(dims.tp, sequence_parallel=self.options.sequence_parallel,
                                       who=f"strategy={self.strategy_name} with strategy.tp={dims.tp}")
            if not dims.ep_enabled:
                say_if_experts_replicated(model, self.plan_source, f"strategy={self.strategy_name} with strategy.tp={dims.tp}")
        if dims.ep_enabled:
            check_expert_parallel(plans.expert_parallel_plan(who=f"strategy={self.strategy_name} with strategy.ep={dims.ep}"), dims.ep)
        if dims.cp_enabled:
            plan = plans.context_parallel_plan(who=f"strategy={self.strategy_name} with strategy.cp={dims.cp}")
            check_context_parallel(plan, dims.cp, self.options.cp_mode, tp=dims.tp)

    @override
    def check_workload(self, model: torch.nn.Module, datamodule: Any = None) -> None:
        if self.requested_dims.pp_enabled:
            self.check_pipeline_workload(model, datamodule)
        seq_len = getattr(datamodule, "seq_len", None)
        dims = self.requested_dims
        if dims.cp_enabled and isinstance(seq_len, int):
            check_context_parallel_sequence(seq_len, dims.cp, dims.tp if self.options.sequence_parallel else 1)

    @override
    def bind_trainer_config(self, trainer_cfg: dict[str, Any]) -> None:
        if self.accumulate_grad_batches is not None:  # run.py cuts the batch and builds the Trainer from trainer_cfg after this
            trainer_cfg["accumulate_grad_batches"] = self.accumulate_grad_batches
        refuse_norm_clipping_with_experts(self.strategy_name, self.requested_dims.ep, trainer_cfg.get("gradient_clip_val"),
                                          trainer_cfg.get("gradient_clip_algorithm"))

    # ---------------------------------------------------------------- setup
    def check_trainer(self, trainer: Any) -> None:
        """Refuse what would silently go wrong: with ``ep > 1`` a gradient norm sees only this rank's experts."""
        refuse_norm_clipping_with_experts(self.strategy_name, self.requested_dims.ep, trainer.gradient_clip_val,
                                          trainer.gradient_clip_algorithm)

    @override
    def setup(self, trainer: Any) -> None:
        self.check_trainer(trainer)
        super().setup(trainer)

    @override
    def parallelize(self, model: torch.nn.Module) -> None:
        if self.parallel_dims.pp_enabled:
            self.check_pipeline_workload(model)
        done = parallelize(model, self.parallel_dims, self.device_mesh, model_plans(model, self.plan_source), self.options,
                           rank=self.global_rank, device=self.root_device, comm_stats=self.comm_stats)
        # The one place the composition's results become the strategy's.
        self.tensor_parallel = done.tensor_parallel
        self.context_parallel = done.context_parallel
        self.ep_handle = done.ep_handle
        self.expert_dp_group = done.expert_dp_group
        self.grad_syncs.extend(done.grad_syncs)
        if done.pipeline is not None:
            self.adopt_pipeline(done.pipeline, model, done.stage_blocks, done.tied_embeddings.duplicates)

    @override
    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        """Context parallelism: this rank keeps its two chunks of every sequence (the cp ranks read the same batch)."""
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return self.context_parallel.cut_batch(batch) if self.context_parallel is not None else batch

    @override
    def shard_optimizers(self) -> None:
        """ZeRO stages 1-2: shard the optimizer state (and gradients) over ``sharding`` now that it exists."""
        dims = self.parallel_dims
        if not (dims.sharding_enabled and self.options.zero_stage in (1, 2)):
            return
        clip = getattr(self.lightning_module.trainer, "gradient_clip_val", None)
        if clip:
            raise ConfigError(
                f"trainer.gradient_clip_val={clip} with strategy={self.strategy_name} at ZeRO stage {self.options.zero_stage}: "
                "each rank holds only its slice of the gradients, and clipping them by norm is not implemented yet. "
                "Use stage 0 or 3, or no clipping."
            )
        names = {p: name for name, p in self.lightning_module.named_parameters()}
        self.zero_optimizers = apply_optimizer_sharding(self.optimizers, dims, self.device_mesh, self.options, names, self.comm_stats)
        self.grad_syncs.extend(_ReduceGradients(zero) for zero in self.zero_optimizers)

    @override
    def after_optimizer_step(self) -> None:
        for zero in self.zero_optimizers:
            zero.all_gather_params()

    # ---------------------------------------------------------------- accounting
    @override
    def model_state_bytes(self) -> dict[str, int]:
        if not self.zero_optimizers:
            return super().model_state_bytes()
        totals = {"params": 0, "grads": 0, "optimizer": 0}
        for zero in self.zero_optimizers:
            for key, value in zero.state_bytes().items():
                totals[key] += value
        return totals

    def step_metrics(self) -> dict[str, float]:
        """This rank's token all-to-all bytes of the step that just finished (a ``metrics.csv`` column; MoE only)."""
        if self.ep_handle is None:
            return {}
        total = self.comm_stats.bytes(MOE_ALL_TO_ALL)
        step, self._all_to_all_bytes_seen = total - self._all_to_all_bytes_seen, total
        return {"moe_all_to_all_bytes": step}

    @override
    def summary_metrics(self, trainer: Any) -> dict[str, Any]:
        metrics = super().summary_metrics(trainer)
        if self.ep_handle is not None:
            metrics["expert_parallel"] = {"ep": self.parallel_dims.ep, "local_experts": self.ep_handle.local_experts}
        if self.context_parallel is not None:
            metrics["context_parallel"] = self.context_parallel.summary()
        if self.auto_plan is not None:
            metrics["auto_plan"] = self.auto_plan
        return metrics

    # ---------------------------------------------------------------- checkpoints
    @override
    def param_groups_key(self) -> str:
        # Ranks that hold different parameters (pipeline stages, expert shards) name their optimizer groups after
        # what they hold, so each saves and finds its own (see MeshStrategy.param_groups_key).
        key = super().param_groups_key() + self.pipeline_param_groups_key()
        if self.ep_handle is not None and self.parallel_dims.ep_enabled:
            key += "_experts_" + "_".join(map(str, self.ep_handle.local_experts))
        return key

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        zero = self._zero_for(optimizer)
        return zero.full_state_dict() if zero is not None else super().optimizer_state(optimizer)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self.replicated_params:
            return self._load_replicated_checkpoint(checkpoint_path)
        if self.pipeline is not None or self.ep_handle is not None:
            # A stage's or an expert shard's parameters (plain tensors beside any DTensors): each rank reads its own.
            return self._load_per_rank_checkpoint(checkpoint_path, weights_only)
        return super().load_checkpoint(checkpoint_path, weights_only)

    @property
    def replicated_params(self) -> bool:
        return REPLICATED_PARAMS in self.capabilities

    def _load_replicated_checkpoint(self, checkpoint_path: Any) -> dict[str, Any]:
        """Every rank holds whole parameters: load the unsharded checkpoint (a file or a directory, of any layout that
        holds them whole), keep this rank's optimizer slices (ZeRO 1-2)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        checkpoint = load_unsharded(path)
        module = self.lightning_module
        module.load_state_dict(checkpoint.pop("state_dict"), strict=module.strict_loading)
        names = [name for name, _ in module.named_parameters()]
        states = fqn_optimizer_states(checkpoint, names)
        for index, optimizer in enumerate(self.optimizers):
            zero = self._zero_for(optimizer)
            if zero is not None:
                zero.load_full_state_dict(states[index])
            else:
                optimizer.load_state_dict(fqn_to_index(states[index], names))
        for key in [k for k in checkpoint if k.startswith("optimizer_")]:
            del checkpoint[key]
        return checkpoint

    def _zero_for(self, optimizer: Any) -> ZeroOptimizer | None:
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        return next((z for z in self.zero_optimizers if z.optimizer is optimizer), None)


class _ReduceGradients:
    """Adapts ZeRO stages 1-2's gradient reduce-scatter to the strategy's ``grad_syncs`` interface."""

    def __init__(self, zero: ZeroOptimizer) -> None:
        self.zero = zero

    def sync(self) -> None:
        self.zero.reduce_gradients()


def check_options(dims: ParallelDims, options: ParallelOptions) -> None:
    """Refuse, before launch, an option that cannot take effect with these degrees (naming it and why)."""
    if options.zero_stage not in (0, 1, 2, 3) or isinstance(options.zero_stage, bool):
        raise ConfigError(f"strategy.stage must be 0, 1, 2 or 3. Got {options.zero_stage!r}.")
    if options.zero_stage == 0 and dims.sharding != 1:
        raise ConfigError(f"strategy.stage=0 shards nothing, but strategy.sharding={dims.sharding}. Use stage 1, 2 or 3, or sharding=1.")
    if options.offload not in OFFLOAD_CHOICES:
        raise ConfigError(f"strategy.offload must be one of {', '.join(OFFLOAD_CHOICES)}. Got {options.offload!r}.")
    if not isinstance(options.sequence_parallel, bool):
        raise ConfigError(f"strategy.sequence_parallel should be true or false. Got {options.sequence_parallel!r}.")
    if options.sequence_parallel and dims.tp == 1:
        raise ConfigError("strategy.sequence_parallel=true needs strategy.tp > 1: sequence parallelism splits the "
                          "regions between tensor-parallel layers over the tp ranks. Set strategy.tp, or drop it.")
    if options.zero_stage in (1, 2) and dims.sharding != 1 and (dims.tp != 1 or dims.pp != 1 or dims.ep != 1 or dims.cp != 1):
        raise ConfigError(
            f"ZeRO stage {options.zero_stage} (optimizer sharding over strategy.sharding) composes with data parallelism only "
            f"in this version; with tp({dims.tp}) × pp({dims.pp}) × ep({dims.ep}) × cp({dims.cp}) use stage 3 (FSDP2), which "
            "composes with every axis."
        )
    if options.cp_mode not in CP_MODES:
        raise ConfigError(f"strategy.cp_mode must be one of {', '.join(CP_MODES)}. Got {options.cp_mode!r}.")
    if dims.pp > 1:
        check_pipeline_config(dims.pp, options.microbatches, options.schedule, options.virtual_stages)


def capabilities_of(dims: ParallelDims, options: ParallelOptions) -> frozenset[str]:
    """What callbacks may rely on with these degrees: Lightning's backward without a pipeline; whole parameters on
    every rank without tp/pp/ep splitting them and without stage-3 sharding; mixed precision always."""
    caps = {MIXED_PRECISION}
    if dims.pp == 1:
        caps.add(LIGHTNING_BACKWARD)
    # cp ranks hold whole parameters but must average gradients over cp too, which a callback's own gradient
    # exchange (DGC, Local SGD) does not know: REPLICATED_PARAMS (what those ask for) only without cp.
    if dims.tp == 1 and dims.pp == 1 and dims.ep == 1 and dims.cp == 1 and (dims.sharding == 1 or options.zero_stage < 3):
        caps.add(REPLICATED_PARAMS)
    return frozenset(caps)


def check_context_parallel_sequence(seq_len: int, cp: int, sp_tp: int = 1) -> None:
    """``data.seq_len`` cuts into ``2·cp`` chunks (and, under sequence parallelism, each rank's part into ``tp``)."""
    from parallelkit.distributed.context_parallel import load_balanced_positions

    load_balanced_positions(seq_len, cp, 0)  # the 2·cp message
    if (seq_len // cp) % sp_tp:
        raise ConfigError(f"data.seq_len={seq_len} with strategy.cp={cp} and sequence parallelism over tp={sp_tp}: each rank's "
                          f"{seq_len // cp} tokens must split into {sp_tp}. Pick data.seq_len a multiple of {2 * cp * sp_tp}.")


def refuse_norm_clipping_with_experts(name: str, ep: int, clip: Any, algorithm: Any) -> None:
    if ep > 1 and clip and (algorithm or "norm") == "norm":
        raise ConfigError(
            f"strategy={name} with strategy.ep={ep} does not support trainer.gradient_clip_val={clip} by norm: each "
            "rank holds different experts, so each would compute a different gradient norm and the replicas would "
            "drift apart. Use trainer.gradient_clip_algorithm=value, or leave gradient_clip_val null."
        )


def pipeline_options(microbatches: int, schedule: str, virtual_stages: int | None, split: list[int] | None,
                     trace: bool) -> dict[str, Any]:
    """The pipeline's :class:`ParallelOptions` fields from the command-line knobs (``virtual_stages`` by schedule)."""
    virtual = default_virtual_stages(schedule) if virtual_stages is None else virtual_stages
    return dict(microbatches=microbatches, schedule=schedule, virtual_stages=virtual,
                split=tuple(split) if split else None, trace=bool(trace))


__all__ = ["ComposedStrategy", "DEFAULT_MESH_ORDER", "OFFLOAD_CHOICES", "capabilities_of", "check_options",
           "expert_plan_if_moe", "pipeline_options"]
