"""Where a model's parallel plans come from: one mechanism for parallelkit's models and the user's.

The techniques in :mod:`parallelkit.distributed` are model-agnostic; a *plan* says how one of them splits a
particular model (which linear layers are column- or row-parallel, where the pipeline cuts, which modules hold
experts, which tables live on parameter servers). Model code stays single-device; the plans sit outside its
``forward``. A strategy that needs a plan asks :func:`model_plans` for it, which looks, in this order:

1. **The config**: ``strategy.plan=PATH`` names a module (``mypkg.parallelize``) or an object
   (``mypkg.plans.NetPlans``: a class, instantiated without arguments, or an instance) holding the plan
   functions below. For a model whose code you cannot or do not want to touch.
2. **The model itself**: a method of the same name, called without the ``model`` argument
   (``model.tensor_parallel_plan(tp, sequence_parallel=False)``).
3. **Beside the model's class**: the ``parallelize`` module of the package that defines the model's class
   (``mypkg/net.py`` → ``mypkg/parallelize.py``). parallelkit's own models (``models/gpt/parallelize.py``, ...)
   use this convention.

A source that does not define a function is skipped for that function only, so a model may keep its
tensor-parallel plan in one place and its pipeline cut in another. The plan functions (``model`` is the
module the strategy parallelizes: a LightningModule's :func:`parallel_model`):

===========================  ===============================================================  ==================
function                     returns                                                          needed by
===========================  ===============================================================  ==================
``tensor_parallel_plan``     ``(model, tp, *, sequence_parallel) -> TensorParallelPlan``      tp, hybrid4d tp>1
``pipeline_blocks``          ``(model) -> int``: blocks the stages share                      pp, hybrid4d pp>1
``pipeline_stages``          ``(model, blocks_per_stage, stage_ids) -> [nn.Module]``           pp, hybrid4d pp>1
``pipeline_loss`` (optional) ``(model) -> (outputs, targets) -> loss``; default ``model.loss``  pp, hybrid4d pp>1
``expert_parallel_plan``     ``(model) -> ExpertParallelPlan``                                 moe, hybrid4d ep
``context_parallel_plan``    ``(model) -> ContextParallelPlan``                                hybrid4d cp>1
``parameter_server_tables``  ``(model, optimizer) -> {module path: TableSpec}``                ps
===========================  ===============================================================  ==================

A model whose output layer reuses its input embedding (tied weights) needs nothing more for tensor parallelism (its
plan wraps the two styles with :func:`~parallelkit.distributed.tied_weights.tie_parallel_styles`); its
``pipeline_stages`` gives the first and the last stage each a copy of the weight and names it in the stage module's
``tied_weights`` attribute (``{"embedding": "tok_emb.weight"}``), which
:func:`~parallelkit.distributed.tied_weights.apply_tied_embedding_sync` reads.

A missing plan is a :class:`~parallelkit.errors.ConfigError` that names the function, its signature and the
three places it may live, before any process starts.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

from parallelkit.errors import ConfigError

#: plan function → (its signature, what it is for, parallelkit's models that have one): for messages.
PLAN_FUNCTIONS: dict[str, tuple[str, str, str]] = {
    "tensor_parallel_plan": (
        "tensor_parallel_plan(model, tp, *, sequence_parallel) -> TensorParallelPlan",
        "a tensor parallel plan",
        "model=gpt, model=moe_gpt",
    ),
    "pipeline_blocks": ("pipeline_blocks(model) -> int", "pipeline split points", "model=gpt, model=moe_gpt"),
    "pipeline_stages": ("pipeline_stages(model, blocks_per_stage, stage_ids) -> list[nn.Module]", "pipeline stages", "model=gpt, model=moe_gpt"),
    "pipeline_loss": ("pipeline_loss(model) -> loss_fn(outputs, targets)", "the last pipeline stage's loss", "model=gpt, model=moe_gpt"),
    "expert_parallel_plan": ("expert_parallel_plan(model) -> ExpertParallelPlan", "an expert parallel plan (a Mixture-of-Experts model)", "model=moe_gpt"),
    "context_parallel_plan": (
        "context_parallel_plan(model) -> ContextParallelPlan (its attention and position modules)",
        "a context parallel plan",
        "model=gpt, model=hf (llama, qwen2, mixtral, gpt2)",
    ),
    "parameter_server_tables": (
        "parameter_server_tables(model, optimizer) -> dict[str, TableSpec]",
        "sparse embedding tables for the servers",
        "model=ctr (with data=ctr)",
    ),
}
PARALLELIZE_MODULE = "parallelize"


def parallel_model(module: torch.nn.Module) -> torch.nn.Module:
    """The module a strategy parallelizes, and whose plans it looks up.

    A LightningModule may name it with a ``parallel_model`` attribute: parallelkit's
    :class:`~parallelkit.models.module.TrainModule` names the model it wraps, so the plans of
    ``models/gpt/parallelize.py`` speak of ``layers.0.attn`` rather than ``model.layers.0.attn``. Any other
    module is parallelized as a whole, and its plans name modules relative to it.
    """
    inner = getattr(module, "parallel_model", None)
    return inner if isinstance(inner, torch.nn.Module) else module


def _import(path: str) -> Any:
    """A module or an object by dotted path (``mypkg.parallelize``, ``mypkg.plans.NetPlans``)."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as err:
        module_name, _, attribute = path.rpartition(".")
        if not module_name or not (path == err.name or path.startswith(f"{err.name}.")):
            raise ConfigError(f"strategy.plan={path} does not import: {err}. Name a module or an object of an importable package.") from None
        try:
            owner = importlib.import_module(module_name)
        except ImportError as inner:
            raise ConfigError(
                f"strategy.plan={path} does not import: {inner}. Name a module (mypkg.parallelize) or an object (mypkg.plans.NetPlans) "
                "of an importable package."
            ) from None
        if not hasattr(owner, attribute):
            raise ConfigError(f"strategy.plan={path}: module {module_name} has no {attribute!r}.") from None
        return getattr(owner, attribute)
    except ImportError as err:  # the module exists but fails to import: show why
        raise ConfigError(f"strategy.plan={path} does not import: {err}.") from None


class ModelPlans:
    """The plans of one model, looked up as the module docstring says.

    Args:
        model: the module the strategy parallelizes (see :func:`parallel_model`).
        source: ``strategy.plan``: a dotted path to a module or object with plan functions, or the object
            itself; ``None``: the model's own methods, then its package's ``parallelize`` module.

    Example::

        plans = ModelPlans(model, "mypkg.parallelize")
        tp_plan = plans.tensor_parallel_plan(2, sequence_parallel=False)
    """

    def __init__(self, model: torch.nn.Module, source: Any = None) -> None:
        self.model = model
        self.source_name = source if isinstance(source, str) else (None if source is None else type(source).__name__)
        provider = _import(source) if isinstance(source, str) else source
        if isinstance(provider, type):
            provider = provider()  # a class of plan methods
        self._provider = provider
        self._package = type(model).__module__.rpartition(".")[0] or type(model).__module__
        self._beside: Any = None
        self._beside_loaded = False

    # ---------------------------------------------------------------- lookup
    def _beside_class(self) -> Any:
        """``<package of the model's class>.parallelize``, or None if there is none."""
        if not self._beside_loaded:
            self._beside_loaded = True
            name = f"{self._package}.{PARALLELIZE_MODULE}"
            try:
                self._beside = importlib.import_module(name)
            except ModuleNotFoundError as err:
                if err.name != name and not name.startswith(f"{err.name}."):
                    raise  # parallelize.py exists but imports something missing: a real error, not "no plan"
        return self._beside

    def find(self, name: str) -> Callable[..., Any] | None:
        """The plan function ``name`` as ``fn(model, ...)``, or None if no source defines it."""
        if name not in PLAN_FUNCTIONS:
            raise ValueError(f"unknown plan function {name!r}; plans are {sorted(PLAN_FUNCTIONS)}")
        if self._provider is not None and callable(getattr(self._provider, name, None)):
            return getattr(self._provider, name)
        method = getattr(self.model, name, None)
        if callable(method):
            return lambda _model, *args, **kwargs: method(*args, **kwargs)
        beside = self._beside_class()
        if beside is not None and callable(getattr(beside, name, None)):
            return getattr(beside, name)
        return None

    def has(self, *names: str) -> bool:
        return all(self.find(name) is not None for name in names)

    def require(self, name: str, who: str) -> Callable[..., Any]:
        """The plan function ``name``; a :class:`ConfigError` naming where to write it if there is none."""
        found = self.find(name)
        if found is None:
            raise ConfigError(self.missing_message(name, who))
        return found

    def missing_message(self, name: str, who: str) -> str:
        signature, what, examples = PLAN_FUNCTIONS[name]
        model = type(self.model).__name__
        where = [f"a module or object named by strategy.plan=PATH (now {self.source_name})" if self.source_name else
                 "a module or object named by strategy.plan=PATH (e.g. strategy.plan=mypkg.parallelize)",
                 f"a method {name}(...) of {model} (without the model argument)",
                 f"{self._package}.{PARALLELIZE_MODULE} (a parallelize.py beside the model's class)"]
        return (f"{who} needs {what} for {model}, and none was found: define {signature} in one of: "
                + "; ".join(where) + f". parallelkit's models with one: {examples}. See README.md, \"Your own model\".")

    # ---------------------------------------------------------------- the plans, called
    def tensor_parallel_plan(self, tp: int, *, sequence_parallel: bool = False, who: str = "strategy=tp") -> Any:
        return self.require("tensor_parallel_plan", who)(self.model, tp, sequence_parallel=sequence_parallel)

    def pipeline_blocks(self, who: str = "strategy=pp") -> int:
        self.require("pipeline_stages", who)  # both halves of the cut, or neither: say so before any work
        return int(self.require("pipeline_blocks", who)(self.model))

    def pipeline_stages(self, blocks_per_stage: list[range], stage_ids: list[int], who: str = "strategy=pp") -> list[torch.nn.Module]:
        return self.require("pipeline_stages", who)(self.model, blocks_per_stage, stage_ids)

    def pipeline_loss(self, who: str = "strategy=pp") -> Callable[..., torch.Tensor]:
        """The plan's ``pipeline_loss(model)`` if its stages pass more than the outputs (an MoE model's aux
        losses), else the model's own ``loss(outputs, targets)``."""
        make = self.find("pipeline_loss")
        if make is not None:
            return make(self.model)
        loss = getattr(self.model, "loss", None)
        if not callable(loss):
            raise ConfigError(self.missing_message("pipeline_loss", who) + f" (or give {type(self.model).__name__} a loss(outputs, targets) method)")
        return loss

    def expert_parallel_plan(self, who: str = "strategy=moe") -> Any:
        return self.require("expert_parallel_plan", who)(self.model)

    def context_parallel_plan(self, who: str = "strategy.cp") -> Any:
        return self.require("context_parallel_plan", who)(self.model)

    def parameter_server_tables(self, optimizer: dict[str, Any], who: str = "strategy=ps") -> dict[str, Any]:
        return self.require("parameter_server_tables", who)(self.model, optimizer)


def model_plans(model: torch.nn.Module, source: Any = None) -> ModelPlans:
    """:class:`ModelPlans` for ``model`` (a LightningModule is resolved with :func:`parallel_model` first)."""
    return ModelPlans(parallel_model(model), source)
