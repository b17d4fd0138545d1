"""``model=hf`` without processes: configs, the plans read from them, the pipeline cut, export round trip."""

from __future__ import annotations

import copy

import pytest
import torch

from parallelkit.errors import ConfigError
from parallelkit.models.hf import HFCausalLM
from parallelkit.models.hf import parallelize as plans


def tiny(family: str = "llama", **kwargs) -> HFCausalLM:
    torch.manual_seed(0)
    sizes = dict(num_hidden_layers=3, hidden_size=32, num_attention_heads=4, intermediate_size=64)
    if family != "gpt2":
        sizes["num_key_value_heads"] = 2
    return HFCausalLM(vocab_size=64, block_size=16, family=family, **{**sizes, **kwargs})


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "mixtral"])
def test_families_build_with_the_datas_sizes_and_train_a_step(family):
    model = tiny(family)
    assert model.config.vocab_size == 64 and model.config.num_hidden_layers == 3
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = model(ids[:, :-1])
    assert logits.shape == (2, 15, 64)
    loss = model.loss(logits, ids[:, 1:])
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_bad_configs_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="model.family must be one of llama, qwen2, gpt2, mixtral"):
        HFCausalLM(64, 16, family="bert")
    with pytest.raises(ConfigError, match="model.num_key_value_heads=2 cannot take effect: a GPT2Config"):
        HFCausalLM(64, 16, family="gpt2", num_key_value_heads=2)
    with pytest.raises(ConfigError, match="no config.json there"):
        HFCausalLM(64, 16, config=str(tmp_path))
    tiny().hf.config.save_pretrained(tmp_path)  # vocabulary 64
    with pytest.raises(ConfigError, match="has a vocabulary of 64 tokens, but the data's tokenizer produces ids up to 99"):
        HFCausalLM(100, 16, config=str(tmp_path))
    with pytest.raises(ConfigError, match="takes at most 16 positions, fewer than data.seq_len=32"):
        HFCausalLM(64, 32, config=str(tmp_path))
    with pytest.raises(ConfigError, match="model.config and model.family are both set"):
        HFCausalLM(64, 16, config=str(tmp_path), family="llama")
    assert HFCausalLM(60, 16, config=str(tmp_path)).config.vocab_size == 64  # a larger vocabulary is fine


def test_tensor_parallel_plan_is_the_configs_plus_vocabulary_parallel_ends():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = plans.tensor_parallel_plan(tiny(), 2)
    layout = plan.layout
    assert isinstance(layout["hf.model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(layout["hf.model.layers.*.self_attn.k_proj"], ColwiseParallel)  # GQA: kv heads split too
    assert isinstance(layout["hf.model.layers.*.mlp.down_proj"], RowwiseParallel)
    assert isinstance(layout["hf.model.embed_tokens"], RowwiseParallel) and isinstance(layout["hf.lm_head"], ColwiseParallel)
    assert plan.loss_parallel and plan.scopes == {"hf.model.layers.*": "tp_block"}
    with pytest.raises(ConfigError, match="strategy.tp=4 does not divide model.num_key_value_heads=2"):
        plans.tensor_parallel_plan(tiny(), 4)
    gpt2 = plans.tensor_parallel_plan(tiny("gpt2"), 2).layout  # parallelkit's plan for the fused Conv1D attention
    assert type(gpt2["hf.transformer.h.*.attn.c_attn"]).__name__ == "Conv1DColwise" and gpt2["hf.transformer.h.*.attn.c_attn"].fused == 3
    assert type(gpt2["hf.transformer.h.*.attn.c_proj"]).__name__ == "Conv1DRowwise"
    assert type(gpt2["hf.transformer.h.*.mlp.c_fc"]).__name__ == "Conv1DColwise" and gpt2["hf.transformer.h.*.mlp.c_fc"].fused == 1
    with pytest.raises(ConfigError, match="GPT-2 adds its learned positions to the whole sequence"):
        plans.tensor_parallel_plan(tiny("gpt2"), 2, sequence_parallel=True)
    moe = plans.tensor_parallel_plan(tiny("mixtral"), 2).layout  # attention split, experts whole (ep spreads them)
    assert "hf.model.layers.*.self_attn.q_proj" in moe and not any(".experts" in key for key in moe)
    tied = plans.tensor_parallel_plan(tiny("qwen2", overrides={"tie_word_embeddings": True}), 2).layout  # one matrix, sharded once
    assert repr(tied["hf.model.embed_tokens"]).startswith("Tied(RowwiseParallel") and repr(tied["hf.lm_head"]).startswith("Tied(ColwiseParallel")
    assert not repr(layout["hf.lm_head"]).startswith("Tied(")
    sequence = plans.tensor_parallel_plan(tiny(), 2, sequence_parallel=True).layout
    assert type(sequence["hf.model.layers.*.input_layernorm"]).__name__ == "SequenceParallel"
    assert type(sequence["hf.model.norm"]).__name__ == "SequenceParallel"
    with pytest.raises(ConfigError, match="sequence_parallel=true with model=hf \\(mixtral\\): a Mixture-of-Experts block"):
        plans.tensor_parallel_plan(tiny("mixtral"), 2, sequence_parallel=True)


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral", "qwen2-sliding"])
def test_pipeline_stages_chained_compute_the_models_logits(family):
    """Cut a copy into 3 one-layer stages (as 3 ranks would, each on its own copy): the chain of stage forwards
    gives the whole model's logits, and every rank keeps only its own stage's parameters."""
    if family == "qwen2-sliding":  # layers of two kinds: the last two attend within a window of 3 tokens only
        model = tiny("qwen2", overrides={"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1,
                                         "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}).eval()
        assert model.config.layer_types[2] == "sliding_attention"
    else:
        model = tiny(family).eval()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        whole = model.hf(input_ids=ids, use_cache=False).logits  # transformers' own forward
        torch.testing.assert_close(model(ids), whole, rtol=1e-6, atol=1e-6)  # parallelkit's decoder loop: the same
    blocks = [range(0, 1), range(1, 2), range(2, 3)]
    assert plans.pipeline_blocks(model) == 3
    x, kept = ids, []
    for stage_id in range(3):
        copy_ = copy.deepcopy(model)
        (stage,) = plans.pipeline_stages(copy_, blocks, [stage_id])
        with torch.no_grad():
            x = stage.eval()(x)
        kept.append({n for n, _ in copy_.named_parameters()})
    torch.testing.assert_close(x, whole, rtol=1e-6, atol=1e-6)
    everything = {n for n, _ in model.named_parameters()}
    assert set.union(*kept) == everything and sum(len(k) for k in kept) == len(everything)  # a partition


def test_grouped_experts_compute_what_transformers_fused_experts_compute():
    """Mixtral's blocks rebuilt as per-expert modules: fused back into transformers' layout, transformers' own
    model gives the same logits and gradients; and the expert plan names every block."""
    import transformers

    from parallelkit.models.hf.moe import fuse_experts

    model = tiny("mixtral")
    assert model.moe_blocks == ["model.layers.0.mlp", "model.layers.1.mlp", "model.layers.2.mlp"]
    weights = fuse_experts({k[len("hf."):]: v for k, v in model.state_dict().items()}, model.moe_blocks, 4)
    reference = transformers.AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    reference.load_state_dict(weights, strict=True)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    ours, theirs = model(ids), reference(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    ours.square().mean().backward()
    theirs.square().mean().backward()
    fused_grad = reference.model.layers[1].mlp.experts.down_proj.grad
    torch.testing.assert_close(model.hf.model.layers[1].mlp.experts.experts["2"].down_proj.grad, fused_grad[2], rtol=1e-5, atol=1e-7)
    plan = plans.expert_parallel_plan(model)
    assert plan.num_experts == 4 and [site.name for site in plan.sites] == [f"hf.{name}" for name in model.moe_blocks]
    with pytest.raises(ConfigError, match="has no Mixture-of-Experts layers"):
        plans.expert_parallel_plan(tiny())


def test_tied_embeddings_in_pipeline_stages():
    """The first stage keeps the embedding, the last the output layer with the tied weight; they name them for the
    tied-embedding sync; one rank running both ends (V-shaped schedules) gets two equal, separate copies."""
    blocks = [range(0, 2), range(2, 3)]
    model = tiny("gpt2", overrides={"tie_word_embeddings": True})
    weight = model.hf.get_input_embeddings().weight.detach().clone()
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    (stage0,) = plans.pipeline_stages(first, blocks, [0])
    (stage1,) = plans.pipeline_stages(last, blocks, [1])
    assert stage0.tied_weights == {"embedding": "embed.weight"} and stage1.tied_weights == {"embedding": "lm_head.weight"}
    assert "hf.lm_head.weight" in dict(last.named_parameters()) and "hf.transformer.wte.weight" not in dict(last.named_parameters())
    torch.testing.assert_close(stage1.get_parameter("lm_head.weight").detach(), weight, rtol=0, atol=0)
    both = copy.deepcopy(model)
    ends = plans.pipeline_stages(both, [range(0, 1), range(1, 2), range(2, 3)], [0, 2])
    assert ends[0].embed.weight is not ends[1].lm_head.weight
    torch.testing.assert_close(ends[1].lm_head.weight.detach(), ends[0].embed.weight.detach(), rtol=0, atol=0)
    (untied,) = plans.pipeline_stages(tiny("gpt2"), blocks, [0])
    assert not getattr(untied, "tied_weights", None)


def test_export_round_trip_of_a_single_file_checkpoint(tmp_path):
    """A checkpoint in the layout Lightning writes for one process → save_pretrained → transformers: same logits."""
    import transformers

    from parallelkit.models.module import EXPORT_KEY, TrainModule
    from parallelkit.tools.export import export

    model = tiny()
    module = TrainModule(model, None)
    checkpoint: dict = {"state_dict": module.state_dict()}
    module.on_save_checkpoint(checkpoint)
    assert checkpoint[EXPORT_KEY]["state_dict_prefix"] == "model.hf." and checkpoint[EXPORT_KEY]["tokenizer"] is None
    torch.save(checkpoint, tmp_path / "last.ckpt")
    out = export(tmp_path / "last.ckpt", tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model.eval()(ids))
    with pytest.raises(ConfigError, match="already holds files"):
        export(tmp_path / "last.ckpt", out)
    del checkpoint[EXPORT_KEY]
    torch.save(checkpoint, tmp_path / "plain.ckpt")
    with pytest.raises(ConfigError, match="only model=hf checkpoints carry a transformers config"):
        export(tmp_path / "plain.ckpt", tmp_path / "out2")


def _tied_checkpoint(tmp_path, name: str, change_head: float | None):
    """A single-file checkpoint of a tied llama whose state dict holds the tied weight under both names (as a pipeline
    run's does: the first stage writes the embedding, the last lm_head.weight)."""
    from parallelkit.models.module import TrainModule

    model = tiny(overrides={"tie_word_embeddings": True})
    module = TrainModule(model, None)
    state = {k: v.clone() for k, v in module.state_dict().items()}
    assert "model.hf.lm_head.weight" in state and "model.hf.model.embed_tokens.weight" in state
    if change_head is not None:
        state["model.hf.lm_head.weight"] += change_head
    checkpoint: dict = {"state_dict": state}
    module.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, tmp_path / name)
    return model


def test_export_of_a_tied_model_writes_one_weight(tmp_path):
    import json

    import transformers
    from safetensors import safe_open

    from parallelkit.tools.export import export

    model = _tied_checkpoint(tmp_path, "tied.ckpt", None)
    out = export(tmp_path / "tied.ckpt", tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys  # saved once
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model.eval()(ids))
    # Negative control: copies that drifted apart (a pipeline run without the sum of their gradients) are refused.
    _tied_checkpoint(tmp_path, "drifted.ckpt", 1e-2)
    with pytest.raises(ConfigError, match="two copies of that weight .* differ"):
        export(tmp_path / "drifted.ckpt", tmp_path / "out2")


def test_a_fixed_vocabulary_is_held_against_the_ids_the_tokenizer_produces(tmp_path):
    """Byte-level text: 257 ids (256 bytes and the end-of-document id), padded to 320 by data.vocab_multiple=64.
    The message says 256 and 257 (not the padding's 319), and the fix it suggests builds."""
    from parallelkit.data.text import BYTE_VOCAB

    def save_config(vocab: int, name: str) -> None:
        config = tiny().hf.config
        config.vocab_size = vocab
        config.save_pretrained(tmp_path / name)

    save_config(256, "v256")  # a model sized like bytes without the end-of-document id
    with pytest.raises(ConfigError) as refused:
        HFCausalLM(320, 16, config=str(tmp_path / "v256"), tokenizer_vocab_size=BYTE_VOCAB)
    message = str(refused.value)
    assert f"produces ids up to {BYTE_VOCAB - 1} ({BYTE_VOCAB} ids)" in message and "319" not in message
    fix = message.split("+model.overrides.", 1)[1].split(" ", 1)[0]  # "vocab_size=257"
    key, value = fix.split("=")
    fixed = HFCausalLM(320, 16, config=str(tmp_path / "v256"), tokenizer_vocab_size=BYTE_VOCAB, overrides={key: int(value)})
    assert fixed.config.vocab_size == BYTE_VOCAB
    # A vocabulary that holds every id is enough, whatever the padding for tensor parallelism would have been.
    save_config(300, "v300")
    assert HFCausalLM(320, 16, config=str(tmp_path / "v300"), tokenizer_vocab_size=BYTE_VOCAB).config.vocab_size == 300
