"""The MoE layer (dispatch → experts → combine) against a dense reference that runs every token through every expert.

The reference below is written independently of ``MoELayer.forward``: a Python loop decides which
(token, choice) assignments fit the capacity (all first choices in token order, then the second ones), and
every expert runs densely on all tokens; a token's output is the gate-weighted sum of its kept experts'
outputs. Outputs, the load-balancing loss and the gradients of router and experts must agree.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from parallelkit.errors import ConfigError
from parallelkit.models.gpt.model import GPTConfig
from parallelkit.models.moe_gpt import MoEGPT, MoELayer

CFG = GPTConfig(n_embd=16, bias=True)
E = 4
TOKENS = 24


def _layer(top_k: int, capacity_factor: float, seed: int = 0, aux: float = 0.01, z: float = 0.0) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(CFG, num_experts=E, top_k=top_k, capacity_factor=capacity_factor, aux_loss_weight=aux, z_loss_weight=z)
    for param in layer.parameters():  # larger weights than GPT's init: routing decisions are clear-cut
        torch.nn.init.normal_(param, std=0.3)
    return layer


def _tokens(seed: int = 1, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, TOKENS // 2, CFG.n_embd, generator=torch.Generator().manual_seed(seed))


def dense_reference(layer: MoELayer, x: torch.Tensor, renormalise: bool = True) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(output, aux loss, dropped assignments) computed the slow, obvious way."""
    tokens = x.reshape(-1, x.shape[-1])
    n, k = tokens.shape[0], layer.top_k
    logits = tokens @ layer.router.weight.t()
    probs = logits.softmax(-1)
    top_p, top_e = probs.topk(k, dim=-1)
    gates = top_p / top_p.sum(-1, keepdim=True) if (k > 1 and renormalise) else top_p
    capacity = math.ceil(layer.capacity_factor * n * k / layer.num_experts)
    taken = [0] * layer.num_experts
    keep = torch.zeros(n, k)
    for slot in range(k):
        for i in range(n):
            e = int(top_e[i, slot])
            if taken[e] < capacity:
                taken[e] += 1
                keep[i, slot] = 1.0
    every_expert = torch.stack([expert(tokens) for expert in layer.experts.experts.values()])  # (E, n, H)
    out = torch.zeros_like(tokens)
    for slot in range(k):
        chosen = every_expert[top_e[:, slot], torch.arange(n)]  # (n, H)
        out = out + (keep[:, slot] * gates[:, slot]).unsqueeze(1) * chosen
    fraction = F.one_hot(top_e, layer.num_experts).sum((0, 1)).float() / (n * k)
    aux = layer.aux_loss_weight * layer.num_experts * (fraction * probs.mean(0)).sum()
    if layer.z_loss_weight:
        aux = aux + layer.z_loss_weight * torch.logsumexp(logits, -1).square().mean()
    return out.view_as(x), aux, int(n * k - keep.sum())


def _grads(layer: MoELayer, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    layer.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("capacity_factor", [E / 1, 1.0, 0.5], ids=["no_drops", "cf1.0", "cf0.5"])
def test_layer_matches_dense_reference(top_k, capacity_factor):
    cf = capacity_factor / top_k if capacity_factor == E else capacity_factor  # E / top_k never drops
    layer = _layer(top_k, cf, z=1e-3)
    x = _tokens()
    target = torch.randn_like(x)

    out = layer(x)
    ref_out, ref_aux, ref_dropped = dense_reference(layer, x)
    assert_close(out, ref_out)
    assert_close(layer.aux_loss, ref_aux)
    assert layer.last_stats["dropped"] == ref_dropped
    if capacity_factor == E:
        assert ref_dropped == 0
    elif capacity_factor == 0.5:
        assert ref_dropped > 0  # the capacity path is exercised

    grads = _grads(layer, ((layer(x) - target) ** 2).mean() + layer.aux_loss)
    ref = _grads(layer, ((dense_reference(layer, x)[0] - target) ** 2).mean() + dense_reference(layer, x)[1])
    assert grads.keys() == ref.keys()
    assert "router.weight" in grads and any(name.startswith("experts.") for name in grads)
    for name in ref:
        assert_close(grads[name], ref[name], msg=lambda m, name=name: f"{name}: {m}")


def test_negative_control_reference_catches_wrong_gates_and_capacity():
    layer = _layer(2, 0.5)
    x = _tokens()
    out = layer(x)
    with pytest.raises(AssertionError):  # gates not renormalised over the chosen experts
        assert_close(out, dense_reference(layer, x, renormalise=False)[0])
    roomy = _layer(2, E / 2)
    with pytest.raises(AssertionError):  # the same weights without drops give other outputs
        assert_close(out, dense_reference(roomy, x)[0])


def test_jitter_perturbs_routing_in_training_only():
    layer = _layer(2, E / 2)
    layer.jitter = 0.5
    x = _tokens()
    layer.eval()
    assert_close(layer(x), dense_reference(layer, x)[0])  # no noise in eval
    layer.train()
    torch.manual_seed(3)
    noisy = layer(x)
    with pytest.raises(AssertionError):
        assert_close(noisy, dense_reference(layer, x)[0])


class _Recording:
    def gather(self, stats):
        self.stats = stats
        return stats.unsqueeze(0), 0


class _Fixed:
    def __init__(self, all_stats, me):
        self.all_stats, self.me = all_stats, me

    def gather(self, stats):
        assert_close(self.all_stats[self.me], stats)
        return self.all_stats, self.me


def test_global_capacity_split_over_ranks_drops_what_one_batch_drops():
    """Two "ranks" that exchange routing statistics reproduce the full batch's output, drops included."""
    layer = _layer(2, 0.75)
    x = _tokens(batch=4)
    full = layer(x)
    dropped_full = layer.last_stats["dropped"]
    assert dropped_full > 0
    halves = x.chunk(2)
    stats = []
    for half in halves:
        layer.routing = _Recording()
        layer(half)
        stats.append(layer.routing.stats)
    outs = []
    for rank, half in enumerate(halves):
        layer.routing = _Fixed(torch.stack(stats), rank)
        outs.append(layer(half))
        assert layer.last_stats["dropped"] == dropped_full  # global statistics on every rank
    assert_close(torch.cat(outs), full)
    # Negative control: each half deciding capacity on its own (per-rank capacity) drops other tokens.
    alone = []
    for half in halves:
        layer.routing = _Recording()
        alone.append(layer(half))
    with pytest.raises(AssertionError):
        assert_close(torch.cat(alone), full)


def test_model_loss_adds_aux_loss_of_the_forward_and_trains():
    torch.manual_seed(0)
    model = MoEGPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32, num_experts=4, top_k=2, capacity_factor=1.0, aux_loss_weight=0.1, moe_every=2)
    assert list(model.moe_layers()) == ["layers.1.mlp"]  # every 2nd block
    idx = torch.randint(0, 32, (4, 16), generator=torch.Generator().manual_seed(0))
    logits = model(idx)
    ce = F.cross_entropy(logits.flatten(0, 1), idx.flatten())
    (layer,) = model.moe_layers().values()
    assert_close(model.loss(logits, idx), ce + layer.aux_loss)
    assert layer.aux_loss.item() >= 0.1 * 0.99  # E·Σ f·P >= 1 up to the f/P mismatch; weight 0.1

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(8):
        loss = model.loss(model(idx), idx)
        first = first if first is not None else loss.item()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < first - 0.3
    metrics = model.step_metrics()
    assert set(metrics) >= {"moe_aux_loss", "moe_dropped_frac", "moe_load_e0", "moe_load_e3"}
    # Load histogram: assignments per expert per forward, summing to tokens × top_k.
    assert sum(metrics[f"moe_load_e{e}"] for e in range(4)) == pytest.approx(4 * 16 * 2)
    assert 0 <= metrics["moe_dropped_frac"] < 1
    assert model.step_metrics() == {}  # read once per step


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(num_experts=0), ["num_experts", "0"]),
        (dict(num_experts=4, top_k=5), ["top_k=5", "num_experts=4"]),
        (dict(top_k=0), ["top_k", "0"]),
        (dict(capacity_factor=0.0), ["capacity_factor", "greater than 0"]),
        (dict(capacity_factor=-1), ["capacity_factor", "-1"]),
        (dict(aux_loss_weight=-0.1), ["aux_loss_weight"]),
        (dict(jitter=1.5), ["jitter"]),
        (dict(moe_every=3), ["moe_every", "n_layer=2"]),
    ],
)
def test_bad_arguments_are_config_errors(kwargs, words):
    with pytest.raises(ConfigError) as err:
        MoEGPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32, **kwargs)
    for word in words:
        assert word in str(err.value)


# --------------------------------------------------------------------------- strategy planning (no process group)
def test_expert_parallel_groups_are_consecutive_data_parallel_ranks():
    from parallelkit.distributed.parallel_dims import DP, EP, PP, TP, ParallelDims

    dims = ParallelDims.from_degrees(4, dp=-1, ep=2)
    assert dims.expert_parallel_groups() == [[0, 1], [2, 3]]
    assert dims.expert_data_parallel_groups() == [[0, 2], [1, 3]]
    dims = ParallelDims.from_degrees(32, dp=4, sharding=2, tp=2, pp=2, ep=4)
    ep_groups, edp_groups = dims.expert_parallel_groups(), dims.expert_data_parallel_groups()
    for groups, size in ((ep_groups, 4), (edp_groups, 2)):
        assert sorted(r for g in groups for r in g) == list(range(32)) and all(len(g) == size for g in groups)
    for group in ep_groups:
        coords = [dims.coordinates(r) for r in group]
        assert len({(c[PP], c[TP]) for c in coords}) == 1
        assert [c[EP] for c in coords] == [0, 1, 2, 3]
        dp_ranks = [dims.data_parallel_rank(r) for r in group]
        assert dp_ranks == list(range(dp_ranks[0], dp_ranks[0] + 4))  # consecutive data-parallel ranks
    for group in edp_groups:
        coords = [dims.coordinates(r) for r in group]
        assert len({(c[PP], c[TP], c[EP]) for c in coords}) == 1 and len({c[DP] for c in coords}) == 2


def test_strategy_refuses_bad_expert_parallel_settings_before_launch():
    from parallelkit.models.gpt import GPT
    from parallelkit.strategies.moe import ExpertParallelStrategy

    strategy = ExpertParallelStrategy(ep=2)
    assert strategy.plan(4).ep == 2
    strategy.check_model(MoEGPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32, num_experts=4), 4)
    with pytest.raises(ConfigError, match=r"num_experts=6 is not divisible by strategy.ep=4"):
        ExpertParallelStrategy(ep=4).check_model(MoEGPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32, num_experts=6), 4)
    with pytest.raises(ConfigError, match="model=moe_gpt"):
        strategy.check_model(GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32), 2)
    with pytest.raises(ConfigError, match="ep=3"):
        ExpertParallelStrategy(ep=3).plan(4)
    with pytest.raises(ConfigError, match="ep=4"):
        ExpertParallelStrategy(ep=4).plan(2)


def test_strategy_refuses_gradient_norm_clipping():
    from types import SimpleNamespace

    from parallelkit.strategies.moe import ExpertParallelStrategy

    strategy = ExpertParallelStrategy(ep=2)
    strategy.check_trainer(SimpleNamespace(gradient_clip_val=None, gradient_clip_algorithm=None))
    strategy.check_trainer(SimpleNamespace(gradient_clip_val=1.0, gradient_clip_algorithm="value"))
    with pytest.raises(ConfigError, match="gradient_clip_val=1.0"):
        strategy.check_trainer(SimpleNamespace(gradient_clip_val=1.0, gradient_clip_algorithm=None))
