"""Workloads from the config alone: the analytic shapes equal the real modules, no corpus or model is needed."""

from __future__ import annotations

import json

import pytest
import torch

from parallelkit.errors import ConfigError
from parallelkit.planner.inputs import compose_config
from parallelkit.planner.shapes import hf_shape
from parallelkit.planner.workload import PRECISIONS, workload_from_config


def real_params(overrides: list[str]) -> tuple[int, object]:
    """Parameters of the model ``train.py`` would build (meta device), and the planner's workload."""
    from parallelkit.planner.inputs import build_workload

    cfg = compose_config(overrides)
    _, model = build_workload(cfg)
    return sum(p.numel() for p in model.parameters()), workload_from_config(cfg)


@pytest.mark.parametrize("overrides", [
    ["model=gpt"],
    ["model=gpt", "model.n_layer=3", "model.n_embd=96", "model.n_head=3", "model.bias=false"],
    ["model=moe_gpt"],
    ["model=moe_gpt", "model.moe_every=2", "model.num_experts=8", "model.top_k=1"],
    ["model=hf", "model.family=llama"],
    ["model=hf", "model.family=qwen2"],
    ["model=hf", "model.family=gpt2"],
    ["model=hf", "model.family=mixtral"],
    ["model=hf", "model.family=llama", "+model.overrides.attention_bias=true", "+model.overrides.mlp_bias=true"],
])
def test_analytic_parameter_count_equals_the_built_model(overrides):
    built, w = real_params(overrides)
    assert w.num_params == built


@pytest.mark.parametrize(
    "model_type,extra",
    [
        ("llama", {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 300}),
        (
            "mistral",
            {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 96, "vocab_size": 300},
        ),
        (
            "opt",
            {
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "ffn_dim": 128,
                "vocab_size": 300,
                "word_embed_proj_dim": 64,
                "max_position_embeddings": 128,
            },
        ),
        ("bloom", {"hidden_size": 64, "n_layer": 2, "n_head": 4, "vocab_size": 300}),
        ("gpt2", {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 300, "n_positions": 128}),
    ],
)
def test_hf_config_json_shape_equals_the_transformers_model(model_type, extra, tmp_path):
    """A config.json is read without transformers: the count equals the transformers model's own."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **extra)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    shape = hf_shape(config.to_dict())
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert shape.layer_tensors == sum(1 for name, _ in model.named_parameters() if ".layers.0." in name or ".h.0." in name)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": model_type, **extra}))  # what a hand-written config holds
    w = workload_from_config(compose_config(["model=hf", f"model.config={path}", "data.seq_len=32"]))
    assert w.num_params == sum(p.numel() for p in model.parameters())


def test_a_trillion_parameter_workload_from_overrides_alone(monkeypatch):
    """Megatron's 1T GPT on 2,048-token sequences: no corpus is read (the data module is never built), the
    vocabulary is the model's, and no stride or vocab_multiple trick is needed."""
    import hydra.utils

    def no_instantiate(*args, **kwargs):
        raise AssertionError("the planner built something from the config")

    monkeypatch.setattr(hydra.utils, "instantiate", no_instantiate)
    cfg = compose_config(["model=gpt", "model.n_layer=128", "model.n_embd=25600", "model.n_head=160", "+model.vocab_size=51200",
                          "data.seq_len=2048", "data.global_batch_size=3072", "trainer.precision=bf16-mixed", "recompute=full"])
    w = workload_from_config(cfg)
    assert w.shape.vocab == 51200 and w.seq_len == 2048 and w.global_batch == 3072
    assert w.num_params == pytest.approx(1.008e12, rel=2e-3)  # Narayanan et al. 2021, Table 1: 1008.0 billion
    assert w.precision == PRECISIONS["amp"] and w.recompute == "full"


def test_hf_config_supplies_its_own_vocabulary_and_tied_embeddings():
    from parallelkit.planner.validation import HERE

    cfg = compose_config(["model=hf", f"model.config={HERE / 'llama3_405b.json'}", "data.seq_len=8192", "data.global_batch_size=2048"])
    w = workload_from_config(cfg)
    assert w.shape.vocab == 128256 and not w.shape.tied
    assert w.num_params == pytest.approx(405.8e9, rel=2e-3)  # Llama 3 405B
    bloom = workload_from_config(compose_config(["model=hf", f"model.config={HERE / 'bloom_176b.json'}", "data.seq_len=2048"]))
    assert bloom.shape.tied and bloom.shape.head_params == 0
    assert bloom.num_params == pytest.approx(176.247e9, rel=2e-3)  # BigScience tr11: 176,247M parameters


def test_precision_comes_from_the_trainer_and_the_amp_callback():
    assert workload_from_config(compose_config([])).precision.name == "fp32"
    assert workload_from_config(compose_config(["trainer.precision=bf16-mixed"])).precision.name == "amp"
    assert workload_from_config(compose_config(["callbacks=[amp]"])).precision.name == "amp"
    with pytest.raises(ConfigError, match="trainer.precision=64-true"):
        workload_from_config(compose_config(["trainer.precision=64-true"]))


def test_a_workload_without_a_sequence_length_says_so():
    with pytest.raises(ConfigError, match="needs a sequence length"):
        workload_from_config(compose_config(["model=gpt", "data=synthetic"]))


def test_hf_families_mirror_what_parallelkit_can_cut_and_split():
    """The planner refuses tensor parallelism, sequence parallelism and pipeline stages for exactly the families
    models/hf/parallelize.py refuses them for (its own checks, asked with each family's transformers config); tied
    embeddings refuse none of them."""
    import types

    import transformers

    from parallelkit.models.hf.decoder import DECODER_LOOP_TYPES
    from parallelkit.models.hf.parallelize import check_tensor_parallel
    from parallelkit.planner.shapes import HF_FAMILIES

    def allowed(model, sequence_parallel: bool) -> bool:
        try:
            check_tensor_parallel(model, 1, sequence_parallel)
        except ConfigError:
            return False
        return True

    assert {t for t, f in HF_FAMILIES.items() if f.get("decoder_loop")} == set(DECODER_LOOP_TYPES)
    for model_type, family in HF_FAMILIES.items():
        config = transformers.AutoConfig.for_model(model_type)
        model = types.SimpleNamespace(config=config, moe_blocks=[object()] if family.get("moe") else [])
        shape = hf_shape({**config.to_dict(), "tie_word_embeddings": True})
        assert (shape.tp_plan is None) == allowed(model, False), model_type
        assert (shape.sp_refusal is None) == allowed(model, True), model_type
        assert (shape.pp_refusal is None) == (model_type in DECODER_LOOP_TYPES), model_type
