"""Parallel plans of a Hugging Face causal LM (:class:`~parallelkit.models.hf.HFCausalLM`), read from its config.

``transformers`` configs carry their own plans: ``base_model_tp_plan`` (module pattern → ``colwise`` /
``rowwise`` / ...) and ``base_model_pp_plan`` (the embedding, the decoder-layer list and the final norm, in
order). Here they are mapped onto parallelkit's techniques, so the strategies treat a Hugging Face model like any
other (:mod:`parallelkit.models.plans`):

- **tensor parallel**: the config's plan on the decoder layers (attention heads and MLP units split over ``tp``,
  Megatron's layout), plus what parallelkit adds as for its own GPT: a vocabulary-parallel embedding and output
  layer, the loss under ``loss_parallel`` (the full ``(batch, seq, vocab)`` logits never exist), and sequence
  parallelism on request (the norms on sequence shards; the decoder loop of ``decoder.py`` builds the masks and
  positions from the whole sequence). Grouped-query attention needs the key/value heads to divide by ``tp`` too.
  GPT-2, whose config carries no plan (its attention fuses q, k and v into one ``Conv1D``), gets parallelkit's
  (``gpt2_tensor_parallel.py``: each rank the q, k and v columns of its heads, Megatron's head-grouped order).
- **tied input and output embeddings** (``tie_word_embeddings=true``): under tensor parallelism the one matrix is
  sharded once over the vocabulary and shared by the embedding and the output layer
  (:func:`~parallelkit.distributed.tied_weights.tie_parallel_styles`); under pipeline parallelism the first stage
  keeps the embedding and the last the output layer, each a copy, whose gradients
  :func:`~parallelkit.distributed.tied_weights.apply_tied_embedding_sync` sums after each backward (the stages
  name them in ``tied_weights``).
- **pipeline parallel**: stages of consecutive decoder layers; the first also embeds, the last also normalises
  and predicts. Each stage rebuilds the rotary positions and the causal mask the model's own forward builds.
- **ZeRO-3 and recomputation** need no plan: their units default to the decoder layers (the children of the
  model's ``ModuleList``).
- **expert parallel** (Mixtral): the experts of every Mixture-of-Experts block, rebuilt as per-expert modules when
  the model is built (``moe.py``), spread over ``ep`` ranks by :func:`~parallelkit.distributed.expert_parallel.apply_ep`;
  under tensor parallelism the experts stay whole on every tp rank (as for parallelkit's MoE GPT).

What is refused, with the reason: a config without ``base_model_tp_plan`` other than GPT-2's under tensor
parallelism; sequence parallelism with GPT-2 (its learned positions are added to the whole sequence), with
Mixture-of-Experts blocks (they route the whole residual stream) or a model type whose decoder loop parallelkit
does not rebuild; a model type other than those (``decoder.DECODER_LOOP_TYPES``) under pipeline parallelism.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from parallelkit.errors import ConfigError
from parallelkit.models.hf.decoder import DECODER_LOOP_TYPES, base_model, decoder_layers, final_norm, run_decoder

TP_BLOCK_KIND = "tp_block"


def _name_of(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def _tied(model: nn.Module) -> bool:
    return model.hf.get_output_embeddings().weight is model.hf.get_input_embeddings().weight


# ==================================================================== tensor parallel plan
def _styles() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(), "colwise_rep": ColwiseParallel(output_layouts=Replicate()),
            "rowwise_rep": RowwiseParallel(input_layouts=Replicate())}


def check_tensor_parallel(model: nn.Module, tp: int, sequence_parallel: bool) -> dict[str, str]:
    """The config's TP plan, after checking that ``tp`` can split this model (raises :class:`ConfigError`)."""
    config = model.config
    plan = getattr(config, "base_model_tp_plan", None)
    kind = f"model=hf ({config.model_type})"
    if config.model_type == "gpt2":
        if sequence_parallel:
            raise ConfigError(f"strategy.sequence_parallel=true with {kind}: GPT-2 adds its learned positions to the whole "
                              "sequence, which sequence parallelism splits. Set strategy.sequence_parallel=false.")
        plan = {}  # parallelkit's own plan for GPT-2's Conv1D layers (gpt2_tensor_parallel.py)
    elif not plan:
        raise ConfigError(
            f"{kind} cannot be split by tensor parallelism: its transformers config carries no base_model_tp_plan. Use a "
            "family whose config has one (llama, qwen2) or GPT-2, or strategy=zero / pp, which need no split of the layers."
        )
    if sequence_parallel and (config.model_type not in DECODER_LOOP_TYPES or getattr(model, "moe_blocks", None)):
        why = ("a Mixture-of-Experts block routes the whole residual stream, which sequence parallelism splits"
               if getattr(model, "moe_blocks", None) else
               f"parallelkit rebuilds the decoder loop (masks and positions from the whole sequence) only for {', '.join(DECODER_LOOP_TYPES)}")
        raise ConfigError(f"strategy.sequence_parallel=true with {kind}: {why}. Set strategy.sequence_parallel=false.")
    if getattr(model, "moe_blocks", None):  # experts stay whole on every tp rank: expert parallelism spreads them
        plan = {pattern: style for pattern, style in plan.items() if ".experts" not in pattern}
    if any(style not in _styles() for style in plan.values()):
        unsupported = sorted({f"{pattern}: {style}" for pattern, style in plan.items() if style not in _styles()})
        raise ConfigError(f"{kind} has layers tensor parallelism cannot split here ({'; '.join(unsupported)}). Use strategy=zero or pp.")
    sizes = {
        "num_attention_heads": (config.num_attention_heads, "attention heads are split across ranks"),
        "num_key_value_heads": (getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                                "grouped-query attention splits the key/value heads too"),
        "intermediate_size": (getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * config.hidden_size,
                              "the MLP units are split"),
        "vocab_size": (config.vocab_size, "the embedding and output layer are split over the vocabulary"),
    }
    bad = [f"model.{name}={value} ({why})" for name, (value, why) in sizes.items() if value % tp]
    if bad:
        raise ConfigError(f"strategy.tp={tp} does not divide " + "; ".join(bad) + ". Pick a tp that divides all of them.")
    return plan


def tensor_parallel_plan(model: nn.Module, tp: int, *, sequence_parallel: bool = False) -> Any:
    """The config's ``base_model_tp_plan`` on the decoder layers, with a vocabulary-parallel embedding, output layer and loss."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from parallelkit.distributed.tensor_parallel import TensorParallelPlan

    plan = check_tensor_parallel(model, tp, sequence_parallel)
    prefix, base = base_model(model)
    # The residual stream between the parallel regions: whole, or split along the sequence (sequence parallel:
    # norms on sequence shards, each all-reduce becomes a reduce-scatter plus an all-gather, as in the GPT's plan).
    stream = Shard(1) if sequence_parallel else Replicate()
    styles = {**_styles(), "rowwise": RowwiseParallel(output_layouts=stream)}
    layout = {f"{prefix}.{pattern}": styles[style] for pattern, style in plan.items()}
    embed, head = _name_of(model, model.hf.get_input_embeddings()), _name_of(model, model.hf.get_output_embeddings())
    layout[embed] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    layout[head] = ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False)
    if _tied(model):  # one matrix, sharded once over the vocabulary for both uses
        from parallelkit.distributed.tied_weights import tie_parallel_styles

        layout[embed], layout[head] = tie_parallel_styles(layout[embed], layout[head])
    layers = _name_of(model, decoder_layers(model))
    if model.config.model_type == "gpt2":
        from parallelkit.models.hf.gpt2_tensor_parallel import Conv1DColwise, Conv1DRowwise, GPT2LocalHeads

        layout.update({
            f"{layers}.*.attn": GPT2LocalHeads(),
            f"{layers}.*.attn.c_attn": Conv1DColwise(fused=3, heads=model.config.num_attention_heads),
            f"{layers}.*.attn.c_proj": Conv1DRowwise(),
            f"{layers}.*.mlp.c_fc": Conv1DColwise(),
            f"{layers}.*.mlp.c_proj": Conv1DRowwise(),
        })
    if sequence_parallel:
        from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

        layout[_name_of(model, final_norm(base))] = SequenceParallel()
        for name, child in decoder_layers(model)[0].named_children():
            if "Norm" in type(child).__name__:
                layout[f"{layers}.*.{name}"] = SequenceParallel()
        # attention takes its input as a keyword (hidden_states=...), the MLP positionally: both whole
        layout[f"{layers}.*.self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": stream},
                                                             desired_input_kwarg_layouts={"hidden_states": Replicate()})
        layout[f"{layers}.*.mlp"] = PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),))
        # Layers hand on a DTensor of the sequence shard: a pipeline stage then receives the whole sequence's shape, from
        # which it builds the causal mask and rotary positions (a plain shard gave them for seq / tp positions).
        from parallelkit.distributed.tensor_parallel import sequence_parallel_blocks

        layout[f"{layers}.*"] = sequence_parallel_blocks(stream)
    return TensorParallelPlan(layout=layout, scopes={f"{layers}.*": TP_BLOCK_KIND}, loss_parallel=True)


# ==================================================================== pipeline split points
def pipeline_blocks(model: nn.Module) -> int:
    if model.config.model_type not in DECODER_LOOP_TYPES:
        raise ConfigError(
            f"model=hf ({model.config.model_type}) cannot be cut into pipeline stages: each stage rebuilds the model's "
            f"decoder loop (masks, positions), which parallelkit reproduces only for {', '.join(DECODER_LOOP_TYPES)}. "
            "Use strategy=zero or tp."
        )
    return len(decoder_layers(model))


class HFPipelineStage(nn.Module):
    """One pipeline stage of a Hugging Face decoder: a view on the model's modules, not a copy.

    The first stage embeds the token ids (and adds learned positions where the model has them, GPT-2); every
    stage rebuilds what the model's forward passes to each layer (causal mask, rotary position embeddings) and
    runs its layers; the last normalises and returns the logits.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], first: bool, last: bool) -> None:
        super().__init__()
        _, base = base_model(model)
        self.config = model.config
        self.embed = model.hf.get_input_embeddings() if first else None
        self.positions = getattr(base, "wpe", None) if first else None  # learned positions (GPT-2)
        self.drop = getattr(base, "drop", None) if first else None
        self.rotary = getattr(base, "rotary_emb", None)  # buffers only: every stage has it
        layers = decoder_layers(model)
        self.layers = nn.ModuleDict({str(i): layers[i] for i in layer_ids})
        self.norm = final_norm(base) if last else None
        self.lm_head = model.hf.get_output_embeddings() if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_decoder(self.config, x, ((int(i), layer) for i, layer in self.layers.items()), embed=self.embed,
                           positions=self.positions, drop=self.drop, rotary=self.rotary, norm=self.norm, lm_head=self.lm_head)


def pipeline_stages(model: nn.Module, blocks_per_stage: list[range], stage_ids: list[int]) -> list[nn.Module]:
    """Build this rank's stages and drop every module no local stage uses (in place; names stay, so
    checkpoints and optimizer state keep their keys).

    Tied embeddings: the first stage keeps the input embedding, the last the output layer, each a copy of the one
    weight, named in the stages' ``tied_weights`` for :func:`~parallelkit.distributed.tied_weights.apply_tied_embedding_sync`;
    checkpoints keep both names (the embedding's from the first stage, ``lm_head.weight`` from the last)."""
    last = len(blocks_per_stage) - 1
    tied = last > 0 and _tied(model)
    if tied and 0 in stage_ids and last in stage_ids:
        # One rank runs both ends (V-shaped schedule): the last stage gets its own copy, as on any other rank (the
        # schedule divides each stage's gradients by the micro-batch count: twice, for a weight shared by two stages).
        head = model.hf.get_output_embeddings()
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
    stages = [HFPipelineStage(model, list(blocks_per_stage[s]), s == 0, s == last) for s in stage_ids]
    if tied:
        for stage, s in zip(stages, stage_ids):
            if s in (0, last):
                stage.tied_weights = {"embedding": "embed.weight" if s == 0 else "lm_head.weight"}
    kept = {i for s in stage_ids for i in blocks_per_stage[s]}
    layers = decoder_layers(model)
    for i in range(len(layers)):
        if i not in kept:
            layers[i] = nn.Identity()
    _, base = base_model(model)
    if 0 not in stage_ids:
        for name in ("embed_tokens", "wte", "wpe"):
            if getattr(base, name, None) is not None:
                setattr(base, name, None)
    if last not in stage_ids:
        setattr(base, _name_of(base, final_norm(base)), None)
        model.hf.lm_head = None
    return stages


# ==================================================================== context parallel plan
def context_parallel_plan(model: nn.Module) -> Any:
    """Each rank holds two chunks of every sequence: the decoder layers' attention (its SDPA call) runs over the cp
    ranks, and the rotary embedding (or GPT-2's learned positions) gets the positions of this rank's tokens in the whole
    sequence. Needs the decoder loop parallelkit rebuilds, SDPA attention and a causal mask without a sliding window."""
    from parallelkit.distributed.context_parallel import ContextParallelPlan

    config = model.config
    kind = f"model=hf ({config.model_type})"
    if config.model_type not in DECODER_LOOP_TYPES:
        raise ConfigError(f"strategy.cp with {kind}: context parallelism needs the decoder loop parallelkit rebuilds (positions "
                          f"from the whole sequence), which it has for {', '.join(DECODER_LOOP_TYPES)}. Use strategy.cp=1.")
    if getattr(config, "_attn_implementation", None) != "sdpa":
        raise ConfigError(f"strategy.cp with {kind} and attn_implementation={config._attn_implementation}: context parallelism "
                          "replaces the scaled_dot_product_attention call. Set model.attn_implementation=sdpa.")
    layer_types = getattr(config, "layer_types", None) or []
    if "sliding_attention" in layer_types or (getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)):
        raise ConfigError(f"strategy.cp with {kind}: its sliding-window attention masks keys by distance, which the ring's "
                          "causal blocks do not. Disable the sliding window (model.overrides) or use strategy.cp=1.")
    if getattr(config, "attention_dropout", 0.0) or getattr(config, "attn_pdrop", 0.0):
        raise ConfigError(f"strategy.cp with {kind}: attention dropout needs whole rows of scores, which no rank holds. "
                          "Set it to 0 (model.overrides).")
    layers = _name_of(model, decoder_layers(model))
    attention = [name for name, child in decoder_layers(model)[0].named_children() if "Attention" in type(child).__name__]
    if len(attention) != 1:
        raise ConfigError(f"strategy.cp with {kind}: cannot tell the attention module of its decoder layer among {attention}.")
    prefix, base = base_model(model)
    positions = [f"{prefix}.{name}" for name in ("rotary_emb", "wpe") if isinstance(getattr(base, name, None), nn.Module)]
    heads = config.num_attention_heads
    return ContextParallelPlan(attention=(f"{layers}.*.{attention[0]}",), positions=tuple(positions), heads=heads,
                               kv_heads=getattr(config, "num_key_value_heads", None) or heads)


# ==================================================================== expert parallel
def expert_parallel_plan(model: nn.Module) -> Any:
    """The Mixture-of-Experts blocks (rebuilt as grouped experts, ``moe.py``): their experts spread over ``ep`` ranks,
    tokens dispatched to them by all-to-all; routers, attention and everything else dense."""
    from parallelkit.distributed.expert_parallel import ExpertParallelPlan, MoESite
    from parallelkit.models.hf.moe import moe_blocks

    blocks = moe_blocks(model)
    if not blocks:
        raise ConfigError(f"model=hf ({model.config.model_type}) has no Mixture-of-Experts layers to spread over strategy.ep ranks. "
                          "Use model.family=mixtral, or ep=1.")
    return ExpertParallelPlan(num_experts=model.config.num_local_experts,
                              sites=[MoESite(name=name, experts=b.experts, experts_dict=b.experts.experts, routing_owner=b)
                                     for name, b in blocks.items()])
