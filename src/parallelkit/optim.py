"""The ``optim=`` group, checked before any rank starts: the optimizer's arguments, the learning-rate
schedule's keys, and whether the optimizer can take the model's sparse gradients.

torch checks an optimizer's arguments only when the optimizer is built, inside ``trainer.fit`` on every
rank: a negative learning rate was a 63-line traceback per rank, ``lr=abc`` a ``TypeError`` about ``<=``.
Here the factory builds an optimizer over a probe parameter in the launching process, and what torch
rejects becomes one paragraph naming the setting.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf

from parallelkit.errors import ConfigError

#: the keys of ``optim.schedule`` (``parallelkit.models.module.TrainModule``'s schedule arguments).
SCHEDULE_KEYS = ("warmup_steps", "decay_steps", "min_lr_ratio")
_HYDRA_KEYS = ("_target_", "_partial_", "_convert_", "_recursive_", "_args_")
# How torch's messages name an argument when they do not use its name (Adam: "Invalid learning rate").
_WORDS = {"lr": ("learning rate",), "betas": ("beta",), "eps": ("epsilon",), "weight_decay": ("weight decay", "weight_decay")}


def _arguments(node: Any) -> dict[str, Any]:
    if not isinstance(node, DictConfig):
        return {}
    return {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k not in _HYDRA_KEYS}


def _shown(arguments: dict[str, Any]) -> str:
    return ", ".join(f"optim.optimizer.{k}={v!r}" for k, v in arguments.items())


def _wrong_types(target: Any, arguments: dict[str, Any]) -> list[str]:
    """Arguments given as text where the optimizer's default is a number or a tuple of numbers (``lr=abc``)."""
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return []
    wrong = []
    for key, value in arguments.items():
        default = params[key].default if key in params else inspect.Parameter.empty
        numeric = isinstance(default, (int, float)) and not isinstance(default, bool) or (
            isinstance(default, tuple) and all(isinstance(x, (int, float)) for x in default))
        text = isinstance(value, str) or isinstance(default, tuple) and isinstance(value, (list, tuple)) and any(isinstance(x, str) for x in value)
        if numeric and text:
            wrong.append(f"optim.optimizer.{key}={value!r} should be a number{'s' if isinstance(default, tuple) else ''} (default {default!r})")
    return wrong


def _named(message: str, arguments: dict[str, Any]) -> list[str]:
    """The arguments a torch error message speaks of, by name, by the words torch uses, or by value."""
    text = message.lower()
    named = [k for k in arguments if re.search(rf"\b{re.escape(k)}\b", message) or any(w in text for w in _WORDS.get(k, ()))]
    return named or [k for k, v in arguments.items() if str(v) in message and not isinstance(v, bool)]


def check_optimizer(factory: Callable[..., torch.optim.Optimizer], node: Any, label: str) -> None:
    """Build the optimizer over a probe parameter, as every rank will over the model's: torch's
    ``ValueError``/``TypeError`` becomes a :class:`ConfigError` naming the setting."""
    arguments = _arguments(node)
    target = getattr(factory, "func", None)
    probe = torch.nn.Parameter(torch.zeros(2))
    try:
        factory([probe])
    except (ValueError, TypeError) as err:
        if target is not None and (wrong := _wrong_types(target, arguments)):
            raise ConfigError(f"{label}: {'; '.join(wrong)}.") from None
        named = _named(str(err), arguments)
        settings = ", ".join(f"optim.optimizer.{k}={arguments[k]!r}" for k in named) if named else (_shown(arguments) or "its arguments")
        name = getattr(target, "__qualname__", None) or type(factory).__name__
        raise ConfigError(f"{label}: {name} rejects {settings}: {err}.") from None


def check_schedule(node: Any) -> dict[str, Any]:
    """``optim.schedule`` as ``TrainModule``'s keyword arguments, each checked (unknown keys, types, ranges)."""
    schedule = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node or {})
    unknown = sorted(set(schedule) - set(SCHEDULE_KEYS))
    if unknown:
        raise ConfigError(f"optim.schedule has no key {', '.join(unknown)}; its keys are {', '.join(SCHEDULE_KEYS)} "
                          "(linear warm-up over warmup_steps, then cosine decay to min_lr_ratio × lr over decay_steps).")
    for key in ("warmup_steps", "decay_steps"):
        value = schedule.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            hint = " (decay_steps follows trainer.max_steps by default: set it when training by epochs)" if key == "decay_steps" else ""
            raise ConfigError(f"optim.schedule.{key} should be an int ≥ 0 (0: none). Got {value!r}{hint}.")
    ratio = schedule.get("min_lr_ratio", 0.1)
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0.0 <= ratio <= 1.0:
        raise ConfigError(f"optim.schedule.min_lr_ratio should be a number in [0, 1] (the final learning rate ÷ lr). Got {ratio!r}.")
    return schedule


def takes_sparse_gradients(factory: Callable[..., torch.optim.Optimizer]) -> bool:
    """Whether the optimizer can step on a sparse gradient (SGD, Adagrad, SparseAdam can; Adam, AdamW cannot)."""
    probe = torch.nn.Parameter(torch.zeros(2, 1))
    optimizer = factory([probe])
    probe.grad = torch.sparse_coo_tensor([[0]], [[1.0]], (2, 1), check_invariants=True)  # explicit: torch warns otherwise
    try:
        optimizer.step()
    except RuntimeError:
        return False
    return True


def sparse_embeddings(model: torch.nn.Module) -> list[str]:
    """The embedding modules of ``model`` that produce sparse gradients."""
    return [name for name, m in model.named_modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse]


def make_sparse_gradients_dense(model: torch.nn.Module, factory: Callable[..., torch.optim.Optimizer], model_label: str,
                               optim_label: str, sparse_on_command_line: bool, refused: bool = False,
                               hint: str = "optim=adagrad or optim=sgd update only the rows of each batch") -> list[str]:
    """Make the model's sparse embedding gradients dense when the optimizer cannot take sparse ones (or, with
    ``refused``, when what ``optim_label`` names — a strategy — cannot).

    Sparse gradients are parallelkit's default for embedding tables (``model=ctr``'s ``sparse: true``): an
    optimization for SGD and Adagrad, which then update only the rows of the batch. AdamW — the default
    ``optim=`` — cannot step on them, so the table gets dense gradients, PyTorch's own default, and trains
    with AdamW exactly as torch defines it (every row's moments and weight decay, every step). A user who set
    ``model.sparse=true`` on the command line asked for what cannot work: that is an error. Returns the
    modules made dense.
    """
    names = sparse_embeddings(model)
    if not names or (not refused and takes_sparse_gradients(factory)):
        return []
    if sparse_on_command_line:
        raise ConfigError(
            f"{model_label} with model.sparse=true gives sparse gradients to {', '.join(names)}, which {optim_label} cannot take: "
            f"{hint}; or drop model.sparse=true (dense gradients: every row updated every step)."
        )
    for name in names:
        model.get_submodule(name).sparse = False
    return names
