"""``GPT(tie_embeddings=...)`` and its plans without processes: one parameter when tied, the untied default unchanged, the
plans' tie wrappers and the pipeline cut's copies (the distributed checks are in tests/distributed/test_tied_embeddings.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from parallelkit.errors import ConfigError
from parallelkit.models.gpt import GPT
from parallelkit.models.gpt import parallelize as plans

SIZES = dict(vocab_size=32, block_size=8, n_layer=3, n_head=2, n_embd=16)


def _gpt(**kwargs) -> GPT:
    torch.manual_seed(0)
    return GPT(**SIZES, **kwargs)


def test_tied_gpt_has_one_parameter_and_otherwise_the_untied_init():
    untied, default, tied = _gpt(tie_embeddings=False), _gpt(), _gpt(tie_embeddings=True)
    assert default.lm_head.weight is not default.tok_emb.weight  # the default stays untied: existing results unchanged
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert "lm_head.weight" not in dict(tied.named_parameters())
    assert sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters()) == 32 * 16
    # Every other weight draws the same numbers as in the untied model; the tied one is the embedding's.
    for name, param in tied.named_parameters():
        torch.testing.assert_close(param, dict(untied.named_parameters())[name], rtol=0, atol=0)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    logits = tied(ids)
    with torch.no_grad():
        untied.lm_head.weight.copy_(untied.tok_emb.weight)
    torch.testing.assert_close(logits, untied(ids), rtol=0, atol=0)  # forward otherwise as before
    tied.loss(logits, ids).backward()
    assert tied.tok_emb.weight.grad is tied.lm_head.weight.grad  # both uses add into one gradient
    assert set(tied.state_dict()) == set(untied.state_dict())  # checkpoints name it twice, as before
    with pytest.raises(ConfigError, match="model.tie_embeddings should be true or false"):
        GPT(**SIZES, tie_embeddings="yes")


def test_tensor_parallel_plan_wraps_the_ends_of_a_tied_model_only():
    tied = plans.tensor_parallel_plan(_gpt(tie_embeddings=True), 2).layout
    untied = plans.tensor_parallel_plan(_gpt(), 2).layout
    assert repr(tied["tok_emb"]).startswith("Tied(RowwiseParallel") and repr(tied["lm_head"]).startswith("Tied(ColwiseParallel")
    assert tied["tok_emb"].group is tied["lm_head"].group
    assert type(untied["tok_emb"]).__name__ == "RowwiseParallel" and type(untied["lm_head"]).__name__ == "ColwiseParallel"


def test_pipeline_stages_of_a_tied_model_keep_a_copy_at_each_end():
    blocks = [range(0, 1), range(1, 2), range(2, 3)]
    model = _gpt(tie_embeddings=True)
    first, middle, last = (copy.deepcopy(model) for _ in range(3))
    (s0,), (s1,), (s2,) = (plans.pipeline_stages(m, blocks, [i]) for i, m in enumerate((first, middle, last)))
    assert s0.tied_weights == {"embedding": "tok_emb.weight"} and s2.tied_weights == {"embedding": "lm_head.weight"}
    assert not getattr(s1, "tied_weights", None)
    assert set(dict(last.named_parameters())) >= {"lm_head.weight"} and last.tok_emb is None  # the head keeps the weight
    torch.testing.assert_close(s2.lm_head.weight, model.tok_emb.weight, rtol=0, atol=0)
    # One rank with both ends (the V-shaped schedule): two separate, equal parameters.
    both = copy.deepcopy(model)
    ends = plans.pipeline_stages(both, blocks, [0, 2])
    assert ends[0].tok_emb.weight is not ends[1].lm_head.weight
    torch.testing.assert_close(ends[0].tok_emb.weight, ends[1].lm_head.weight, rtol=0, atol=0)
    # An untied model and a one-stage pipeline name nothing.
    assert not getattr(plans.pipeline_stages(_gpt(), blocks, [0])[0], "tied_weights", None)
    assert not getattr(plans.pipeline_stages(copy.deepcopy(model), [range(0, 3)], [0])[0], "tied_weights", None)
