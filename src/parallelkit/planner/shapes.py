"""A model's shape from its config: layer sizes, parameter counts, what tensor parallelism splits.

Analytic for parallelkit's GPT and MoE GPT and for the Hugging Face families :data:`HF_FAMILIES` knows (from the
``config.json`` alone, or from the built-in family config): the counts equal the real modules' (tested per family
in ``tests/unit/test_planner_workload.py``). Any other model (``model._target_=mypkg.Net``, an unknown
``model_type``) is built once on the meta device and measured (:func:`shape_of_module`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from parallelkit.errors import ConfigError
from parallelkit.planner.inputs import block_names, model_shape

GPT_TARGETS = ("parallelkit.models.gpt.GPT", "parallelkit.models.gpt.model.GPT")
MOE_TARGETS = ("parallelkit.models.moe_gpt.MoEGPT", "parallelkit.models.moe_gpt.model.MoEGPT")
HF_TARGETS = ("parallelkit.models.hf.HFCausalLM", "parallelkit.models.hf.model.HFCausalLM")


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a decoder-only transformer as the cost model needs them.

    Parameter counts are elements. ``dense_layer`` is one layer with a dense MLP; an MoE layer has
    ``moe_layer`` (attention, norms, router) plus ``expert_params`` (all its experts, spread over ``ep``).
    ``*_replicated``: the part tensor parallelism leaves whole (norms, biases of row-parallel layers).
    """

    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    gated: bool
    vocab: int
    tied: bool
    dropout: bool
    dense_layer: int
    dense_layer_replicated: int
    embed_params: int
    head_params: int
    first_extra: int
    last_extra: int
    moe_layer: int = 0
    moe_layer_replicated: int = 0
    experts: int = 0
    top_k: int = 1
    moe_layer_ids: tuple[int, ...] = ()
    expert_params: int = 0
    tp_plan: str | None = None  # None: hybrid4d can split it by tp; else why not
    tp_sizes: tuple[tuple[str, int], ...] = ()  # (name, size) that tp must divide, as the model's check names them
    sp_refusal: str | None = None  # why sequence parallelism is refused for this model (None: allowed)
    pp_refusal: str | None = None  # why the model cannot be cut into pipeline stages (None: it can)
    cp_refusal: str | None = None  # why the model has no context-parallel plan (None: it has one)
    max_positions: int | None = None
    layer_tensors: int = 0  # parameter tensors of one dense layer (what per-tensor optimizer work iterates over)
    expert_tensors: int = 0  # parameter tensors of all experts of one MoE layer

    @property
    def num_params(self) -> int:
        moe = len(self.moe_layer_ids)
        return ((self.layers - moe) * self.dense_layer + moe * (self.moe_layer + self.expert_params)
                + self.embed_params + self.head_params + self.first_extra + self.last_extra)

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layer_ids


# ------------------------------------------------------------------------------------ parallelkit's GPTs
def _gpt_layer(h: int, bias: bool) -> tuple[int, int, int]:
    """(attention + norms, of which replicated, MLP) parameters of one GPT block (models/gpt/model.py)."""
    attn = 4 * h * h + (4 * h if bias else 0)
    norms = 2 * (h + (h if bias else 0))
    mlp = 8 * h * h + (5 * h if bias else 0)
    replicated = norms + (2 * h if bias else 0)  # out_proj and down_proj biases: row-parallel, left whole
    return attn + norms, replicated, mlp


def gpt_shape(model_cfg: Any, vocab: int, seq_len: int, *, moe: bool = False) -> ModelShape:
    h, layers, heads = int(model_cfg.get("n_embd", 128)), int(model_cfg.get("n_layer", 4)), int(model_cfg.get("n_head", 4))
    bias = bool(model_cfg.get("bias", True))
    if h % heads:
        raise ConfigError(f"model.n_embd={h} must be divisible by model.n_head={heads} (each head gets n_embd / n_head channels).")
    attn, replicated, mlp = _gpt_layer(h, bias)
    kwargs: dict[str, Any] = {}
    if moe:
        experts, top_k, every = int(model_cfg.get("num_experts", 4)), int(model_cfg.get("top_k", 2)), int(model_cfg.get("moe_every", 1))
        ids = tuple(i for i in range(layers) if i % every == every - 1)
        # An MoE block keeps attention and norms, swaps its MLP for a router and the experts (whole on every tp rank).
        kwargs = dict(moe_layer=attn + h * experts, moe_layer_replicated=replicated - (h if bias else 0) + h * experts,
                      experts=experts, top_k=top_k, moe_layer_ids=ids, expert_params=experts * mlp)
    sizes = (("model.n_head", heads), ("model.n_embd", h), ("vocab_size", vocab))
    per_linear, norms = (2, 4) if bias else (1, 2)
    if moe:
        kwargs["expert_tensors"] = kwargs["experts"] * 2 * per_linear
    return ModelShape(
        layer_tensors=6 * per_linear + norms,
        family="moe_gpt" if moe else "gpt", layers=layers, hidden=h, heads=heads, kv_heads=heads, head_dim=h // heads,
        ffn=4 * h, gated=False, vocab=vocab, tied=False, dropout=float(model_cfg.get("dropout", 0.0)) > 0,
        dense_layer=attn + mlp, dense_layer_replicated=replicated, embed_params=vocab * h, head_params=vocab * h,
        first_extra=seq_len * h, last_extra=h + (h if bias else 0), tp_sizes=sizes,
        sp_refusal=("an MoE layer routes the whole residual stream, which sequence parallelism splits" if moe else None),
        cp_refusal=_gpt_cp_refusal(model_cfg, moe), max_positions=seq_len, **kwargs,
    )


def _gpt_cp_refusal(model_cfg: Any, moe: bool) -> str | None:
    """Why parallelkit's GPT cannot run context parallelism (models/gpt/parallelize.py ``context_parallel_plan``)."""
    if moe:
        return "model=moe_gpt has no context_parallel_plan (models/moe_gpt/parallelize.py)"
    dropout = float(model_cfg.get("dropout", 0.0))
    if dropout:
        return f"model.dropout={dropout}: attention dropout needs whole rows of scores, which no context-parallel rank holds"
    return None


# ------------------------------------------------------------------------------------ Hugging Face configs
#: model_type → how its config names the sizes, its defaults (transformers' config classes) and layout.
#: ``tp_plan``: tensor parallelism can split it (transformers' ``base_model_tp_plan``, or parallelkit's own for GPT-2);
#: ``decoder_loop``: parallelkit rebuilds its decoder loop (``parallelkit.models.hf.decoder.DECODER_LOOP_TYPES``), which
#: pipeline stages and sequence parallelism need (``tests/unit/test_planner_workload.py`` holds the two lists equal).
HF_FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(norm="rms", gated=True, qkv_bias="attention_bias", mlp_bias="mlp_bias", tp_plan=True, decoder_loop=True,
                  defaults=dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=11008,
                                vocab_size=32000, tie_word_embeddings=False)),
    "mistral": dict(norm="rms", gated=True, tp_plan=True,
                    defaults=dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                  intermediate_size=14336, vocab_size=32000, tie_word_embeddings=False)),
    "qwen2": dict(norm="rms", gated=True, qkv_bias=True, tp_plan=True, decoder_loop=True,
                  defaults=dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=22016,
                                vocab_size=151936, tie_word_embeddings=False)),
    "mixtral": dict(norm="rms", gated=True, tp_plan=True, moe=True, decoder_loop=True,
                    defaults=dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                  intermediate_size=14336, vocab_size=32000, tie_word_embeddings=False,
                                  num_local_experts=8, num_experts_per_tok=2)),
    "gpt2": dict(norm="layer", gated=False, qkv_bias=True, mlp_bias=True, learned_positions="n_positions", fused_qkv=True, decoder_loop=True,
                 tp_plan=True,  # no base_model_tp_plan: parallelkit's own (models/hf/gpt2_tensor_parallel.py)
                 aliases=dict(hidden_size="n_embd", num_hidden_layers="n_layer", num_attention_heads="n_head", intermediate_size="n_inner"),
                 defaults=dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024, tie_word_embeddings=True)),
    "opt": dict(norm="layer", gated=False, qkv_bias="enable_bias", mlp_bias="enable_bias", learned_positions="max_position_embeddings",
                aliases=dict(intermediate_size="ffn_dim"),
                defaults=dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, ffn_dim=3072, vocab_size=50272,
                              max_position_embeddings=2048, enable_bias=True, tie_word_embeddings=True)),
    "bloom": dict(norm="layer", gated=False, qkv_bias=True, mlp_bias=True, embedding_norm=True, fused_qkv=True,
                  aliases=dict(num_hidden_layers="n_layer", num_attention_heads="n_head"),
                  defaults=dict(hidden_size=64, n_layer=2, n_head=8, vocab_size=250880, tie_word_embeddings=True)),
}


def _flag(family: dict[str, Any], key: str, config: dict[str, Any]) -> bool:
    value = family.get(key, False)
    return bool(config.get(value, family["defaults"].get(value, False))) if isinstance(value, str) else bool(value)


def hf_shape(config: dict[str, Any], *, source: str = "model=hf") -> ModelShape:
    """The shape of a transformers causal LM from its config dict (``config.json``, or ``PretrainedConfig.to_dict()``)."""
    model_type = config.get("model_type")
    family = HF_FAMILIES.get(model_type)
    if family is None:
        raise KeyError(model_type)
    aliases, defaults = family.get("aliases", {}), family["defaults"]

    def get(name: str, default: Any = None) -> Any:
        key = aliases.get(name, name)
        for k in (key, name):
            if config.get(k) is not None:
                return config[k]
        return defaults.get(key, defaults.get(name, default))

    h, layers, heads = int(get("hidden_size")), int(get("num_hidden_layers")), int(get("num_attention_heads"))
    kv = int(get("num_key_value_heads") or heads)
    head_dim = int(get("head_dim") or h // heads)
    ffn = int(get("intermediate_size") or 4 * h)
    vocab = int(get("vocab_size"))
    tied = bool(config.get("tie_word_embeddings", defaults.get("tie_word_embeddings", False)))
    qkv_bias, mlp_bias = _flag(family, "qkv_bias", config), _flag(family, "mlp_bias", config)
    norm = (2 * h) if family["norm"] == "layer" else h
    q, kvd = heads * head_dim, kv * head_dim
    o_bias = qkv_bias and model_type != "qwen2"  # Qwen2 biases q, k, v only
    attn = h * q + 2 * h * kvd + q * h + ((q + 2 * kvd) if qkv_bias else 0) + (h if o_bias else 0)
    mats = 3 if family["gated"] else 2
    mlp = mats * h * ffn + (((mats - 1) * ffn + h) if mlp_bias else 0)
    # Row-parallel biases (o, down) and the norms stay whole under tensor parallelism.
    replicated = 2 * norm + (h if o_bias else 0) + (h if mlp_bias else 0)
    first = 0
    if family.get("learned_positions"):
        positions = int(get(family["learned_positions"]))
        first += (positions + (2 if model_type == "opt" else 0)) * h
    if family.get("embedding_norm"):
        first += 2 * h
    last = norm
    if model_type == "opt":
        proj = int(config.get("word_embed_proj_dim") or h)
        if proj != h:
            first, last = first + proj * h, last + proj * h
        if not config.get("do_layer_norm_before", True) or config.get("_remove_final_layer_norm", False):
            last -= norm
    kwargs: dict[str, Any] = {}
    norm_tensors = 2 if family["norm"] == "layer" else 1
    if family.get("fused_qkv"):  # one q/k/v projection (GPT-2's c_attn, BLOOM's query_key_value) and the output
        attention_tensors = 2 + (1 if qkv_bias else 0) + (1 if o_bias else 0)
    else:
        attention_tensors = 4 + (3 if qkv_bias else 0) + (1 if o_bias else 0)
    kwargs["layer_tensors"] = attention_tensors + mats + (mats if mlp_bias else 0) + 2 * norm_tensors
    if family.get("moe"):
        experts, top_k = int(get("num_local_experts")), int(get("num_experts_per_tok"))
        kwargs.update(moe_layer=attn + 2 * norm + h * experts, moe_layer_replicated=2 * norm + h * experts, experts=experts,
                      top_k=top_k, moe_layer_ids=tuple(range(layers)), expert_params=experts * mlp, expert_tensors=experts * mats)
    embed_dim = int(config.get("word_embed_proj_dim") or h) if model_type == "opt" else h
    kind = f"model=hf ({model_type})"
    tp_plan = None if family.get("tp_plan") else (
        f"{kind} cannot be split by tensor parallelism: its transformers config carries no base_model_tp_plan")
    # Tied input and output embeddings are no reason to refuse: under tp both are split by vocabulary rows alike, under
    # pp the first and last stage each hold a copy whose gradients are summed (memory.py, cost_model.py).
    loop = family.get("decoder_loop", False)
    pp_refusal = None if loop else (
        f"{kind} cannot be cut into pipeline stages: each stage rebuilds the model's decoder loop (masks, positions), "
        "which parallelkit reproduces only for " + ", ".join(t for t, f in HF_FAMILIES.items() if f.get("decoder_loop")))
    if not loop:
        sp_refusal = "the model's forward builds the attention mask and rotary positions from the whole sequence"
    elif family.get("moe"):
        sp_refusal = "a Mixture-of-Experts block routes the whole residual stream, which sequence parallelism splits"
    elif family.get("learned_positions"):
        sp_refusal = "its learned positions are added to the whole sequence, which sequence parallelism splits"
    else:
        sp_refusal = None
    # As models/hf/parallelize.py's context_parallel_plan refuses (the attention implementation is checked in
    # shape_from_config: it is the model's setting, not the transformers config's).
    window = "sliding_attention" in (config.get("layer_types") or []) or (config.get("sliding_window") and config.get("use_sliding_window", True))
    if not loop:
        cp_refusal = f"{kind} has no context-parallel plan: it needs the decoder loop parallelkit rebuilds (positions from the whole sequence)"
    elif window:
        cp_refusal = f"{kind} uses sliding-window attention, which the ring's causal blocks do not mask"
    elif any(float(config.get(k) or 0) > 0 for k in ("attention_dropout", "attn_pdrop")):
        cp_refusal = f"{kind} has attention dropout, which needs whole rows of scores"
    else:
        cp_refusal = None
    sizes = (("num_attention_heads", heads), ("num_key_value_heads", kv), ("intermediate_size", ffn), ("vocab_size", vocab))
    positions = config.get("max_position_embeddings", config.get("n_positions", defaults.get("max_position_embeddings")))
    return ModelShape(
        family=f"hf:{model_type}", layers=layers, hidden=h, heads=heads, kv_heads=kv, head_dim=head_dim, ffn=ffn,
        gated=family["gated"], vocab=vocab, tied=tied,
        dropout=any(float(config.get(k) or 0) > 0 for k in ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "dropout")),
        dense_layer=attn + 2 * norm + mlp, dense_layer_replicated=replicated, embed_params=vocab * embed_dim,
        head_params=0 if tied else vocab * embed_dim, first_extra=first, last_extra=last, tp_plan=tp_plan, tp_sizes=sizes,
        sp_refusal=sp_refusal, pp_refusal=pp_refusal, cp_refusal=cp_refusal,
        max_positions=int(positions) if positions else None, **kwargs,
    )


def hf_config_dict(model_cfg: Any, vocab: Callable[[], int], seq_len: int) -> dict[str, Any]:
    """The config dict ``model=hf`` would build: the JSON of ``model.config`` / ``model.pretrained`` (read directly,
    without transformers), or the family's built-in config with the data's vocabulary."""
    path = model_cfg.get("pretrained") or model_cfg.get("config")
    if path:
        setting = "model.pretrained" if model_cfg.get("pretrained") else "model.config"
        file = Path(str(path)).expanduser()
        file = file / "config.json" if file.is_dir() else file
        if not file.is_file():
            raise ConfigError(f"{setting}={path}: no config.json there. Give a directory written by save_pretrained (or its config.json).")
        data = json.loads(file.read_text())
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                    "num_local_experts", "num_experts_per_tok"):
            if model_cfg.get(key) is not None:
                data[key] = model_cfg[key]
        data.update(dict(model_cfg.get("overrides") or {}))
        return data
    from parallelkit.models.hf.model import build_config  # the family's defaults live in transformers

    sizes = {k: model_cfg.get(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                          "intermediate_size", "num_local_experts", "num_experts_per_tok")}
    config = build_config(model_cfg.get("family"), None, None, sizes, dict(model_cfg.get("overrides") or {}))
    config.vocab_size = vocab()
    config.max_position_embeddings = seq_len
    data = config.to_dict()
    if data.get("model_type") == "gpt2":
        data["n_positions"] = seq_len
    return data


# ------------------------------------------------------------------------------------ dispatch
def shape_from_config(model_cfg: Any, seq_len: int, data_vocab: Callable[[], int], *,
                      datamodule_kwargs: Callable[[], dict[str, Any]]) -> ModelShape:
    """The :class:`ModelShape` of ``model=`` (see the module docstring)."""
    target = str(model_cfg.get("_target_", ""))

    def vocab() -> int:
        given = model_cfg.get("vocab_size")
        return int(given) if given is not None else data_vocab()

    if target in GPT_TARGETS or target in MOE_TARGETS:
        return gpt_shape(model_cfg, vocab(), seq_len, moe=target in MOE_TARGETS)
    if target in HF_TARGETS:
        config = hf_config_dict(model_cfg, vocab, seq_len)
        try:
            shape = hf_shape(config)
        except KeyError:
            pass
        else:
            attention = model_cfg.get("attn_implementation", "sdpa")
            if attention != "sdpa" and shape.cp_refusal is None:  # context parallelism replaces the SDPA call
                shape = replace(shape, cp_refusal=f"model.attn_implementation={attention}: context parallelism replaces the "
                                                  "scaled_dot_product_attention call (sdpa)")
            return shape
    return shape_of_module(model_cfg, datamodule_kwargs(), seq_len)


def shape_of_module(model_cfg: Any, kwargs: dict[str, Any], seq_len: int) -> ModelShape:
    """A model the planner has no formula for: build it once on the meta device and measure it."""
    import torch
    from hydra.utils import instantiate

    with torch.device("meta"):
        model = instantiate(model_cfg, **kwargs)
    sizes = model_shape(model, type("D", (), {"model_kwargs": staticmethod(lambda: kwargs)})())
    modules = dict(model.named_modules())
    blocks = block_names(model)
    layer = max((sum(p.numel() for p in modules[b].parameters()) for b in blocks), default=0)
    total = sum(p.numel() for p in model.parameters())
    h, heads = sizes["n_embd"], max(sizes["n_head"], 1)
    rest = total - layer * len(blocks)
    return ModelShape(
        family="module", layers=len(blocks), hidden=h, heads=heads, kv_heads=heads, head_dim=h // heads if h else 0,
        ffn=4 * h, gated=False, vocab=sizes["vocab_size"], tied=False, dropout=False, dense_layer=layer,
        dense_layer_replicated=0, embed_params=0, head_params=0, first_extra=rest, last_extra=0,
        tp_plan=None, tp_sizes=(("model.n_head", heads),), max_positions=seq_len,
        cp_refusal="the planner searches cp only for models it has a formula for (GPT, the Hugging Face families)",
    )
