"""The model contract: what ``model=`` (or ``model._target_=mypkg.Net``) may build, and the LightningModule it becomes.

``model._target_`` may build either of:

- **an ``nn.Module``** with ``forward(inputs) -> outputs`` and ``loss(outputs, targets) -> scalar``; the data
  module's batches are ``(inputs, targets)``. Its constructor receives what the data module provides (for
  ``data=chars``: ``vocab_size``, ``block_size``; ``data=synthetic``: ``in_features``, ``out_features``), plus
  the ``model.*`` arguments of the config. parallelkit wraps it in its
  :class:`~parallelkit.models.module.TrainModule` with the run's optimizer (``optim=``) and schedule. Keeping the
  loss separate lets a pipeline schedule call it on the last stage only. Every strategy can train it; those that
  split it (tp, pp, moe, ps, hybrid4d) need its plans (:mod:`parallelkit.models.plans`).
- **a LightningModule**: trained as it is, with its own ``training_step``, ``configure_optimizers``, logging
  and hooks (``optim=`` is not used: choosing one explicitly is an error). Its constructor receives the data
  module's arguments too. Strategies that run Lightning's step take it unchanged (ddp, zero, deepspeed, and
  with its plans tp, moe, hybrid4d without a pipeline); a pipeline schedule, which replaces ``training_step``,
  refuses it with a message.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

import torch

from parallelkit.errors import ConfigError


def import_target(target: str, setting: str) -> Any:
    """The object a ``_target_`` names; a :class:`ConfigError` saying why it does not import, and what would."""
    module_name, _, attribute = target.rpartition(".")
    if not module_name:
        raise ConfigError(f"{setting}={target} is not a dotted path to a class or function (e.g. mypkg.net.Net).")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (module_name == err.name or module_name.startswith(f"{err.name}.")):
            raise ConfigError(
                f"{setting}={target} does not import: there is no module named {err.name!r}. Run from the directory "
                f"that holds the package (the working directory is importable), install it (pip install -e .), or add "
                "its parent directory to PYTHONPATH."
            ) from None
        raise ConfigError(f"{setting}={target} does not import: its module {module_name} needs {err.name!r}, which is not installed ({err}).") from None
    except Exception as err:  # noqa: BLE001 - the user's module failed while importing: say where
        raise ConfigError(f"{setting}={target} does not import: importing {module_name} raised {type(err).__name__}: {err}") from None
    if not hasattr(module, attribute):
        public = sorted(n for n in vars(module) if not n.startswith("_"))[:20]
        raise ConfigError(f"{setting}={target}: module {module_name} has no {attribute!r} (it has {', '.join(public)}).")
    return getattr(module, attribute)


def check_model_fits_data(target: Any, data_kwargs: dict[str, Any], model_label: str, data_label: str) -> None:
    """The model takes its sizes from the data (vocabulary, features): its constructor must take them
    (``model_label``, ``data_label``: how the run names them, e.g. ``model=gpt``)."""
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    missing = sorted(set(data_kwargs) - set(params))
    if missing:
        raise ConfigError(
            f"{model_label} does not fit {data_label}: the data provides {sorted(data_kwargs)} to the model's "
            f"constructor, but it takes no {missing}. Add them to its __init__ (or **kwargs), or pick a pair that fits: gpt "
            "with chars, mlp with synthetic, segmenter with raster (e.g. `model=mlp data=synthetic`, or `+experiment=mlp_regression`)."
        )


def data_hints(target: Any, datamodule: Any) -> dict[str, Any]:
    """What the data knows beyond the model's sizes, for a constructor that asks for it by name:
    ``tokenizer_vocab_size`` (the ids the tokenizer produces, before ``data.vocab_multiple`` pads them), which a
    model of a fixed vocabulary (``model=hf`` with a config) holds its own against."""
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return {}
    return {name: getattr(datamodule, name) for name in ("tokenizer_vocab_size",) if name in params and hasattr(datamodule, name)}


def check_model_contract(model: torch.nn.Module, label: str) -> None:
    """An ``nn.Module`` that parallelkit wraps must compute its own loss from ``(outputs, targets)``."""
    if not callable(getattr(model, "loss", None)):
        raise ConfigError(
            f"{label} built a {type(model).__name__} without a loss(outputs, targets) method. parallelkit trains an "
            "nn.Module as outputs = model(inputs); loss = model.loss(outputs, targets) on the data module's (inputs, targets) "
            "batches: add the method, or give a LightningModule with its own training_step. See README.md, \"Your own model\"."
        )


def as_lightning_module(model: torch.nn.Module, label: str, make_train_module: Callable[[torch.nn.Module], Any],
                        optim_chosen: list[str]) -> Any:
    """``model`` itself if it is a LightningModule, else ``make_train_module(model)`` (parallelkit's TrainModule).

    ``label``: how the run names the model (``model=gpt``, ``model._target_=mypkg.Net``); ``optim_chosen``: the
    ``optim`` settings the command line chose (a LightningModule brings its own optimizer: they could not take effect).
    """
    import lightning.pytorch as pl

    if isinstance(model, pl.LightningModule):
        if optim_chosen:
            raise ConfigError(
                f"{label} built a LightningModule ({type(model).__name__}): it creates its own optimizer in configure_optimizers, so "
                f"{', '.join(optim_chosen)} cannot take effect. Drop it, or set the optimizer in your LightningModule."
            )
        return model
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"{label} built a {type(model).__name__}, not an nn.Module or LightningModule. Its _target_ must build one.")
    check_model_contract(model, label)
    return make_train_module(model)
