"""Context parallelism refuses, before any process starts, what it cannot do (which value, why, what works), and
its per-rank parts (position map, mask check) hold without a process group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from parallelkit.distributed.context_parallel import (
    ContextParallel,
    _check_local_causal,
    load_balanced_positions,
)
from parallelkit.errors import ConfigError
from parallelkit.models.gpt import GPT
from parallelkit.models.hf import HFCausalLM
from parallelkit.models.mlp.model import MLP
from parallelkit.strategies.hybrid4d import Hybrid4DStrategy


def hybrid(**kwargs) -> Hybrid4DStrategy:
    return Hybrid4DStrategy(**{"tp": 1, "pp": 1, "cp": 2, **kwargs})


def gpt(**kwargs) -> GPT:
    return GPT(**{"vocab_size": 32, "block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32, **kwargs})


def test_unknown_mode_and_zero_stages_1_2_are_refused():
    with pytest.raises(ConfigError, match="strategy.cp_mode must be one of ring, ulysses"):
        hybrid(cp_mode="star")
    with pytest.raises(ConfigError, match=r"ZeRO stage 2 .* cp\(2\) use stage 3"):
        hybrid(sharding=2, stage=2)
    with pytest.raises(ConfigError, match="strategy=hybrid4d needs an explicit strategy.cp"):
        hybrid(cp=-1)


def test_a_model_without_a_plan_is_told_what_to_write():
    with pytest.raises(ConfigError) as err:
        hybrid().check_model(MLP(), world_size=2)
    message = str(err.value)
    assert "context_parallel_plan(model) -> ContextParallelPlan" in message and "strategy.plan=PATH" in message


def test_ulysses_needs_heads_divisible_by_cp_after_tensor_parallelism():
    hybrid(cp=2, cp_mode="ulysses").check_model(gpt(), world_size=2)  # 4 heads over 2: fine
    hybrid(cp=4, cp_mode="ulysses").check_model(gpt(), world_size=4)
    with pytest.raises(ConfigError, match="must divide by cp=8"):
        hybrid(cp=8, cp_mode="ulysses").check_model(gpt(), world_size=8)
    with pytest.raises(ConfigError, match="must divide by cp=4"):  # 2 heads per tp rank
        hybrid(cp=4, tp=2, cp_mode="ulysses").check_model(gpt(), world_size=8)
    hybrid(cp=4, tp=2).check_model(gpt(), world_size=8)  # ring attention: any cp


def test_sequence_must_cut_into_two_chunks_per_rank():
    with pytest.raises(ConfigError, match=r"data.seq_len=20 must divide by 2·cp = 8"):
        hybrid(cp=4).check_workload(gpt(), SimpleNamespace(seq_len=20))
    hybrid(cp=4).check_workload(gpt(), SimpleNamespace(seq_len=24))
    with pytest.raises(ConfigError, match="each rank's 10 tokens must split into 4"):  # sequence parallel splits them again
        hybrid(cp=2, tp=4, sequence_parallel=True).check_workload(gpt(), SimpleNamespace(seq_len=20))


def test_models_whose_attention_cannot_be_split_are_refused():
    with pytest.raises(ConfigError, match="model.dropout=0.1 with context parallelism"):
        hybrid().check_model(gpt(dropout=0.1), world_size=2)
    sizes = dict(vocab_size=64, block_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=64)
    with pytest.raises(ConfigError, match="Set model.attn_implementation=sdpa"):
        hybrid().check_model(HFCausalLM(family="llama", attn_implementation="eager", **sizes), world_size=2)
    with pytest.raises(ConfigError, match="sliding-window attention"):
        hybrid().check_model(HFCausalLM(family="qwen2", overrides={"use_sliding_window": True, "sliding_window": 8}, **sizes),
                             world_size=2)
    hybrid().check_model(HFCausalLM(family="llama", **sizes), world_size=2)


def test_positions_are_those_of_the_rank_tokens_in_the_whole_sequence():
    handle = ContextParallel(group=None, cp=2, rank=1, mode="ring")
    local = torch.arange(8).unsqueeze(0)
    assert handle.global_positions(local).tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]  # chunks 1 and 2 of 4
    assert torch.equal(handle.global_positions(local)[0], load_balanced_positions(16, 2, 1))
    with pytest.raises(ConfigError, match="packed sequences or a cache"):
        handle.global_positions(torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]))


def test_only_a_plain_causal_mask_is_taken_for_the_whole_sequence():
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    _check_local_causal(causal, 6, 6)
    additive = torch.zeros(1, 1, 6, 6).masked_fill(~causal, float("-inf"))
    _check_local_causal(additive, 6, 6)
    padded = causal.clone()
    padded[:, 0] = False  # a padding token: not the causal mask
    with pytest.raises(ConfigError, match="another attention mask"):
        _check_local_causal(padded, 6, 6)
    with pytest.raises(ConfigError, match="another attention mask"):
        _check_local_causal(torch.ones(6, 6, dtype=torch.bool), 6, 6)  # bidirectional with a mask tensor


def test_attention_dropout_is_refused_at_the_call():
    handle = ContextParallel(group=None, cp=2, rank=0, mode="ring")
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ConfigError, match="attention dropout"):
        handle.attention(q, q, q, dropout_p=0.1, is_causal=True)


@pytest.mark.parametrize("diagonal", [False, True])
def test_a_ring_block_is_the_same_by_the_tiled_kernel_and_by_plain_matrices(diagonal):
    """The ring computes each block with torch's tiled CPU kernel (memory linear in the chunk) and elsewhere with plain
    matrices: both give the block's output, log-sum-exp and, given the whole attention's output and normaliser, the
    same gradients as autograd through softmax over the whole row (float64 reference)."""
    from parallelkit.distributed.context_parallel_attention import _block_backward, _block_forward

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    scale = 0.25
    scores = (q @ k.transpose(-1, -2)) * scale
    if diagonal:
        scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    reference = torch.softmax(scores, -1) @ v
    do = torch.randn_like(reference)
    reference.backward(do)
    for flash in (True, False):
        args = [t.detach().float() for t in (q, k, v)]
        out, lse = _block_forward(*args, scale, diagonal, flash=flash)
        assert torch.allclose(out.double(), reference.detach(), atol=1e-5)
        assert torch.allclose(lse.double(), torch.logsumexp(scores.detach(), -1), atol=1e-5)
        grads = _block_backward(do.float(), *args, out, lse, scale, diagonal, flash=flash)
        for got, want in zip(grads, (q.grad, k.grad, v.grad)):
            assert torch.allclose(got.double(), want, atol=1e-4), flash
