"""Build a run from the composed config, validate it before any process starts, fit, write the summary.

The order matters: every check that can fail on bad input (strategy degrees against the world size,
batch divisibility, the corpus, model arguments) runs here in the launching process, before Lightning
starts the other ranks, so bad input costs one clear message and nothing half-written.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from parallelkit.capabilities import DDP_COMM_HOOK, SERVER_TABLES, SPARSE_GRADIENTS
from parallelkit.config_check import check_run_config
from parallelkit.distributed.compile import apply_compile
from parallelkit.distributed.elastic import attempt_line, elastic_ckpt_path
from parallelkit.distributed.recompute import apply_recompute
from parallelkit.errors import ConfigError
from parallelkit.launch import local_ranks, startup_gc
from parallelkit.models.contract import as_lightning_module, check_model_fits_data, data_hints, import_target
from parallelkit.models.plans import parallel_model
from parallelkit.optim import check_optimizer, check_schedule, make_sparse_gradients_dense
from parallelkit.run_dir import RunDirPlan, RunFinished
from parallelkit.run_dir import plan as plan_dir
from parallelkit.strategy_protocol import as_protocol


def build(node: Any, what: str, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` with errors turned into a one-paragraph :class:`ConfigError`.

    ``what`` names the setting, e.g. ``model``: a ``_target_`` that does not import is reported as
    ``model._target_=...`` with the reason, before Hydra's own (longer) message could be.
    """
    if isinstance(node, DictConfig) and isinstance(node.get("_target_"), str):
        import_target(node._target_, f"{what}._target_")
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        target = node.get("_target_") if isinstance(node, DictConfig) else node
        raise ConfigError(f"Could not build {_label(what)} ({target}): {cause or err}") from None


def resolve_accelerator(requested: str) -> str:
    if requested in (None, "auto"):
        return "gpu" if torch.cuda.is_available() else "cpu"
    if requested in ("gpu", "cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"trainer.accelerator={requested} but this machine has no CUDA device. Use trainer.accelerator=cpu (or auto).")
        return "gpu"
    if requested != "cpu":
        raise ConfigError(f"trainer.accelerator must be cpu, gpu or auto. Got {requested!r}.")
    return "cpu"


def resolve_devices(requested: Any, strategy: Any, accelerator: str) -> int:
    """Processes per node: ``trainer.devices``, else the launcher's (torchrun/SLURM), else the strategy's default."""
    external = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE")
    if requested is None:
        return int(external) if external else strategy.default_devices(accelerator)
    if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
        raise ConfigError(f"trainer.devices should be an int greater than 0 (processes per node) or null. Got {requested!r}.")
    if accelerator == "gpu" and requested > torch.cuda.device_count():
        raise ConfigError(f"trainer.devices={requested}, but this machine has {torch.cuda.device_count()} GPU(s).")
    if external and int(external) != requested:
        raise ConfigError(
            f"trainer.devices={requested}, but the launcher started {external} processes per node. "
            "Leave trainer.devices unset under torchrun/SLURM, or make them agree."
        )
    return requested


def _choice(group: str) -> str:
    """The option the run chose for a config group (``gpt``); ``?`` outside Hydra (an early-started rank)."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.choices.get(group) or "?" if HydraConfig.initialized() else "?"


def _label(group: str) -> str:
    """How the run names ``group`` to the user: ``model=gpt``, or ``model._target_=mypkg.Net`` if the command line
    set the target itself."""
    targets = [o.lstrip("+") for o in chosen_on_command_line(group) if o.lstrip("+").startswith(f"{group}._target_=")]
    if targets:
        return targets[-1]
    choice = _choice(group)
    return f"{group}={choice}" if choice != "?" else group


def chosen_on_command_line(group: str) -> list[str]:
    """The command-line overrides that set ``group`` or one of its keys (``optim=sgd``, ``optim.optimizer.lr=1``)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    return [o for o in HydraConfig.get().overrides.task if o.lstrip("+~").split("=", 1)[0].split(".")[0] == group]


def build_logger(cfg: DictConfig, out: Path) -> Any:
    """``logger=`` (csv, tensorboard, or any Lightning logger by ``_target_``); ``save_dir: null`` = the run directory."""
    node = cfg.get("logger")
    if node is None:
        return False
    if "save_dir" in node and node.save_dir is None:
        node = OmegaConf.merge(node, {"save_dir": str(out)})
    return build(node, "logger")


def resolve_num_nodes(requested: int, devices: int) -> int:
    """Under torchrun the world size is known: derive the node count instead of asking for it twice."""
    world = os.environ.get("WORLD_SIZE") if os.environ.get("TORCHELASTIC_RUN_ID") else None
    if world is None:
        return requested
    nodes = int(world) // devices
    if requested not in (1, nodes):
        raise ConfigError(f"trainer.num_nodes={requested}, but torchrun started {world} processes of {devices} per node = {nodes} node(s). "
                          "Leave trainer.num_nodes unset under torchrun: it follows the rendezvous (with --nnodes=MIN:MAX it changes).")
    return nodes


def output_dir(cfg: DictConfig) -> Path:
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(cfg.get("output_dir") or ".")


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


def checkpoint_callbacks(cfg: DictConfig, out: Path) -> tuple[Any, Any]:
    """``checkpoint.*``: periodic checkpoints (steps and/or minutes, the newest K kept) and the stop on a signal."""
    from parallelkit.callbacks.local_sigterm import LocalSigterm
    from parallelkit.callbacks.periodic_checkpoint import PeriodicCheckpoint

    node = cfg.get("checkpoint") or {}
    return (
        PeriodicCheckpoint(out / "checkpoints", every_n_steps=node.get("every_n_steps", 100), every_n_minutes=node.get("every_n_minutes", 30),
                           save_top_k=node.get("save_top_k", 3), agree_every_s=node.get("agree_every_s", 2),
                           async_save=node.get("async_save", False)),
        LocalSigterm(checkpoint_on_signal=node.get("on_signal", True), grace_s=node.get("signal_grace_s", 20)),
    )


def train_module(model: torch.nn.Module, cfg: DictConfig) -> Any:
    """parallelkit's LightningModule around ``model``, with ``optim=``'s optimizer and schedule checked now: an
    argument torch rejects would otherwise fail inside ``fit`` on every rank (:mod:`parallelkit.optim`)."""
    from parallelkit.models.module import TrainModule

    schedule = check_schedule(cfg.optim.get("schedule"))
    factory = build(cfg.optim.optimizer, "optim")
    check_optimizer(factory, cfg.optim.optimizer, _label("optim"))
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
        refuser = f"{_label('strategy')}{' with ' + ', '.join(hooks) if hooks else ''}"
        hint = "strategy=single or strategy=ddp (without a comm hook) with optim=adagrad or optim=sgd update only the rows of each batch"
    dense = make_sparse_gradients_dense(module.model, module.optimizer_factory, _label("model"), refuser or _label("optim"), explicit,
                                        refused=refuser is not None, hint=hint)
    if dense:
        rank_zero_info(f"parallelkit: {refuser or _label('optim')} cannot take sparse gradients: {', '.join(dense)} gets dense ones "
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


def run(cfg: DictConfig) -> dict[str, Any] | None:
    """Train as ``cfg`` says; return the summary on rank 0 (``None`` elsewhere)."""
    finished = False
    try:
        result = _run(cfg)
        finished = True
        return result
    except RuntimeError as err:
        from parallelkit.distributed.stuck_ranks import describe, is_timeout, stuck_ranks

        if is_timeout(err) and (stuck := describe(stuck_ranks())):
            err.add_note(stuck)  # cli's message names them; the store is gone after the teardown below
        raise
    finally:
        startup_gc.resume()  # a run that failed while building (a sweep's next job must not start without it)
        # After a failure the other ranks may never reach a barrier: tear down without one.
        _teardown_process_group(barrier=finished)


def _run(cfg: DictConfig) -> dict[str, Any] | None:
    import lightning.pytorch as pl
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from lightning.pytorch.callbacks.progress import ProgressBar

    from lightning.pytorch.callbacks import ModelSummary

    from parallelkit.callbacks.base import ParallelKitCallback
    from parallelkit.callbacks.model_summary import MeasuredModelSummary
    from parallelkit.callbacks.progress_bar import step_progress_bar
    from parallelkit.callbacks.resumed_schedule import ResumedSchedule
    from parallelkit.callbacks.run_summary import RunSummary
    from parallelkit.models.module import TrainModule

    if not local_ranks.is_started_rank():  # a rank started by rank 0 waits for rank 0's verdict on the same config
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
    local_ranks.ensure_started(devices, num_nodes)

    datamodule = build(cfg.data, "data")
    if not callable(getattr(datamodule, "configure", None)):
        raise ConfigError(f"{_label('data')} built a {type(datamodule).__name__}; parallelkit shards data itself and needs a "
                          "parallelkit.data.base.DataParallelDataModule (its subclasses: conf/data/*.yaml).")
    plan = datamodule.configure(dims.data_parallel_size, trainer_cfg.get("accumulate_grad_batches", 1))
    skip_empty_validation(datamodule, trainer_cfg)
    # Same seed on every rank → identical initial weights (DDP also broadcasts them from rank 0).
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    if not isinstance(cfg.model.get("_target_"), str):
        raise ConfigError(f"{_label('model')} has no _target_: name the class or function that builds the model (model._target_=mypkg.Net).")
    check_model_fits_data(import_target(cfg.model._target_, "model._target_"), datamodule.model_kwargs(), _label("model"), _label("data"))
    built = build(cfg.model, "model", **datamodule.model_kwargs(), **data_hints(import_target(cfg.model._target_, "model._target_"), datamodule))
    module = as_lightning_module(built, _label("model"), lambda m: train_module(m, cfg), chosen_on_command_line("optim"))
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
    if cfg.get("mode", "train") == "predict":
        return _predict(cfg, strategy.lightning_strategy, accelerator, devices, num_nodes, datamodule, module, trainer_cfg, out)

    ckpt_path = dir_plan.ckpt_path
    if ckpt_path is not None:
        # A missing, incomplete, corrupt or mismatched checkpoint is bad input: say so before any rank starts.
        strategy.check_checkpoint(ckpt_path, {k: v.shape for k, v in module.state_dict().items()})

    summary = RunSummary(out, plan.global_batch_size, sum(p.numel() for p in module.parameters()))
    periodic_checkpoint, signal_stop = checkpoint_callbacks(cfg, out)
    callbacks = [build(node, f"callbacks.{name}") for name, node in (cfg.get("callbacks") or {}).items()]
    # A callback that needs something of the strategy (a DDP comm hook, replicated parameters) says so now,
    # before the other ranks start work: one message and exit code 2, not an error in every rank.
    for callback in [*callbacks, periodic_checkpoint]:
        if isinstance(callback, ParallelKitCallback):
            callback.check_strategy(strategy.lightning_strategy, dims)
    if isinstance(module, TrainModule) and not getattr(strategy, "supports", lambda _: False)(SERVER_TABLES):  # ps: tables on servers
        fit_gradients_to_run(module, cfg, strategy.lightning_strategy, callbacks)  # after the callbacks claimed comm hooks
    if trainer_cfg.get("enable_progress_bar") is None:  # auto: a bar on a terminal, none in log files
        trainer_cfg["enable_progress_bar"] = sys.stdout.isatty()
    if trainer_cfg["enable_progress_bar"] and not any(isinstance(c, ProgressBar) for c in callbacks):
        callbacks.append(step_progress_bar())  # Lightning's bar, counting to max_steps (not "Epoch 0/-2")
    if trainer_cfg.get("enable_model_summary", True) and not any(isinstance(c, ModelSummary) for c in callbacks):
        callbacks.append(MeasuredModelSummary())  # no "Total FLOPs: 0" when nothing measured them
        trainer_cfg["enable_model_summary"] = False  # Lightning adds no default one (nor says that it skipped it)
    try:
        trainer = pl.Trainer(
            strategy=strategy.lightning_strategy,
            accelerator=accelerator,
            devices=devices,
            num_nodes=num_nodes,
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
    startup_gc.resume()
    local_ranks.share_cores()
    if launching_rank_zero():
        dir_plan.apply()  # moves what a resumed run recomputes into side files: the last step before the rendezvous
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return summary.summary if trainer.is_global_zero else None


def _predict(cfg: DictConfig, strategy: Any, accelerator: str, devices: int, num_nodes: int, datamodule: Any, module: Any, trainer_cfg: dict, out: Path) -> dict[str, Any] | None:
    """``mode=predict``: load a checkpoint of any strategy and world size, score and generate (parallelkit.predict)."""
    import lightning.pytorch as pl

    from parallelkit.tools.predict import check_predict_config, load_weights, predict

    check_predict_config(cfg)
    load_weights(module, cfg.ckpt_path)  # full tensors into the single-device model; the strategy splits them
    trainer_cfg = {k: v for k, v in trainer_cfg.items() if k in ("limit_val_batches", "precision")}
    trainer = pl.Trainer(
        strategy=strategy, accelerator=accelerator, devices=devices, num_nodes=num_nodes, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=out,
        use_distributed_sampler=False, **trainer_cfg,
    )
    return predict(cfg, trainer, module, datamodule, out)


def _teardown_process_group(barrier: bool) -> None:
    """Leave no process group behind: a sweep runs its next job in this process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            if barrier:
                dist.barrier()
        finally:
            dist.destroy_process_group()
    from parallelkit.distributed.listeners import release_stores

    release_stores()  # the store server this rank hosted for the group (listeners.host_store) stops with it
