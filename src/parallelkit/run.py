"""Assemble a run from the composed config and fit it: data, model, strategy, callbacks, trainer, ``fit``.

:func:`train` returns the run's metrics and the objects it built (lightning-hydra-template's ``train(cfg)``);
:mod:`parallelkit.job` wraps it with predict mode, the teardown and the note a timeout gets. The order matters:
every check that can fail on bad input (strategy degrees against the world size, batch divisibility, the corpus,
model arguments) runs here in the launching process, before the other ranks start work, so bad input costs one
clear message and nothing half-written. What the launcher does at these moments (start the local ranks, turn
the collector back on, share the cores) it hands in as :class:`LaunchHooks`: run code never imports ``launch/``.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf

from parallelkit.capabilities import DDP_COMM_HOOK, SERVER_TABLES, SPARSE_GRADIENTS
from parallelkit.config_check import check_run_config
from parallelkit.distributed.compile import apply_compile
from parallelkit.distributed.elastic import attempt_line, elastic_ckpt_path
from parallelkit.distributed.recompute import apply_recompute
from parallelkit.errors import ConfigError
from parallelkit.models.contract import as_lightning_module, check_model_fits_data, data_hints, import_target
from parallelkit.models.plans import parallel_model
from parallelkit.optim import check_optimizer, check_schedule, make_sparse_gradients_dense
from parallelkit.run_config import (build, build_logger, chosen_on_command_line, label, output_dir, resolve_accelerator, resolve_devices,
                                    resolve_num_nodes)
from parallelkit.run_dir import RunDirPlan, RunFinished
from parallelkit.run_dir import plan as plan_dir
from parallelkit.strategy_protocol import as_protocol


def _nothing(*args: Any) -> None:
    return None


def _no() -> bool:
    return False


@dataclass(frozen=True)
class LaunchHooks:
    """What the launcher does at the run's milestones, handed in by the entry point
    (:func:`parallelkit.launch.cli.launch_hooks`). The defaults do nothing: torchrun, SLURM or a test started the
    processes, and no collector was paused.

    Args:
        is_started_rank: whether another local rank started this process (it waits for rank 0's verdict on the
            config instead of checking the config itself).
        start_ranks: ``(devices, num_nodes)``: start this job's other local ranks, once the degrees are valid.
        end_startup: the run is built (or failed building): the collector paused for the imports runs again.
        share_cores: the ranks start work: each takes its share of the machine's cores.
        stop_ranks: this rank leaves at once (a signal with no checkpoint): the ranks it started leave too.
    """

    is_started_rank: Callable[[], bool] = _no
    start_ranks: Callable[[int, int], None] = _nothing
    end_startup: Callable[[], None] = _nothing
    share_cores: Callable[[], None] = _nothing
    stop_ranks: Callable[[], None] = _nothing

    def start_work(self) -> None:
        """Everything that can fail on bad input has run: the collector on, the cores shared out."""
        self.end_startup()
        self.share_cores()


def plan_run_dir(cfg: DictConfig, out: Path, max_steps: int, max_epochs: int | None = None) -> RunDirPlan:
    """``ckpt_path`` (``last`` under a torchrun restart) against what ``out`` holds: see :func:`parallelkit.run_dir.plan`."""
    # torchrun restarted this job after a failure, or this agent joined a running elastic job: go on from the
    # newest checkpoint (parallelkit.distributed.elastic)
    ckpt_path = elastic_ckpt_path(cfg.get("ckpt_path"), out)
    try:
        return plan_dir(out, None if ckpt_path is None else str(ckpt_path), max_steps if isinstance(max_steps, int) else -1,
                        max_epochs if isinstance(max_epochs, int) else None)
    except (RunFinished, ConfigError):
        _forget_config_record(out)
        raise


def _forget_config_record(out: Path) -> None:
    """A job that does nothing in a directory that already holds a run (finished, or refused) takes back the
    ``.hydra-N/`` record Hydra just wrote for it (``cli.config_subdir``): the earlier run's ``.hydra/`` stays."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized() and launching_rank_zero():
        subdir = HydraConfig.get().output_subdir
        if subdir and subdir.startswith(".hydra-") and (out / subdir).is_dir():
            shutil.rmtree(out / subdir, ignore_errors=True)


def checkpoint_callbacks(cfg: DictConfig, out: Path, stop_ranks: Callable[[], None] = _nothing) -> tuple[Any, Any]:
    """``checkpoint.*``: periodic checkpoints (steps and/or minutes, the newest K kept) and the stop on a signal
    (``stop_ranks``: the launcher's, when a signalled rank leaves without a checkpoint)."""
    from parallelkit.callbacks.local_sigterm import LocalSigterm
    from parallelkit.callbacks.periodic_checkpoint import PeriodicCheckpoint

    node = cfg.get("checkpoint") or {}
    return (
        PeriodicCheckpoint(out / "checkpoints", every_n_steps=node.get("every_n_steps", 100), every_n_minutes=node.get("every_n_minutes", 30),
                           save_top_k=node.get("save_top_k", 3), agree_every_s=node.get("agree_every_s", 2),
                           async_save=node.get("async_save", False)),
        LocalSigterm(checkpoint_on_signal=node.get("on_signal", True), grace_s=node.get("signal_grace_s", 20), on_leave=stop_ranks),
    )


def train_module(model: torch.nn.Module, cfg: DictConfig) -> Any:
    """parallelkit's LightningModule around ``model``, with ``optim=``'s optimizer and schedule checked now: an
    argument torch rejects would otherwise fail inside ``fit`` on every rank (:mod:`parallelkit.optim`)."""
    from parallelkit.models.module import TrainModule

    schedule = check_schedule(cfg.optim.get("schedule"))
    factory = build(cfg.optim.optimizer, "optim")
    check_optimizer(factory, cfg.optim.optimizer, label("optim"))
    return TrainModule(model, factory, **schedule, step_seed=cfg.seed)


def fit_gradients_to_run(module: Any, cfg: DictConfig, strategy: Any, callbacks: list[Any]) -> None:
    """Sparse embedding gradients become dense when the strategy (ZeRO, DeepSpeed, a DDP comm hook: they take
    dense tensors or flat buckets) or ``optim=`` (AdamW: ``model=ctr``'s default) cannot take them, and one line
    says so; ``model.sparse=true`` set on the command line is an error instead (:mod:`parallelkit.optim`)."""
    from lightning.pytorch.utilities import rank_zero_info

    from parallelkit.callbacks.comm_hook import CommHookCallback
    from parallelkit.optim import sparse_embeddings

    explicit = any(o.lstrip("+").startswith("model.sparse=") and o.split("=", 1)[1].lower() == "true" for o in chosen_on_command_line("model"))
    if getattr(strategy, "supports", lambda _: False)(SPARSE_GRADIENTS):
        refuser, hint = None, "optim=adagrad or optim=sgd update only the rows of each batch"
    else:
        # A strategy that takes sparse gradients but for a comm hook (DDP): the callbacks that installed one say why.
        hooks = [c.owner for c in callbacks if isinstance(c, CommHookCallback)] if getattr(strategy, "supports", lambda _: False)(DDP_COMM_HOOK) else []
        refuser = f"{label('strategy')}{' with ' + ', '.join(hooks) if hooks else ''}"
        hint = "strategy=single or strategy=ddp (without a comm hook) with optim=adagrad or optim=sgd update only the rows of each batch"
    dense = make_sparse_gradients_dense(module.model, module.optimizer_factory, label("model"), refuser or label("optim"), explicit,
                                        refused=refuser is not None, hint=hint)
    if dense:
        rank_zero_info(f"parallelkit: {refuser or label('optim')} cannot take sparse gradients: {', '.join(dense)} gets dense ones "
                       f"(every row updated every step); {hint}.")
    elif sparse_embeddings(module.model):
        # torch's optimizers build sparse tensors without checking them, torch's default, and warn on every rank
        # that nobody chose it: choose it (the same behaviour, said explicitly).
        torch.sparse.check_sparse_tensor_invariants.disable()


# Trainer settings by which a command line asks for validation: without a batch to run, that is an error.
_VALIDATION_SETTINGS = ("trainer.val_check_interval", "trainer.limit_val_batches", "trainer.check_val_every_n_epoch",
                        "data.val_batch_size", "data.val_fraction")


def skip_empty_validation(datamodule: Any, trainer_cfg: dict) -> None:
    """A validation set without one batch per rank: refused if the command line asked for validation, else one
    line and no validation (``limit_val_batches=0``), instead of a summary with "validation loss -" unexplained."""
    from lightning.pytorch.utilities import rank_zero_info

    why = datamodule.empty_validation() if callable(getattr(datamodule, "empty_validation", None)) else None
    if why is None or trainer_cfg.get("limit_val_batches") == 0:
        return
    asked = [o.lstrip("+") for group in ("trainer", "data") for o in chosen_on_command_line(group)
             if o.lstrip("+").split("=", 1)[0] in _VALIDATION_SETTINGS]
    if asked:
        raise ConfigError(f"{' '.join(asked)} asks for validation, but {why}.")
    rank_zero_info(f"parallelkit: no validation in this run: {why}.")
    trainer_cfg["limit_val_batches"] = 0


def launching_rank_zero() -> bool:
    """Global rank 0 before the process group exists (Lightning reads it from the launcher's environment)."""
    from lightning.pytorch.utilities import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0


@dataclass
class Assembly:
    """What :func:`assemble` built and decided, before any rank trains (all of it checked against the others)."""

    out: Path  # the run directory
    trainer_cfg: dict  # ``trainer.*`` left for Lightning's Trainer
    dir_plan: RunDirPlan | None  # what the run directory holds (train mode)
    strategy: Any  # the strategy protocol around the Lightning strategy
    accelerator: str
    devices: int
    num_nodes: int
    dims: Any  # the validated ParallelDims
    datamodule: Any
    batches: Any  # the datamodule's batch plan
    module: Any  # the LightningModule
    model: torch.nn.Module  # what the strategy splits


def assemble(cfg: DictConfig, hooks: LaunchHooks = LaunchHooks()) -> Assembly:
    """Strategy, data and model from ``cfg``, each checked against the others; this job's local ranks started
    (``hooks.start_ranks``) as soon as the degrees are valid. Shared by training and ``mode=predict``."""
    import lightning.pytorch as pl

    if not hooks.is_started_rank():  # a rank started by rank 0 waits for rank 0's verdict on the same config
        check_run_config(cfg)  # a key that no code reads (+optim.lr=...) is an error, not a silent default
    out = output_dir(cfg)
    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    # What this run directory already holds decides first (read-only, every rank): a finished run is not
    # retrained, an unfinished one is not started over without ckpt_path (parallelkit.run_dir).
    dir_plan = plan_run_dir(cfg, out, trainer_cfg.get("max_steps", -1), trainer_cfg.get("max_epochs")) if cfg.get("mode", "train") == "train" else None
    pl.seed_everything(cfg.seed, workers=True, verbose=False)

    # The strategy protocol (parallelkit.strategy_protocol), step by step; a Lightning strategy that is not
    # parallelkit's takes part with steps that do nothing.
    strategy = as_protocol(build(cfg.strategy, "strategy"))
    accelerator = resolve_accelerator(trainer_cfg.pop("accelerator", "auto"))
    strategy.bind_accelerator(accelerator)
    strategy.bind_trainer_config(trainer_cfg)  # a strategy that applies Trainer settings itself checks them now
    devices = resolve_devices(trainer_cfg.pop("devices", None), strategy, accelerator)
    num_nodes = resolve_num_nodes(trainer_cfg.pop("num_nodes", 1), devices)
    resolved = strategy.resolve(cfg, devices, num_nodes)  # strategy=auto: the hybrid4d layout it chose
    if resolved is not strategy:  # the chosen strategy gets the same bindings as the one that chose it
        strategy = as_protocol(resolved)
        strategy.bind_accelerator(accelerator)
        strategy.bind_trainer_config(trainer_cfg)
    dims = strategy.plan(devices * num_nodes)
    if dir_plan is not None and (line := attempt_line(dims, devices, num_nodes, dir_plan.ckpt_path, cfg.strategy.get("dp"))):
        from lightning.pytorch.utilities import rank_zero_info

        rank_zero_info(line)  # a torchrun attempt that continues the job (restart, shrink, grow): its world and degrees
    # The degrees fit: this job's other local ranks build the same run alongside (unless started before Hydra,
    # which only happens when they fit too, or by torchrun/SLURM). Bad degrees start no process.
    hooks.start_ranks(devices, num_nodes)

    datamodule = build(cfg.data, "data")
    if not callable(getattr(datamodule, "configure", None)):
        raise ConfigError(f"{label('data')} built a {type(datamodule).__name__}; parallelkit shards data itself and needs a "
                          "parallelkit.data.base.DataParallelDataModule (its subclasses: conf/data/*.yaml).")
    batches = datamodule.configure(dims.data_parallel_size, trainer_cfg.get("accumulate_grad_batches", 1))
    skip_empty_validation(datamodule, trainer_cfg)
    # Same seed on every rank → identical initial weights (DDP also broadcasts them from rank 0).
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    if not isinstance(cfg.model.get("_target_"), str):
        raise ConfigError(f"{label('model')} has no _target_: name the class or function that builds the model (model._target_=mypkg.Net).")
    check_model_fits_data(import_target(cfg.model._target_, "model._target_"), datamodule.model_kwargs(), label("model"), label("data"))
    built = build(cfg.model, "model", **datamodule.model_kwargs(), **data_hints(import_target(cfg.model._target_, "model._target_"), datamodule))
    module = as_lightning_module(built, label("model"), lambda m: train_module(m, cfg), chosen_on_command_line("optim"))
    model = parallel_model(module)  # what the strategy splits and the plans speak of
    # Techniques of the model's own computation, shared by every strategy (they keep module names, so the
    # strategy's plans still apply): recomputation now, compilation lazily at the first forward.
    apply_recompute(model, cfg.get("recompute", "none"))
    if cfg.get("compile", False):
        apply_compile(model, "cuda" if accelerator == "gpu" else "cpu")
    # Can the strategy split this model (heads % tp, a plan), train this LightningModule (manual optimization
    # under a pipeline), with these batches (pipeline micro-batches)? Still before the other ranks are released.
    strategy.check_model(model, dims.world_size)
    strategy.check_lightning_module(module)
    strategy.check_workload(model, datamodule)

    if callable(getattr(datamodule, "check_mode", None)):  # e.g. an unlabelled image can be predicted but not trained on
        datamodule.check_mode(cfg.get("mode", "train"))
    return Assembly(out, trainer_cfg, dir_plan, strategy, accelerator, devices, num_nodes, dims, datamodule, batches, module, model)


def train(cfg: DictConfig, hooks: LaunchHooks = LaunchHooks()) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Train as ``cfg`` says: the run's summary (``summary.json``'s metrics, rank 0; ``None`` elsewhere) and the
    objects built (``cfg``, ``datamodule``, ``model``: the LightningModule, ``strategy``, ``callbacks``, ``trainer``)."""
    import lightning.pytorch as pl
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from parallelkit.callbacks.resumed_schedule import ResumedSchedule
    from parallelkit.callbacks.run_summary import RunSummary

    run = assemble(cfg, hooks)
    out, trainer_cfg, strategy, module = run.out, run.trainer_cfg, run.strategy, run.module
    ckpt_path = run.dir_plan.ckpt_path
    if ckpt_path is not None:
        # A missing, incomplete, corrupt or mismatched checkpoint is bad input: say so before any rank starts.
        strategy.check_checkpoint(ckpt_path, {k: v.shape for k, v in module.state_dict().items()})

    summary = RunSummary(out, run.batches.global_batch_size, sum(p.numel() for p in module.parameters()))
    periodic_checkpoint, signal_stop = checkpoint_callbacks(cfg, out, hooks.stop_ranks)
    callbacks = trainer_callbacks(cfg, run, periodic_checkpoint)
    try:
        trainer = pl.Trainer(
            strategy=strategy.lightning_strategy,
            accelerator=run.accelerator,
            devices=run.devices,
            num_nodes=run.num_nodes,
            # ResumedSchedule: a resumed run's learning rate follows this run's schedule from its first step on.
            callbacks=[*callbacks, periodic_checkpoint, summary, signal_stop, ResumedSchedule()],
            logger=build_logger(cfg, out),
            default_root_dir=out,
            use_distributed_sampler=False,  # the datamodule shards by the data-parallel rank itself
            **trainer_cfg,
        )
    except (MisconfigurationException, TypeError) as err:
        raise ConfigError(f"The trainer settings do not work together: {err}") from None
    # Everything that can fail on bad input has run: rank 0 joins the process group inside fit, and only then
    # do the other ranks (waiting in the rendezvous) go on.
    hooks.start_work()
    if launching_rank_zero():
        run.dir_plan.apply()  # moves what a resumed run recomputes into side files: the last step before the rendezvous
    trainer.fit(module, datamodule=run.datamodule, ckpt_path=ckpt_path)
    objects = {"cfg": cfg, "datamodule": run.datamodule, "model": module, "strategy": strategy.lightning_strategy,
               "callbacks": trainer.callbacks, "trainer": trainer}
    return (summary.summary if trainer.is_global_zero else None), objects


def trainer_callbacks(cfg: DictConfig, run: Assembly, periodic_checkpoint: Any) -> list[Any]:
    """``callbacks=``, each checked against the strategy now, with the sparse-gradient policy they decide, and
    the progress bar and model summary parallelkit keeps by default."""
    from lightning.pytorch.callbacks import ModelSummary
    from lightning.pytorch.callbacks.progress import ProgressBar

    from parallelkit.callbacks.base import ParallelKitCallback
    from parallelkit.callbacks.model_summary import MeasuredModelSummary
    from parallelkit.callbacks.progress_bar import step_progress_bar
    from parallelkit.models.module import TrainModule

    strategy, trainer_cfg = run.strategy, run.trainer_cfg
    callbacks = [build(node, f"callbacks.{name}") for name, node in (cfg.get("callbacks") or {}).items()]
    # A callback that needs something of the strategy (a DDP comm hook, replicated parameters) says so now,
    # before the other ranks start work: one message and exit code 2, not an error in every rank.
    for callback in [*callbacks, periodic_checkpoint]:
        if isinstance(callback, ParallelKitCallback):
            callback.check_strategy(strategy.lightning_strategy, run.dims)
    if isinstance(run.module, TrainModule) and not getattr(strategy, "supports", lambda _: False)(SERVER_TABLES):  # ps: tables on servers
        fit_gradients_to_run(run.module, cfg, strategy.lightning_strategy, callbacks)  # after the callbacks claimed comm hooks
    if trainer_cfg.get("enable_progress_bar") is None:  # auto: a bar on a terminal, none in log files
        trainer_cfg["enable_progress_bar"] = sys.stdout.isatty()
    if trainer_cfg["enable_progress_bar"] and not any(isinstance(c, ProgressBar) for c in callbacks):
        callbacks.append(step_progress_bar())  # Lightning's bar, counting to max_steps (not "Epoch 0/-2")
    if trainer_cfg.get("enable_model_summary", True) and not any(isinstance(c, ModelSummary) for c in callbacks):
        callbacks.append(MeasuredModelSummary())  # no "Total FLOPs: 0" when nothing measured them
        trainer_cfg["enable_model_summary"] = False  # Lightning adds no default one (nor says that it skipped it)
    return callbacks
