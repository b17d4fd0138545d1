"""The decoder loop of a Hugging Face causal LM, written once for the whole model and for its pipeline stages.

``transformers``' own model forward embeds, builds the attention masks (full and sliding-window layers' own)
and the rotary position embeddings from the sequence it sees, then runs the layers and the final norm. A
pipeline stage runs only some layers, and under sequence parallelism a rank embeds only its part of the
sequence: both need that loop with the masks and positions built from the *whole* sequence. :func:`run_decoder`
is that loop; :class:`~parallelkit.models.hf.HFCausalLM` uses it for the families whose forward it reproduces
(``DECODER_LOOP_TYPES``: the tests hold its logits equal to ``transformers``' own) and ``transformers``'
forward for any other model type (then the pipeline and sequence parallelism refuse it).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from parallelkit.errors import ConfigError

#: model types whose forward run_decoder reproduces (tested against transformers' forward).
DECODER_LOOP_TYPES = ("llama", "qwen2", "mixtral", "gpt2")


def _masks(config: Any, like: torch.Tensor, position_ids: torch.Tensor) -> dict[str, Any]:
    """The attention masks the model's forward builds, by layer type (full attention, sliding-window layers)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    common = dict(config=config, inputs_embeds=like, attention_mask=None, cache=None, position_ids=position_ids)
    masks = {"full_attention": create_causal_mask(**common)}
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        masks["sliding_attention"] = create_sliding_window_causal_mask(**common)
    return masks


def run_decoder(config: Any, x: torch.Tensor, layers: Iterable[tuple[int, nn.Module]], *, embed: nn.Module | None = None,
                positions: nn.Module | None = None, drop: nn.Module | None = None, rotary: nn.Module | None = None,
                norm: nn.Module | None = None, lm_head: nn.Module | None = None) -> torch.Tensor:
    """Token ids (with ``embed``) or hidden states → the given layers (``(index, layer)``) → logits (with ``lm_head``).

    ``positions``/``drop``: GPT-2's learned positions and embedding dropout; ``rotary``: the rotary embedding of
    the Llama-style families. ``x`` always spans the whole sequence (token ids, or a previous stage's output).
    """
    seq = x.shape[1]
    position_ids = torch.arange(seq, device=x.device).unsqueeze(0)
    hidden = x
    if embed is not None:
        hidden = embed(x)
        if positions is not None:
            hidden = hidden + positions(position_ids)
        if drop is not None:
            hidden = drop(hidden)
    # Under sequence parallelism the embedding returns this rank's part of the sequence: the masks are built for
    # the whole one (they only read the shape, dtype and device of what they are given).
    like = hidden if hidden.shape[1] == seq else hidden.new_zeros(()).expand(hidden.shape[0], seq, hidden.shape[-1])
    masks = _masks(config, like, position_ids)
    kwargs: dict[str, Any] = {"position_ids": position_ids}
    if rotary is not None:
        kwargs["position_embeddings"] = rotary(like, position_ids=position_ids)
    layer_types = getattr(config, "layer_types", None)
    for index, layer in layers:
        out = layer(hidden, attention_mask=masks[layer_types[index] if layer_types else "full_attention"], **kwargs)
        hidden = out[0] if isinstance(out, tuple) else out
    if lm_head is not None:
        hidden = lm_head(norm(hidden))
    return hidden


def base_model(model: nn.Module) -> tuple[str, nn.Module]:
    """``(qualified name, module)`` of the ``transformers`` base model inside :class:`HFCausalLM` (``hf.model``)."""
    prefix = model.hf.base_model_prefix
    return f"hf.{prefix}", getattr(model.hf, prefix)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder-layer list: ``base_model_pp_plan``'s ``layers`` entry, or the base model's only ModuleList (GPT-2's ``h``)."""
    _, base = base_model(model)
    plan = getattr(model.config, "base_model_pp_plan", None) or {}
    names = [name for name in plan if isinstance(getattr(base, name, None), nn.ModuleList)]
    if not names:
        names = [name for name, child in base.named_children() if isinstance(child, nn.ModuleList)]
    if len(names) != 1:
        raise ConfigError(f"model=hf ({model.config.model_type}): cannot tell its decoder-layer list among {names or 'no ModuleList'}.")
    return getattr(base, names[0])


def final_norm(base: nn.Module) -> nn.Module:
    for name in ("norm", "ln_f", "final_layernorm"):
        if isinstance(getattr(base, name, None), nn.Module):
            return getattr(base, name)
    raise ConfigError(f"model=hf: cannot find the final norm of {type(base).__name__} for the last pipeline stage.")
