"""The composed config, read for :mod:`parallelkit.run`: ``_target_`` nodes built with one-paragraph errors, how the
run names a config group to the user (``model=gpt``, ``model._target_=mypkg.Net``), the accelerator, devices and
nodes it asks for, the run directory and the logger."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from parallelkit.errors import ConfigError
from parallelkit.models.contract import import_target


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
        raise ConfigError(f"Could not build {label(what)} ({target}): {cause or err}") from None


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


def choice(group: str) -> str:
    """The option the run chose for a config group (``gpt``); ``?`` outside Hydra (an early-started rank)."""
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.choices.get(group) or "?" if HydraConfig.initialized() else "?"


def label(group: str) -> str:
    """How the run names ``group`` to the user: ``model=gpt``, or ``model._target_=mypkg.Net`` if the command line
    set the target itself."""
    targets = [o.lstrip("+") for o in chosen_on_command_line(group) if o.lstrip("+").startswith(f"{group}._target_=")]
    if targets:
        return targets[-1]
    chosen = choice(group)
    return f"{group}={chosen}" if chosen != "?" else group


def chosen_on_command_line(group: str) -> list[str]:
    """The command-line overrides that set ``group`` or one of its keys (``optim=sgd``, ``optim.optimizer.lr=1``)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return []
    return [o for o in HydraConfig.get().overrides.task if o.lstrip("+~").split("=", 1)[0].split(".")[0] == group]


def output_dir(cfg: DictConfig) -> Path:
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(cfg.get("output_dir") or ".")


def build_logger(cfg: DictConfig, out: Path) -> Any:
    """``logger=`` (csv, tensorboard, or any Lightning logger by ``_target_``); ``save_dir: null`` = the run directory."""
    node = cfg.get("logger")
    if node is None:
        return False
    if "save_dir" in node and node.save_dir is None:
        node = OmegaConf.merge(node, {"save_dir": str(out)})
    return build(node, "logger")
