"""Parallel plans for :mod:`parallelkit.models.gpt`: which weights split how, and where the pipeline cuts.

``model.py`` stays single-device code; the strategies read these plans and apply them with the generic
techniques of :mod:`parallelkit.distributed`.
"""

from __future__ import annotations

# ==================================================================== tensor parallel plan
# Megatron-LM's layout. In each block, q/k/v and MLP-up are column-parallel (each rank computes
# n_head / tp heads and 4·n_embd / tp hidden units, no communication), attention-out and MLP-down are
# row-parallel (partial sums, reduced once). Forward: one all-reduce after attention, one after the MLP;
# backward: one each where the column-parallel layers' input gradients meet. The attention and MLP
# modules get their input as one replicated DTensor (PrepareModuleInput), so the three q/k/v input
# gradients add up as partial sums and are reduced once, not three times.
# The token embedding is vocabulary-parallel (row-parallel over vocab ids: each rank embeds the ids it
# owns, zeros elsewhere, then a sum) and the output layer column-parallel over the vocabulary; the logits
# stay sharded and the loss runs under loss_parallel, so the full (batch, seq, vocab) logits never exist.
# A tied model (tie_embeddings=True) shards its one vocab × n_embd matrix once: both styles split it by
# vocabulary rows (Shard(0)), and tie_parallel_styles keeps one DTensor parameter under both modules, whose
# gradient sums the lookups' and the logits' contributions (Megatron-LM's layout).
# Sequence parallel: LayerNorms, dropout and the residual stream hold seq / tp positions per rank; each
# all-reduce becomes a reduce-scatter (leaving the row-parallel layer) plus an all-gather (entering the
# column-parallel ones): the same bytes, and 1/tp of the activations in those regions.

TP_BLOCK_KIND = "tp_block"


def tensor_parallel_plan(model, tp: int, *, sequence_parallel: bool = False):
    """The :class:`~parallelkit.distributed.tensor_parallel.TensorParallelPlan` of a GPT for ``tp`` ranks.

    Raises :class:`~parallelkit.errors.ConfigError` if the model cannot be split ``tp`` ways (heads,
    width, vocabulary, and the sequence under sequence parallel must divide by ``tp``).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    from parallelkit.distributed.tensor_parallel import TensorParallelPlan

    check_tensor_parallel(model.config, tp, sequence_parallel=sequence_parallel)
    # Layout of the residual stream between the parallel regions: whole, or split along the sequence.
    stream = Shard(1) if sequence_parallel else Replicate()
    layout = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False),
    }
    if tied_embeddings(model):
        from parallelkit.distributed.tied_weights import tie_parallel_styles

        layout["tok_emb"], layout["lm_head"] = tie_parallel_styles(layout["tok_emb"], layout["lm_head"])
    if sequence_parallel:
        # Positions are added to this rank's slice of the sequence; the gradient is gathered back (once).
        layout["pos_emb"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
        layout["ln_f"] = SequenceParallel()
    block = {
        "attn": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.out_proj": RowwiseParallel(output_layouts=stream),
        "mlp": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=stream),
    }
    if sequence_parallel:
        block.update({"ln_1": SequenceParallel(), "ln_2": SequenceParallel()})
    layout.update({f"layers.*.{name}": style for name, style in block.items()})
    return TensorParallelPlan(layout=layout, scopes={"layers.*": TP_BLOCK_KIND}, loss_parallel=True)


def tied_embeddings(model) -> bool:
    """The model's output layer uses the token embedding's weight (``tie_embeddings=True``), both still held."""
    tok_emb, lm_head = getattr(model, "tok_emb", None), getattr(model, "lm_head", None)
    return tok_emb is not None and lm_head is not None and lm_head.weight is tok_emb.weight


def check_tensor_parallel(config, tp: int, *, sequence_parallel: bool = False) -> None:
    """Raise :class:`~parallelkit.errors.ConfigError` naming every size that ``tp`` does not divide."""
    from parallelkit.errors import ConfigError

    sizes = {
        "model.n_head": (config.n_head, "attention heads are split across ranks"),
        "model.n_embd": (config.n_embd, "the hidden size is split across ranks"),
        "vocab_size": (config.vocab_size, "the embedding and output layer are split over the vocabulary (data.vocab_multiple pads it)"),
    }
    if sequence_parallel:
        sizes["data.seq_len (block_size)"] = (config.block_size, "sequence parallel splits the sequence")
    bad = [f"{name}={value} ({why})" for name, (value, why) in sizes.items() if value % tp]
    if bad:
        raise ConfigError(
            f"strategy.tp={tp} does not divide " + "; ".join(bad) + ". "
            f"Pick a strategy.tp that divides all of them (e.g. a divisor of model.n_head={config.n_head}), "
            "or change the model sizes."
        )


# ==================================================================== context parallel plan
# Each rank holds two chunks of every sequence (parallelkit.distributed.context_parallel): attention's SDPA call
# becomes ring or all-to-all attention over the cp ranks, and the learned position embedding looks up the
# positions of this rank's tokens in the whole sequence. A pipeline stage keeps these same modules.


def context_parallel_plan(model):
    """The :class:`~parallelkit.distributed.context_parallel.ContextParallelPlan` of a GPT."""
    from parallelkit.distributed.context_parallel import ContextParallelPlan
    from parallelkit.errors import ConfigError

    if model.config.dropout:
        raise ConfigError(f"model.dropout={model.config.dropout} with context parallelism: attention dropout needs whole rows "
                          "of scores, which no rank holds. Set model.dropout=0.")
    return ContextParallelPlan(attention=("layers.*.attn",), positions=("pos_emb",), heads=model.config.n_head,
                               kv_heads=model.config.n_head)


# ==================================================================== pipeline split points
# A pipeline stage owns consecutive transformer blocks; the first stage also owns the embeddings, the
# last the final LayerNorm and the output head (the loss is computed there, on the logits).
# ``pipeline_stages`` cuts the model *in place*: the GPT object keeps only what this rank's stages use,
# under the same names as in the full model (``layers.3.attn...``), so checkpoints and optimizer state
# keep their keys, and memory for the other stages' weights is released.
# A tied model (tie_embeddings=True): the first stage keeps tok_emb, the last lm_head, each with a copy of the
# one weight; the stages name them in ``tied_weights`` and parallelkit.distributed.tied_weights sums the two
# copies' gradients after each backward (Megatron-LM's embedding group). Checkpoints keep both names
# (tok_emb.weight from the first stage, lm_head.weight from the last), equal values.

import torch  # noqa: E402 - the pipeline section's own imports, kept apart from the TP plan above
from torch import nn  # noqa: E402


def pipeline_blocks(model: nn.Module) -> int:
    """How many blocks the pipeline can distribute over its stages."""
    return len(model.layers)


class GPTPipelineStage(nn.Module):
    """One pipeline stage of a GPT: a view on the model's modules, not a copy.

    The first stage takes token ids and embeds them; every stage runs its blocks; the last stage
    returns logits. This repeats the parts of ``GPT.forward`` a stage needs (model.py stays unaware
    of pipelines).
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.block_size = model.config.block_size
        self.tok_emb = model.tok_emb if first else None
        self.pos_emb = model.pos_emb if first else None
        self.drop = model.drop if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
        self.ln_f = model.ln_f if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.layers.values():
            x = block(x)
        return self.head(x)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids → the residual stream on the first stage; the identity elsewhere."""
        if self.tok_emb is None:
            return x
        seq = x.shape[1]
        if seq > self.block_size:
            raise ValueError(f"sequence length {seq} exceeds block_size {self.block_size}")
        return self.drop(self.tok_emb(x) + self.pos_emb(torch.arange(seq, device=x.device)))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream → logits on the last stage; the identity elsewhere."""
        return self.lm_head(self.ln_f(x)) if self.lm_head is not None else x


def pipeline_stages(
    model: nn.Module, blocks_per_stage: list[range], stage_ids: list[int], stage_class: type = GPTPipelineStage
) -> list[nn.Module]:
    """Build this rank's stages (``stage_ids``) and drop every module no local stage uses, in place.

    Args:
        model: a :class:`~parallelkit.models.gpt.GPT` (or a subclass with the same module names).
        blocks_per_stage: for every stage of the whole pipeline, the block indices it owns.
        stage_ids: the stages this rank runs.
        stage_class: the stage module (a subclass of :class:`GPTPipelineStage` for a GPT variant).
    """
    last = len(blocks_per_stage) - 1
    tied = last > 0 and tied_embeddings(model)
    if tied and 0 in stage_ids and last in stage_ids:
        # One rank runs both ends (the V-shaped schedule): the last stage gets its own copy, as on any other
        # rank, since the schedule divides each stage's gradients by the micro-batch count (twice, if shared).
        weight = model.lm_head.weight
        model.lm_head.weight = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
    stages = [stage_class(model, list(blocks_per_stage[s]), s == 0, s == last) for s in stage_ids]
    if tied:
        for stage, s in zip(stages, stage_ids):
            if s in (0, last):
                stage.tied_weights = {"embedding": "tok_emb.weight" if s == 0 else "lm_head.weight"}
    kept = {i for s in stage_ids for i in blocks_per_stage[s]}
    for key in [k for k in model.layers if int(k) not in kept]:
        del model.layers[key]
    if 0 not in stage_ids:
        model.tok_emb = model.pos_emb = None
    if last not in stage_ids:
        model.ln_f = model.lm_head = None
    return stages
