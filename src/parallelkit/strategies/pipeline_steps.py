"""Pipeline parallel training inside Lightning's Trainer: the strategy owns the training step (``pp > 1``).

Each rank keeps only its stages of the model (cut by the model's pipeline plan: :mod:`parallelkit.models.plans`),
runs the whole micro-batch schedule (forward *and* backward) in ``training_step``, and data parallelism
averages the stage gradients over the ``dp`` mesh axis. Lightning's loop, callbacks, logging and checkpoints work as
usual; what it took:

- Lightning calls ``training_step``, then ``zero_grad``, then ``backward``. The schedule's gradients are
  therefore set aside in ``training_step`` and added back in :meth:`PipelineSteps.backward` (scaled by
  ``1 / accumulate_grad_batches``, as Lightning scales a returned loss), or training would do nothing.
- Clipping by norm must see the norm of the *whole* model: the stage norms are combined over the
  pipeline group before Lightning's own (then no-op) per-rank clipping.
- Only the last stage has the loss; it is broadcast over the pipeline group so every rank returns its
  data shard's true loss, and RunSummary's mean over all ranks is the global mean.
- Validation runs the schedule's forward-only path.
- Mixed precision: the precision plugin's autocast wraps each stage's forward and the loss (not backward, as
  with Lightning's own step); fp16's loss scale multiplies the last stage's loss, and the plugin's overflow
  check (over every rank) unscales and skips as for any strategy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed.tensor import DTensor

from parallelkit.distributed.comm_counting import counting
from parallelkit.distributed.comm_stats import REPORT
from parallelkit.distributed.loss_scaling import DynamicLossScaler
from parallelkit.distributed.parallel_dims import DP, PP
from parallelkit.distributed.pipeline_parallel import (
    PipelineParallel,
    check_microbatch_split,
    pipeline_spans,
    stage_blocks,
    stage_ids_for_rank,
    theoretical_bubble,
)
from parallelkit.errors import ConfigError
from parallelkit.models.plans import model_plans, parallel_model

PP_LOSS = "pp_loss"
PP_GRAD_NORM = "pp_grad_norm"
TRACE_DIR = "pipeline_trace"


def squared_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The squared 2-norm of this pipeline rank's gradients, whole over every other axis.

    A DTensor gradient (a tensor-parallel or FSDP shard) is reduced over its own mesh by DTensor itself,
    which knows which axes hold shards (summed) and which hold replicas (counted once); a plain tensor is
    the same on every rank that holds it.
    """
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        if isinstance(g, DTensor):
            total += torch.linalg.vector_norm(g, dtype=torch.float32).full_tensor().square()
        else:
            total += g.float().pow(2).sum()
    return total


class PipelineSteps:
    """The training and validation steps of a composed strategy whose model is cut into pipeline stages.

    Mixed in before :class:`~parallelkit.strategies.mesh.MeshStrategy`; every method falls through to the
    next base class while ``self.pipeline`` is None (``pp == 1``), so one strategy class runs both.
    """

    pipeline: PipelineParallel | None = None
    _params: list[torch.nn.Parameter] = []
    _step_grads: list[torch.Tensor | None] | None = None
    _blocks: list[list[int]] | None = None
    _scaler: Any = None
    _tied_duplicates: set[int] = set()

    # ---------------------------------------------------------------- before launch
    def check_pipeline_lightning_module(self, module: Any) -> None:
        """The schedule runs forward, loss and backward of the micro-batches itself, in place of ``training_step``."""
        name = type(module).__name__
        if not module.automatic_optimization:
            raise ConfigError(
                f"strategy={self.strategy_name} cannot train {name}: it uses manual optimization (automatic_optimization = "
                "False), but a pipeline schedule runs every micro-batch's forward and backward itself, across ranks, and "
                "then one optimizer step: there is no place for your own backward and step calls. Use automatic "
                "optimization with a model given as an nn.Module (forward(inputs), loss(outputs, targets)), or a strategy "
                "that runs Lightning's step, such as strategy=zero or strategy=ddp."
            )
        if parallel_model(module) is module:
            raise ConfigError(
                f"strategy={self.strategy_name} cannot run {name}.training_step: the pipeline schedule runs each stage's "
                "forward, the loss on the last stage and the backward itself, micro-batch by micro-batch, so a "
                "LightningModule's own training_step (and what it logs) would never run. Give the model as an nn.Module "
                "with forward(inputs) and loss(outputs, targets) and its pipeline plan (model._target_=mypkg.Net, see README "
                "\"Your own model\"), or use a strategy that runs your training_step, such as strategy=zero."
            )

    def check_pipeline_workload(self, model: torch.nn.Module, datamodule: Any = None) -> None:
        """Check the split and the micro-batches against the model and the batch plan (no process group)."""
        opts = self.options
        pp = self.requested_dims.pp
        who = f"strategy={self.strategy_name} with strategy.pp={pp}"
        stage_blocks(model_plans(model, self.plan_source).pipeline_blocks(who), pp * opts.virtual_stages,
                     list(opts.split) if opts.split else None)
        plan = getattr(datamodule, "plan", None)
        if plan is not None:
            what = (f"the per-rank batch (data.global_batch_size={plan.global_batch_size} / dp({plan.data_parallel_size}) "
                    f"/ accumulate({plan.accumulate}))")
            check_microbatch_split(plan.micro_batch_size, opts.microbatches, what)
            val = getattr(datamodule, "val_batch_size", None)
            if val:
                check_microbatch_split(val, opts.microbatches, f"data.val_batch_size={val}")

    def check_pipeline_precision(self) -> None:
        """The schedule runs forward and backward itself: it applies the precision plugin's autocast around each
        stage's forward and the loss, and scales the loss by the plugin's loss scaler (``callbacks=[amp]``, whose
        overflow check spans every rank, so that all stages skip a step together). A scaler that decides per rank
        (torch's ``GradScaler``) would let the stages disagree."""
        plugin = self.precision_plugin
        if getattr(plugin, "scaler", None) is not None and not isinstance(plugin.scaler, DynamicLossScaler):
            raise ConfigError(
                f"strategy={self.strategy_name} with strategy.pp={self.parallel_dims.pp} cannot use "
                f"{type(plugin).__name__} with torch's GradScaler: each pipeline stage would decide alone whether its "
                "gradients overflowed, and the stages would disagree about skipping a step. Use callbacks=[amp] "
                "callbacks.amp.dtype=fp16 (one loss scale, overflow checked over every rank), or trainer.precision=bf16-mixed."
            )

    # ---------------------------------------------------------------- setup
    def adopt_pipeline(self, pipeline: PipelineParallel, model: torch.nn.Module, blocks: list[list[int]],
                       tied_duplicates: list[torch.nn.Parameter] = ()) -> None:
        self.check_pipeline_precision()
        self.pipeline = pipeline
        # The stages' own parameters (a last stage's copy of a tied embedding is not a module of the model).
        self._params = list({id(p): p for m in pipeline.stages for p in m.submod.parameters() if p.requires_grad}.values())
        self._tied_duplicates = {id(p) for p in tied_duplicates}
        self._blocks = blocks
        forward_context, scaler = self.precision_plugin.forward_context, getattr(self.precision_plugin, "scaler", None)
        for stage in pipeline.stages:
            autocast_forward(stage.submod, forward_context)
        pipeline.schedule._loss_fn = scaled_loss(pipeline.schedule._loss_fn, forward_context, scaler)
        self._scaler = scaler

    # ---------------------------------------------------------------- the step
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().training_step(*args, **kwargs)
        batch = args[0] if args else kwargs["batch"]
        inputs, targets = batch
        check_microbatch_split(len(inputs), self.pipeline.microbatches)
        # Run the schedule on fresh gradients: it divides the .grad it finds by the micro-batch count,
        # which would also shrink gradients accumulated over earlier batches.
        kept = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        loss = self.pipeline.train_step(inputs, targets)
        # Lightning zeroes gradients after training_step: keep these until backward().
        self._step_grads = [p.grad for p in self._params]
        for p, grad in zip(self._params, kept):
            p.grad = grad
        return self._loss_from_last_stage(loss)

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        if self._step_grads is None:
            raise RuntimeError("PipelineStrategy.backward() without a training_step: Lightning's call order changed")
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)  # on_before_backward hooks
        scale = 1.0 / module.trainer.accumulate_grad_batches
        for param, grad in zip(self._params, self._step_grads):
            if grad is None:
                continue
            if scale != 1.0:
                grad.mul_(scale)
            param.grad = grad if param.grad is None else param.grad.add_(grad)
        self._step_grads = None
        return self.precision_plugin.post_backward(closure_loss, module)  # on_after_backward hooks

    @torch.no_grad()
    def after_grad_sync(self) -> None:
        """Clip by the norm of the whole model: the stages' squared norms summed over the pipeline group."""
        super().after_grad_sync()
        if self.pipeline is None:
            return
        trainer = self.lightning_module.trainer
        max_norm, algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
        if not max_norm or (algorithm is not None and algorithm != "norm"):
            return  # clipping by value is per element: Lightning's own clipping is already right
        if self._scaler is not None:
            max_norm = float(max_norm) * self._scaler.scale  # the gradients are still scaled here (unscaled after the closure)
        grads = [p.grad for p in self._params if p.grad is not None]
        # A weight tied between the first and last stage is one weight: its second copy stays out of the norm.
        sq = squared_norm([p.grad for p in self._params if p.grad is not None and id(p) not in self._tied_duplicates], self.root_device)
        if self.parallel_dims.pp > 1:
            group = self.device_mesh.get_group(PP)
            with counting(self.comm_stats, PP_GRAD_NORM):
                dist.all_reduce(sq, group=group)
        coef = torch.clamp(float(max_norm) / (sq.sqrt() + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.item() if isinstance(g, DTensor) else coef.to(g.dtype))
        # Lightning's per-rank clipping then finds every stage under max_norm and leaves it unchanged.

    def _loss_from_last_stage(self, loss: torch.Tensor | None) -> torch.Tensor:
        """Every rank gets its data shard's mean loss (computed on the last stage only)."""
        if loss is not None and hasattr(loss, "to_local"):
            loss = loss.to_local()  # under loss_parallel a replicated DTensor: every tp rank holds the value
        if loss is not None and self._scaler is not None:
            loss = loss / self._scaler.scale  # the schedule's losses are the scaled ones backward ran on
        value = loss.detach().float().reshape(()) if loss is not None else torch.zeros((), device=self.root_device)
        pp = self.parallel_dims.pp
        if pp > 1:
            source = last_stage_rank(pp, self.options.virtual_stages, self.options.schedule)
            group = self.device_mesh.get_group(PP)
            with counting(self.comm_stats, PP_LOSS):
                dist.broadcast(value, group_src=source, group=group)
        return value

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().validation_step(*args, **kwargs)
        batch = args[0] if args else kwargs["batch"]
        inputs, targets = batch
        check_microbatch_split(len(inputs), self.pipeline.microbatches, "the validation batch")
        loss = self._loss_from_last_stage(self.pipeline.eval_step(inputs, targets))
        self.lightning_module.log("val_loss", loss, prog_bar=True, sync_dist=True, on_epoch=True)
        return loss

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().test_step(*args, **kwargs)
        raise ConfigError(f"strategy={self.strategy_name} with a pipeline runs fit and validate; test/predict are not wired to the schedule.")

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is None:
            return super().predict_step(*args, **kwargs)
        return self.test_step(*args, **kwargs)

    def pipeline_param_groups_key(self) -> str:
        # each pipeline rank's optimizer lists its own stages' parameters (see MeshStrategy.param_groups_key)
        return "_stages_" + "_".join(map(str, self.pipeline.stage_ids)) if self.pipeline is not None else ""

    # ---------------------------------------------------------------- measurements
    def summary_metrics(self, trainer: Any) -> dict[str, Any]:
        metrics = super().summary_metrics(trainer)
        if self.pipeline is None:
            return metrics
        with self.comm_stats.counting_as(REPORT), counting(self.comm_stats, "metrics"):  # end-of-run gathers: not a training step's traffic
            metrics.update(self._pipeline_metrics(trainer))
        return metrics

    def _pipeline_metrics(self, trainer: Any) -> dict[str, Any]:
        stats, world = self.pipeline.stats, self.world_size
        num_stages, pp = self.pipeline.num_stages, self.parallel_dims.pp
        opts = self.options
        # The bubble is measured against the pipeline's step time: the longest first-to-last-compute
        # time of its ranks, per step (the first stage's: it starts first and finishes last).
        active = torch.tensor(stats.step_active, dtype=torch.float64)
        pp_active = [torch.zeros_like(active) for _ in range(pp)]
        dist.all_gather(pp_active, active, group=self.device_mesh.get_group(PP))
        bubble = stats.bubble_fraction(pipeline_spans([a.tolist() for a in pp_active]))
        local = torch.tensor([-1.0 if bubble is None else bubble, float(self.pipeline.meter.peak)], dtype=torch.float64)
        inflight = torch.full((num_stages,), -1.0, dtype=torch.float64)
        for stage, peak in stats.peak_inflight.items():
            inflight[stage] = peak
        gathered = [torch.zeros_like(local) for _ in range(world)]
        dist.all_gather(gathered, local)
        dist.all_reduce(inflight, op=dist.ReduceOp.MAX)
        by_rank = [round(float(g[0]), 4) for g in gathered]
        if opts.trace:
            self._write_trace(Path(trainer.default_root_dir))
        return {"pipeline": {
            "schedule": opts.schedule,
            "pp": pp,
            "microbatches": opts.microbatches,
            "virtual_stages": opts.virtual_stages,
            "stage_blocks": self._blocks,
            "bubble_fraction": sum(by_rank) / len(by_rank),
            "bubble_fraction_by_rank": by_rank,
            "bubble_fraction_theory": theoretical_bubble(pp, opts.microbatches, opts.virtual_stages),
            "peak_inflight_microbatches_by_stage": [int(v) for v in inflight.tolist()],
            "peak_activation_bytes": int(max(float(g[1]) for g in gathered)),
            "trace_dir": str(Path(trainer.default_root_dir) / TRACE_DIR) if opts.trace else None,
        }}

    def _write_trace(self, out: Path) -> None:
        trace_dir = out / TRACE_DIR
        trace_dir.mkdir(parents=True, exist_ok=True)
        coords = self.parallel_dims.coordinates(self.global_rank)
        record = {
            "rank": self.global_rank, "pp_rank": coords[PP], "dp_rank": coords[DP], "pp": self.parallel_dims.pp,
            "schedule": self.options.schedule, "microbatches": self.options.microbatches,
            "virtual_stages": self.options.virtual_stages,
            "stage_ids": self.pipeline.stage_ids, "steps": self.pipeline.stats.events,
        }
        (trace_dir / f"rank{self.global_rank}.json").write_text(json.dumps(record))
        rank_zero_info(f"Pipeline trace in {trace_dir}; draw it with `python -m parallelkit.tools.pipeline_timeline {out}`")


def last_stage_rank(pp: int, virtual_stages: int, schedule: str) -> int:
    """The pipeline rank holding the last stage (``S-1 % pp`` in a loop; rank 0 in a V: ``zbv``)."""
    last = pp * virtual_stages - 1
    return next(r for r in range(pp) if last in stage_ids_for_rank(r, pp, virtual_stages, schedule))


def autocast_forward(module: torch.nn.Module, forward_context: Callable[[], Any]) -> None:
    """Run ``module``'s forward inside the precision plugin's context (autocast), as Lightning runs
    ``training_step``; backward stays outside it, as with Lightning's own backward."""
    forward = module.forward

    def forward_in_context(*args: Any, **kwargs: Any) -> Any:
        with forward_context():
            return forward(*args, **kwargs)

    module.forward = forward_in_context


def scaled_loss(loss_fn: Callable[..., torch.Tensor], forward_context: Callable[[], Any], scaler: Any) -> Callable[..., torch.Tensor]:
    """The last stage's loss inside the precision context, multiplied by the loss scale (fp16) before the
    schedule's backward: every stage's gradients come out scaled, as Lightning's ``pre_backward`` scales them."""

    def loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with forward_context():
            value = loss_fn(outputs, targets)
        return value * scaler.scale if scaler is not None else value

    return loss
