"""What the planner reads from a run's config: the composed ``train`` config, the data module and the model on
the ``meta`` device, and the sizes the estimates need.

Both planners start here: the cost model (:mod:`~parallelkit.planner.shapes` measures a model it has no formula
for) and the per-rank dry run (:mod:`~parallelkit.planner.dry_run`). torch and Hydra are imported inside the
functions, so that importing the planner stays arithmetic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def compose_config(overrides: list[str]) -> Any:
    """The ``train`` config composed with ``overrides``, as ``train.py`` and the ``parallelkit`` command see it
    (the configs parallelkit carries, ``parallelkit.conf``: the checkout's ``conf/`` in an editable install).
    Without the ``hydra`` node, the only one that uses the launcher's resolvers (:mod:`parallelkit.launch.resolvers`:
    the run directory's name, the log files): none is needed here."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="parallelkit.conf", version_base="1.3"):
        return compose("train", overrides=list(overrides))


def build_workload(cfg: Any, data_parallel_size: int = 1) -> tuple[Any, torch.nn.Module]:
    """The composed run's data module, configured for ``data_parallel_size`` (the data sets decide the
    vocabulary), and its model on the ``meta`` device (no memory)."""
    import torch
    from hydra.utils import instantiate

    datamodule = instantiate(cfg.data)
    datamodule.configure(data_parallel_size, cfg.trainer.get("accumulate_grad_batches", 1))
    with torch.device("meta"):
        model = instantiate(cfg.model, **datamodule.model_kwargs())
    return datamodule, model


def model_shape(model: torch.nn.Module, datamodule: Any) -> dict[str, int]:
    """The sizes the estimates need: sequence length, width, heads (and key/value heads), layers, vocabulary, MoE top-k."""
    config = getattr(model, "config", None)
    kwargs = datamodule.model_kwargs()

    def size(*names: str, default: int) -> int:  # parallelkit's GPT config, or a transformers config's names
        return next((int(getattr(config, n)) for n in names if getattr(config, n, None) is not None), default)

    return {"seq_len": kwargs.get("block_size", 1), "n_embd": size("n_embd", "hidden_size", default=0),
            "n_head": size("n_head", "num_attention_heads", default=1), "n_layer": size("n_layer", "num_hidden_layers", default=0),
            "n_kv_head": size("num_key_value_heads", "n_head", "num_attention_heads", default=1),
            "vocab_size": kwargs.get("vocab_size", 0), "top_k": getattr(model, "top_k", None) or size("num_experts_per_tok", default=1)}


def block_names(model: torch.nn.Module) -> list[str]:
    """Qualified names of the model's repeated blocks (``layers.0``, ``hf.model.layers.0``: the units FSDP2 shards)."""
    from parallelkit.distributed.blocks import repeated_blocks

    ids = {id(b) for b in repeated_blocks(model)}
    return [name for name, module in model.named_modules() if id(module) in ids]
