"""A Hugging Face causal LM under parallelkit's model contract: built locally, never downloaded.

``model=hf`` builds a ``transformers`` causal language model from one of three sources, in this order:

- ``model.pretrained=PATH``: a ``save_pretrained`` directory (``config.json`` and weights): its weights;
- ``model.config=PATH``: a directory holding a ``config.json`` (or the file itself): randomly initialised;
- ``model.family=llama|qwen2|gpt2|mixtral`` (default ``llama``): a small built-in config of the family, sized by
  ``model.hidden_size``, ``model.num_hidden_layers``, ... (``model.overrides`` sets any other config key).

:class:`HFCausalLM` keeps the ``transformers`` model as ``self.hf`` and offers parallelkit's contract:
``forward(input_ids) -> logits`` and ``loss(logits, targets)``, the mean next-token cross-entropy (the data
modules give targets already shifted). Its parallel plans come from the model's own config
(``base_model_tp_plan``, ``base_model_pp_plan``), mapped in ``parallelize.py`` beside this file. The vocabulary
comes from the data module (its tokenizer): a family config takes it; a given config must hold at least as many
rows, or it is an error.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from parallelkit.errors import ConfigError
from parallelkit.models.hf.decoder import DECODER_LOOP_TYPES, base_model, decoder_layers, final_norm, run_decoder
from parallelkit.models.hf.moe import group_experts

#: family → (transformers config class, its small defaults). Input and output embeddings untied (override with
#: tie_word_embeddings=true: tensor parallelism then shards the one matrix once, pipeline parallelism keeps a copy on
#: the first and the last stage and sums their gradients, see parallelize.py);
#: no dropout, as parallelkit's own GPT, so that every strategy can reproduce one process exactly.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)),
    "qwen2": ("Qwen2Config", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                  tie_word_embeddings=False)),
    "gpt2": ("GPT2Config", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, tie_word_embeddings=False,
                                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "mixtral": ("MixtralConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                      num_local_experts=4, num_experts_per_tok=2)),
}
#: a family's own name for a size key (GPT-2 calls the MLP width n_inner).
ALIASES: dict[str, dict[str, str]] = {"gpt2": {"intermediate_size": "n_inner"}}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:
        raise ConfigError(f"model=hf needs the transformers package ({err}); pip install parallelkit installs it.") from None
    transformers.logging.set_verbosity_error()  # its per-rank notices (weights initialised, ...) repeat on every rank
    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars, on every rank
    return transformers


def _config_file(path: str, setting: str) -> Path:
    file = Path(path).expanduser()
    file = file / "config.json" if file.is_dir() else file
    if not file.is_file():
        raise ConfigError(f"{setting}={path}: no config.json there. Give a directory written by save_pretrained (or its config.json).")
    return file


def build_config(family: str | None, config: str | None, pretrained: str | None, sizes: dict[str, Any],
                 overrides: dict[str, Any]) -> Any:
    """The ``transformers`` config of the run: from ``pretrained``, ``config``, or the family's small one."""
    transformers = _transformers()
    chosen = [name for name, value in (("model.pretrained", pretrained), ("model.config", config), ("model.family", family)) if value]
    if len(chosen) > 1:
        raise ConfigError(f"{' and '.join(chosen)} are both set: give one source for the model (pretrained weights, a config directory, or a family).")
    given_sizes = {k: v for k, v in sizes.items() if v is not None}
    if pretrained or config:
        setting, path = ("model.pretrained", pretrained) if pretrained else ("model.config", config)
        data = json.loads(_config_file(path, setting).read_text())
        if "model_type" not in data:
            raise ConfigError(f"{setting}={path}: its config.json has no model_type, so transformers cannot tell which model it describes.")
        hf_config = transformers.AutoConfig.for_model(**data)
        if pretrained and (given_sizes or overrides):
            raise ConfigError(f"model.pretrained={pretrained} fixes the model's sizes; {sorted({**given_sizes, **overrides})} cannot take effect. Drop them.")
    else:
        name = family or "llama"
        if name not in FAMILIES:
            raise ConfigError(f"model.family must be one of {', '.join(FAMILIES)}. Got {name!r}.")
        class_name, defaults = FAMILIES[name]
        config_class = getattr(transformers, class_name)
        known = set(config_class().to_dict()) | set(getattr(config_class, "attribute_map", {}))
        aliases = ALIASES.get(name, {})
        for key, value in given_sizes.items():
            if aliases.get(key, key) not in known:
                raise ConfigError(f"model.{key}={value} cannot take effect: a {class_name} (model.family={name}) has no {key}. Drop it.")
        hf_config = config_class(**{**defaults, **{aliases.get(k, k): v for k, v in given_sizes.items()}})
        given_sizes = {}
    for key, value in {**given_sizes, **overrides}.items():
        if not hasattr(hf_config, key):
            raise ConfigError(f"model.{key}={value}: a {type(hf_config).__name__} has no {key!r}.")
        setattr(hf_config, key, value)
    return hf_config


def check_fits_data(hf_config: Any, vocab_size: int, block_size: int, source: str, tokenizer_vocab_size: int | None = None) -> None:
    """The model's vocabulary holds the ids the tokenizer produces (``tokenizer_vocab_size`` when the data says it:
    ``vocab_size`` may be padded up to ``data.vocab_multiple``, ids that never occur), and its positions the
    sequence length."""
    produced = tokenizer_vocab_size or vocab_size
    if hf_config.vocab_size < produced:
        fix = ("Use the tokenizer saved with the model (data.tokenizer=PATH)" if source.startswith("model.pretrained") else
               f"Give the model the tokenizer's vocabulary: +model.overrides.vocab_size={produced} (random weights, so any size "
               "works), or use the tokenizer that belongs to the config (data.tokenizer=PATH)")
        raise ConfigError(
            f"{source} has a vocabulary of {hf_config.vocab_size} tokens, but the data's tokenizer produces ids up to "
            f"{produced - 1} ({produced} ids): the model and the tokenizer do not belong together. {fix}."
        )
    positions = getattr(hf_config, "max_position_embeddings", None)
    if positions is not None and positions < block_size:
        raise ConfigError(f"{source} takes at most {positions} positions, fewer than data.seq_len={block_size}. Use data.seq_len<={positions}.")


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM (``self.hf``) with ``forward(input_ids) -> logits`` and ``loss``.

    Args:
        vocab_size / block_size: from the data module (tokenizer vocabulary, ``data.seq_len``).
        tokenizer_vocab_size: from the data module too: the ids its tokenizer produces (``vocab_size`` before padding).
        family: a small built-in config (``llama``, ``qwen2``, ``gpt2``, ``mixtral``); the default when neither
            ``config`` nor ``pretrained`` is given.
        config: a local config directory (``config.json``): random initialisation.
        pretrained: a local ``save_pretrained`` directory: its weights.
        hidden_size ... num_experts_per_tok: sizes of a family or ``config`` model.
        overrides: any other config keys (``{rope_theta: 10000.0}``).
        attn_implementation: ``sdpa`` (default) or ``eager``.

    Example::

        model = HFCausalLM(vocab_size=256, block_size=64, family="llama", num_hidden_layers=2)
        loss = model.loss(model(ids[:, :-1]), ids[:, 1:])
    """

    def __init__(self, vocab_size: int, block_size: int, family: str | None = None, config: str | None = None,
                 pretrained: str | None = None, hidden_size: int | None = None, num_hidden_layers: int | None = None,
                 num_attention_heads: int | None = None, num_key_value_heads: int | None = None,
                 intermediate_size: int | None = None, num_local_experts: int | None = None,
                 num_experts_per_tok: int | None = None, overrides: dict[str, Any] | None = None,
                 attn_implementation: str = "sdpa", tokenizer_vocab_size: int | None = None) -> None:
        super().__init__()
        transformers = _transformers()
        sizes = dict(hidden_size=hidden_size, num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                     num_key_value_heads=num_key_value_heads, intermediate_size=intermediate_size,
                     num_local_experts=num_local_experts, num_experts_per_tok=num_experts_per_tok)
        hf_config = build_config(family, config, pretrained, sizes, dict(overrides or {}))
        if not (config or pretrained):  # a family config takes the data's sizes
            hf_config.vocab_size = vocab_size
            hf_config.max_position_embeddings = block_size
        source = f"model.pretrained={pretrained}" if pretrained else f"model.config={config}" if config else f"model.family={family or 'llama'}"
        check_fits_data(hf_config, vocab_size, block_size, source, tokenizer_vocab_size)
        hf_config._attn_implementation = attn_implementation
        if pretrained:
            self.hf = transformers.AutoModelForCausalLM.from_pretrained(pretrained, config=hf_config, dtype=torch.float32,
                                                                         local_files_only=True)
        else:
            self.hf = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        self.block_size = block_size
        # Mixture-of-Experts blocks: experts as per-expert modules, which expert parallelism can spread (see moe.py)
        self.moe_blocks = group_experts(self.hf)

    @property
    def config(self) -> Any:
        """The ``transformers`` config (``model_type``, ``base_model_tp_plan``, sizes)."""
        return self.hf.config

    def export_metadata(self) -> dict[str, Any]:
        """What ``python -m parallelkit.export`` needs to rebuild the ``transformers`` model from a checkpoint."""
        return {"format": "transformers", "config": self.hf.config.to_dict(), "state_dict_prefix": "hf.",
                "grouped_experts": list(self.moe_blocks), "num_experts": getattr(self.hf.config, "num_local_experts", 0)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.config.model_type not in DECODER_LOOP_TYPES:
            return self.hf(input_ids=input_ids, use_cache=False).logits
        # The same computation as transformers' forward (tested), by the loop the pipeline stages and sequence
        # parallelism need (decoder.py): masks and positions built from the whole sequence.
        _, base = base_model(self)
        return run_decoder(self.config, input_ids, enumerate(decoder_layers(self)), embed=self.hf.get_input_embeddings(),
                           positions=getattr(base, "wpe", None), drop=getattr(base, "drop", None),
                           rotary=getattr(base, "rotary_emb", None), norm=final_norm(base), lm_head=self.hf.get_output_embeddings())

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy over all positions (targets are the inputs shifted by one)."""
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
