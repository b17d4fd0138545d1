"""Pipeline parallel training inside Lightning's Trainer: the strategy owns the training step.

Each rank keeps only its stages of the model (cut by the model's pipeline plan: :mod:`parallelkit.models.plans`),
runs the whole micro-batch schedule (forward *and* backward) in ``training_step``, and data parallelism
averages the stage gradients over the ``dp`` mesh axis. Lightning's loop, callbacks, logging and checkpoints work as
usual; what it took (DESIGN.md §7):

- Lightning calls ``training_step``, then ``zero_grad``, then ``backward``. The schedule's gradients are
  therefore set aside in ``training_step`` and added back in :meth:`PipelineStrategy.backward` (scaled by
  ``1 / accumulate_grad_batches``, as Lightning scales a returned loss), or training would do nothing.
- Clipping by norm must see the norm of the *whole* model: the stage norms are combined over the
  pipeline group before Lightning's own (then no-op) per-rank clipping.
- Only the last stage has the loss; it is broadcast over the pipeline group so every rank returns its
  data shard's true loss, and RunSummary's mean over all ranks is the global mean.
- Validation runs the schedule's forward-only path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch.distributed.tensor import DTensor
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from parallelkit.distributed.comm_counting import counting
from parallelkit.distributed.comm_stats import REPORT
from parallelkit.distributed.elastic import DEFAULT_TIMEOUT_S
from parallelkit.distributed.grad_sync import GradAllReduce, apply_grad_allreduce
from parallelkit.distributed.parallel_dims import DEFAULT_MESH_ORDER, DP, PP
from parallelkit.distributed.pipeline_parallel import (
    PipelineParallel,
    apply_pp,
    check_microbatch_split,
    check_pipeline_config,
    default_virtual_stages,
    pipeline_spans,
    stage_blocks,
    stage_ids_for_rank,
    theoretical_bubble,
)
from parallelkit.errors import ConfigError
from parallelkit.models.plans import model_plans, parallel_model
from parallelkit.strategies.mesh import MeshStrategy

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


class PipelineStrategy(MeshStrategy):
    """Pipeline parallel over the ``pp`` mesh axis, data parallel over ``dp``.

    Args:
        pp: pipeline ranks (stages per pipeline = ``pp × virtual_stages``).
        dp: data-parallel replicas of the pipeline (``-1``: the remaining ranks).
        microbatches: micro-batches each rank's batch is cut into per step.
        schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b`` or ``zero_bubble``.
        virtual_stages: stages per rank for the interleaved schedules (default 2 there, else 1).
        split: the first block of stages 1..S-1 (default: balanced blocks).
        trace: record every compute and send/recv wait; written to ``DIR/pipeline_trace/`` at the end.
        plan: where the model's pipeline plan is (``mypkg.parallelize``); ``None``: the model's own methods,
            then the ``parallelize`` module beside its class (:mod:`parallelkit.models.plans`).
        save_distributed_checkpoint / timeout_s / process_group_backend: see :class:`MeshStrategy`.

    Example::

        Trainer(strategy=PipelineStrategy(pp=2, microbatches=4, schedule="1f1b"), devices=4)  # dp = 2
    """

    strategy_name = "pp"
    capabilities = frozenset()  # the schedule runs backward; parameters are split over stages

    def __init__(
        self,
        pp: int = 2,
        dp: int = -1,
        microbatches: int = 4,
        schedule: str = "1f1b",
        virtual_stages: int | None = None,
        split: list[int] | None = None,
        trace: bool = False,
        plan: str | None = None,
        mesh_order: tuple[str, ...] | list[str] = DEFAULT_MESH_ORDER,
        save_distributed_checkpoint: bool = True,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        process_group_backend: str | None = None,
    ) -> None:
        if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
            raise ConfigError(f"strategy.pp should be an int greater than 0 (pipeline ranks). Got {pp!r}.")
        virtual_stages = default_virtual_stages(schedule) if virtual_stages is None else virtual_stages
        check_pipeline_config(pp, microbatches, schedule, virtual_stages)
        super().__init__(dp=dp, pp=pp, mesh_order=mesh_order, save_distributed_checkpoint=save_distributed_checkpoint,
                         timeout_s=timeout_s, process_group_backend=process_group_backend)
        self.pp, self.microbatches, self.schedule = pp, microbatches, schedule
        self.virtual_stages = virtual_stages
        self.split = None if split is None else list(split)
        self.trace = bool(trace)
        self.plan_source = plan
        self.pipeline: PipelineParallel | None = None
        self._params: list[torch.nn.Parameter] = []
        self._step_grads: list[torch.Tensor | None] | None = None

    # ---------------------------------------------------------------- before launch
    @override
    def check_lightning_module(self, module: Any) -> None:
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

    @override
    def check_workload(self, model: torch.nn.Module, datamodule: Any = None) -> None:
        """Check the split and the micro-batches against the model and the batch plan (no process group)."""
        who = f"strategy={self.strategy_name} with strategy.pp={self.pp}"
        stage_blocks(model_plans(model, self.plan_source).pipeline_blocks(who), self.pp * self.virtual_stages, self.split)
        plan = getattr(datamodule, "plan", None)
        if plan is not None:
            what = (f"the per-rank batch (data.global_batch_size={plan.global_batch_size} / dp({plan.data_parallel_size}) "
                    f"/ accumulate({plan.accumulate}))")
            check_microbatch_split(plan.micro_batch_size, self.microbatches, what)
            val = getattr(datamodule, "val_batch_size", None)
            if val:
                check_microbatch_split(val, self.microbatches, f"data.val_batch_size={val}")

    # ---------------------------------------------------------------- setup
    @override
    def parallelize(self, model: torch.nn.Module) -> None:
        if type(self.precision_plugin) is not Precision:
            raise ConfigError(
                f"strategy=pp runs backward inside the pipeline schedule and supports trainer.precision=32-true only; "
                f"got the {type(self.precision_plugin).__name__} plugin."
            )
        self.check_workload(model)
        plans = model_plans(model, self.plan_source)
        num_stages = self.pp * self.virtual_stages
        blocks = stage_blocks(plans.pipeline_blocks(), num_stages, self.split)
        pp_rank = self.parallel_dims.coordinates(self.global_rank)[PP]
        stage_ids = stage_ids_for_rank(pp_rank, self.pp, self.virtual_stages, self.schedule)
        loss_fn = plans.pipeline_loss()  # before the cut: a loss may need modules of the model
        stage_modules = plans.pipeline_stages(blocks, stage_ids)  # drops the other stages' modules
        # Data parallelism before the stages are wrapped: FSDP2 must shard the modules the schedule runs
        # (the stage then drives FSDP's gradient reduction once per step, after the last micro-batch).
        self.grad_syncs.extend(self.apply_data_parallel(stage_modules))
        self.pipeline = apply_pp(
            stage_modules, stage_ids, num_stages, self.device_mesh.get_group(PP),
            microbatches=self.microbatches, schedule=self.schedule, loss_fn=loss_fn,
            device=self.root_device, comm_stats=self.comm_stats, trace=self.trace,
        )
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._blocks = [[b.start, b.stop] for b in blocks]

    def apply_data_parallel(self, stage_modules: list[torch.nn.Module]) -> list[GradAllReduce]:
        """Data parallel on the remaining ranks: each stage's gradients averaged over its ``dp`` peers; returns the
        gradient syncs for :meth:`parallelize` to keep.

        A hybrid strategy overrides this to shard the stages instead (FSDP2 over ``(dp, sharding)``).
        """
        params = [p for m in stage_modules for p in m.parameters() if p.requires_grad]
        return [apply_grad_allreduce(params, self.device_mesh.get_group(DP), comm_stats=self.comm_stats)]

    # ---------------------------------------------------------------- the step
    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        check_microbatch_split(len(inputs), self.microbatches)
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

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
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

    @override
    @torch.no_grad()
    def after_grad_sync(self) -> None:
        """Clip by the norm of the whole model: the stages' squared norms summed over the pipeline group."""
        trainer = self.lightning_module.trainer
        max_norm, algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
        if not max_norm or (algorithm is not None and algorithm != "norm"):
            return  # clipping by value is per element: Lightning's own clipping is already right
        grads = [p.grad for p in self._params if p.grad is not None]
        sq = squared_norm(grads, self.root_device)
        if self.pp > 1:
            group = self.device_mesh.get_group(PP)
            with counting(self.comm_stats, PP_GRAD_NORM):
                dist.all_reduce(sq, group=group)
        coef = torch.clamp(float(max_norm) / (sq.sqrt() + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.item() if isinstance(g, DTensor) else coef.to(g.dtype))
        # Lightning's per-rank clipping then finds every stage under max_norm and leaves it unchanged.

    def _loss_from_last_stage(self, loss: torch.Tensor | None) -> torch.Tensor:
        """Every rank gets its data shard's mean loss (computed on the last stage only)."""
        value = loss.detach().float().reshape(()) if loss is not None else torch.zeros((), device=self.root_device)
        if self.pp > 1:
            source = (self.pipeline.num_stages - 1) % self.pp  # the pipeline rank holding the last stage
            group = self.device_mesh.get_group(PP)
            with counting(self.comm_stats, PP_LOSS):
                dist.broadcast(value, group_src=source, group=group)
        return value

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        check_microbatch_split(len(inputs), self.microbatches, "the validation batch")
        loss = self._loss_from_last_stage(self.pipeline.eval_step(inputs, targets))
        self.lightning_module.log("val_loss", loss, prog_bar=True, sync_dist=True, on_epoch=True)
        return loss

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError("strategy=pp runs fit and validate; test/predict are not wired to the pipeline schedule.")

    predict_step = test_step

    # ---------------------------------------------------------------- checkpoints
    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        # a stage may also hold DTensors (hybrid4d with tp): always the per-rank loader, with stage-keyed groups
        return self._load_per_rank_checkpoint(checkpoint_path, weights_only)

    @override
    def param_groups_key(self) -> str:
        # each pipeline rank's optimizer lists its own stages' parameters (see MeshStrategy.param_groups_key)
        return "param_groups_stages_" + "_".join(map(str, self.pipeline.stage_ids))

    # ---------------------------------------------------------------- measurements
    @override
    def summary_metrics(self, trainer: Any) -> dict[str, Any]:
        metrics = super().summary_metrics(trainer)
        if self.pipeline is None:
            return metrics
        with self.comm_stats.counting_as(REPORT), counting(self.comm_stats, "metrics"):  # end-of-run gathers: not a training step's traffic
            metrics.update(self._pipeline_metrics(trainer))
        return metrics

    def _pipeline_metrics(self, trainer: Any) -> dict[str, Any]:
        stats, world = self.pipeline.stats, self.world_size
        num_stages = self.pipeline.num_stages
        # The bubble is measured against the pipeline's step time: the longest first-to-last-compute
        # time of its ranks, per step (the first stage's: it starts first and finishes last).
        active = torch.tensor(stats.step_active, dtype=torch.float64)
        pp_active = [torch.zeros_like(active) for _ in range(self.pp)]
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
        if self.trace:
            self._write_trace(Path(trainer.default_root_dir))
        return {"pipeline": {
            "schedule": self.schedule,
            "pp": self.pp,
            "microbatches": self.microbatches,
            "virtual_stages": self.virtual_stages,
            "stage_blocks": self._blocks,
            "bubble_fraction": sum(by_rank) / len(by_rank),
            "bubble_fraction_by_rank": by_rank,
            "bubble_fraction_theory": theoretical_bubble(self.pp, self.microbatches, self.virtual_stages),
            "peak_inflight_microbatches_by_stage": [int(v) for v in inflight.tolist()],
            "peak_activation_bytes": int(max(float(g[1]) for g in gathered)),
            "trace_dir": str(Path(trainer.default_root_dir) / TRACE_DIR) if self.trace else None,
        }}

    def _write_trace(self, out: Path) -> None:
        trace_dir = out / TRACE_DIR
        trace_dir.mkdir(parents=True, exist_ok=True)
        coords = self.parallel_dims.coordinates(self.global_rank)
        record = {
            "rank": self.global_rank, "pp_rank": coords[PP], "dp_rank": coords[DP], "pp": self.pp,
            "schedule": self.schedule, "microbatches": self.microbatches, "virtual_stages": self.virtual_stages,
            "stage_ids": self.pipeline.stage_ids, "steps": self.pipeline.stats.events,
        }
        (trace_dir / f"rank{self.global_rank}.json").write_text(json.dumps(record))
        rank_zero_info(f"Pipeline trace in {trace_dir}; draw it with `python -m parallelkit.tools.pipeline_timeline {out}`")
