"""Deep Gradient Compression's DDP hook on 2 real gloo ranks.

Each rank starts from its own seed (DDP broadcasts rank 0's weights) and trains on its own half of every
global batch. Every variant runs in one launch; each rank records, per step and per tensor, the residual and
momentum before and after the hook, the (index, value) pairs it sent, its own local gradient (from a plain
replica at the same weights, so bit-identical to what DDP handed the hook), and the averaged gradient the
optimizer saw. The tests then check the algorithm's invariants exactly:

- residual conservation: kept + sent = accumulated, bit for bit; the sent entries are the top-k;
- the result is the mean over ranks of the sparse tensors they sent;
- warm-up: the number of entries sent follows the sparsity list, and the comm counter says so;
- momentum correction, momentum masking and local clipping each change exactly what they should;
- before ``rampup_begin_step`` DGC with momentum correction equals momentum SGD on one process;
- end to end, with several DDP buckets that DDP rebuilds after the first step, the weights the ranks step
  to equal a single-process implementation of the paper's algorithm (residual and momentum per tensor).
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations at run time.

import math

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from parallelkit.distributed.comm_hooks import counts_own_traffic
from parallelkit.callbacks.run_summary import os_bytes_written
from parallelkit.distributed.comm_stats import CommStats
from parallelkit.distributed.data_parallel import apply_ddp
from parallelkit.distributed.dgc import DGC_DENSE, DGC_SPARSE, DGCState, build_dgc, dgc_hook, topk_count
from parallelkit.models.mlp import MLP

from .harness import run_ranks

WORLD_SIZE = 2
IN_FEATURES, OUT_FEATURES, HIDDEN = 16, 8, [32, 32]
LOCAL_BATCH = 8
STEPS = 5
LR, MOMENTUM = 0.05, 0.9
INIT_SEED, DATA_SEED = 1000, 7
RTOL, ATOL = 1e-5, 1e-6
WARMUP = [0.5, 0.75, 0.9, 0.99]

VARIANTS = {
    # never compresses: must equal momentum SGD
    "dense_phase": dict(rampup_begin_step=STEPS, momentum=MOMENTUM, momentum_masking=True),
    "plain": dict(sparsity=[0.9], momentum=0.0, momentum_masking=False),
    "momentum_masked": dict(sparsity=[0.9], momentum=MOMENTUM, momentum_masking=True),
    "momentum_unmasked": dict(sparsity=[0.9], momentum=MOMENTUM, momentum_masking=False),
    "clipped": dict(sparsity=[0.9], momentum=0.0, momentum_masking=False, clip_norm=0.01),
    # dense at step 0, then one list entry per step; biases (< 33 elements) always dense
    "warmup": dict(sparsity=WARMUP, rampup_begin_step=1, rampup_steps=4, momentum=0.0, momentum_masking=False, dense_min_numel=33),
    "no_warmup": dict(sparsity=WARMUP, rampup_begin_step=1, rampup_steps=4, warmup=False, momentum=0.0, momentum_masking=False),
}


def _global_batches():
    gen = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(STEPS, WORLD_SIZE * LOCAL_BATCH, IN_FEATURES, generator=gen)
    y = torch.randn(STEPS, WORLD_SIZE * LOCAL_BATCH, OUT_FEATURES, generator=gen)
    return x, y


def _rows(rank):
    return slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)


def _model(seed):
    torch.manual_seed(seed)
    return MLP(in_features=IN_FEATURES, out_features=OUT_FEATURES, hidden=HIDDEN)


def _clone_map(buffers, model):
    # the hook keeps flat (1-D) buffers: compare them in the parameter's shape
    return {name: (buffers[p].clone().view_as(p) if p in buffers else torch.zeros_like(p)) for name, p in model.named_parameters()}


def _train(rank, world_size, variants):
    x, y = _global_batches()
    rows = _rows(rank)
    out = {}
    for name, options in variants.items():
        model = _model(INIT_SEED + rank)
        stats = CommStats()
        hook, state = build_dgc(dist.group.WORLD, stats=stats, keep_sent=True, **options)
        ddp = apply_ddp(model, process_group=dist.group.WORLD, comm_hook=hook, comm_state=state)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)  # momentum lives in the hook (correction)
        replica = _model(0)
        rec = {k: [] for k in ("v_before", "u_before", "v_after", "u_after", "sent", "local_grad", "grad",
                               "params_before", "params_after", "sparse_bytes", "dense_bytes", "step_sent", "step_dense", "written")}
        for step in range(STEPS):
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            rec["params_before"].append(params)
            replica.load_state_dict(params)
            MLP.loss(replica(x[step, rows]), y[step, rows]).backward()
            rec["local_grad"].append({n: p.grad.clone() for n, p in replica.named_parameters()})
            replica.zero_grad(set_to_none=True)
            rec["v_before"].append(_clone_map(state.velocity, model))
            rec["u_before"].append(_clone_map(state.momentum_buffer, model))
            state.last_sent.clear()
            sparse, dense = stats.bytes(DGC_SPARSE), stats.bytes(DGC_DENSE)
            state.begin_step(step)
            optimizer.zero_grad(set_to_none=True)
            written = os_bytes_written()
            MLP.loss(ddp(x[step, rows]), y[step, rows]).backward()
            rec["written"].append(os_bytes_written() - written)
            rec["v_after"].append(_clone_map(state.velocity, model))
            rec["u_after"].append(_clone_map(state.momentum_buffer, model))
            rec["sent"].append({n: state.last_sent[p] for n, p in model.named_parameters() if p in state.last_sent})
            rec["grad"].append({n: p.grad.clone() for n, p in model.named_parameters()})
            rec["sparse_bytes"].append(stats.bytes(DGC_SPARSE) - sparse)
            rec["dense_bytes"].append(stats.bytes(DGC_DENSE) - dense)
            rec["step_sent"].append(state.step_sent_bytes)
            rec["step_dense"].append(state.step_dense_bytes)
            optimizer.step()
            rec["params_after"].append({n: p.detach().clone() for n, p in model.named_parameters()})
        out[name] = rec
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    per_rank = run_ranks(_train, WORLD_SIZE, tmp_path_factory.mktemp("dgc"), VARIANTS)
    return {name: [per_rank[r][name] for r in range(WORLD_SIZE)] for name in VARIANTS}


def _scatter(like, sent):
    index, value = sent
    dense = torch.zeros_like(like).reshape(-1)
    dense[index] = value
    return dense.view_as(like)


def _clip(grad, limit):
    norm = torch.linalg.vector_norm(grad)
    return grad * (limit / (norm + 1e-6)) if norm > limit else grad


def _check_recurrences(results, momentum, masking, clip=None):
    """kept + sent == accumulated (exactly), with the accumulated update the variant defines."""
    for rank, rec in enumerate(results):
        for step in range(STEPS):
            for name, sent in rec["sent"][step].items():
                g = rec["local_grad"][step][name]
                if clip is not None:
                    g = _clip(g.reshape(-1), clip / math.sqrt(WORLD_SIZE)).view_as(g)
                if momentum:
                    u = rec["u_before"][step][name].mul(momentum).add(g)
                    update = u
                else:
                    update = g
                accumulated = rec["v_before"][step][name].add(update)
                kept = rec["v_after"][step][name]
                sent_dense = _scatter(kept, sent)
                assert torch.equal(kept + sent_dense, accumulated), f"rank {rank} step {step} {name}"
                assert torch.equal(kept.reshape(-1)[sent[0]], torch.zeros(sent[0].numel())), "sent entries must be cleared"
                # top-k: nothing kept is larger than the smallest entry sent
                assert kept.abs().max() <= sent[1].abs().min(), f"rank {rank} step {step} {name}: not the top-k"
                if momentum:
                    expected_u = u.clone()
                    if masking:
                        expected_u.reshape(-1)[sent[0]] = 0
                    assert torch.equal(rec["u_after"][step][name], expected_u), f"rank {rank} step {step} {name} momentum"


def test_each_rank_trains_on_different_data(runs):
    a, b = (r["local_grad"][0] for r in runs["plain"])
    assert all((a[n] - b[n]).abs().max() > 1e-4 for n in a)


@pytest.mark.parametrize("variant,momentum,masking,clip", [
    ("plain", 0.0, False, None),
    ("momentum_masked", MOMENTUM, True, None),
    ("momentum_unmasked", MOMENTUM, False, None),
    ("clipped", 0.0, False, 0.01),
])
def test_residual_conservation_and_corrections(runs, variant, momentum, masking, clip):
    results = runs[variant]
    assert all(rec["sent"][step] for rec in results for step in range(STEPS))  # something was compressed
    _check_recurrences(results, momentum, masking, clip)


def test_negative_controls_each_correction_is_visible(runs):
    """Each variant's recurrence fails on another variant's data: every switch changes what it should."""
    with pytest.raises(AssertionError):  # momentum correction changes what accumulates
        _check_recurrences(runs["momentum_masked"], 0.0, False)
    with pytest.raises(AssertionError):  # masking zeroes the momentum of sent entries
        _check_recurrences(runs["momentum_masked"], MOMENTUM, False)
    with pytest.raises(AssertionError):  # ... and without it the momentum is kept
        _check_recurrences(runs["momentum_unmasked"], MOMENTUM, True)
    with pytest.raises(AssertionError):  # clipping changes the accumulated gradient
        _check_recurrences(runs["clipped"], 0.0, False)


def test_clipping_bounds_each_local_contribution(runs):
    limit = 0.01 / math.sqrt(WORLD_SIZE)
    for rec in runs["clipped"]:
        for step in range(STEPS):
            for name in rec["sent"][step]:
                increment = rec["v_after"][step][name] + _scatter(rec["v_after"][step][name], rec["sent"][step][name]) - rec["v_before"][step][name]
                assert torch.linalg.vector_norm(increment) <= limit * (1 + 1e-5)


def test_result_is_the_mean_of_what_the_ranks_sent(runs):
    for variant in ("plain", "momentum_masked", "warmup"):
        results = runs[variant]
        for step in range(STEPS):
            for name, grad in results[0]["grad"][step].items():
                if name in results[0]["sent"][step]:
                    expected = sum(_scatter(grad, r["sent"][step][name]) for r in results) / WORLD_SIZE
                else:  # dense: the mean of the local gradients
                    expected = sum(r["local_grad"][step][name] for r in results) / WORLD_SIZE
                assert_close(grad, expected, rtol=RTOL, atol=ATOL, msg=lambda m: f"{variant} step {step} {name}: {m}")
                assert torch.equal(results[1]["grad"][step][name], grad)  # replicas apply the same update


def test_warmup_schedule_and_counted_bytes(runs):
    state = DGCState(None, sparsity=WARMUP, rampup_begin_step=1, rampup_steps=4, momentum=0.0, momentum_masking=False)
    assert [state.sparsity_at(s) for s in range(7)] == [0.0, 0.5, 0.75, 0.9, 0.99, 0.99, 0.99]
    no_warm = DGCState(None, sparsity=WARMUP, rampup_begin_step=1, rampup_steps=4, warmup=False, momentum=0.0, momentum_masking=False)
    assert [no_warm.sparsity_at(s) for s in range(3)] == [0.0, 0.99, 0.99]
    for variant, schedule in (("warmup", state), ("no_warmup", no_warm)):
        rec = runs[variant][0]
        init = rec["params_before"][0]
        total_bytes = sum(p.numel() * 4 for p in init.values())
        dense_min = VARIANTS[variant].get("dense_min_numel", 0)
        for step in range(STEPS):
            sparsity = schedule.sparsity_at(step)
            compressed = {n: p for n, p in init.items() if sparsity > 0 and p.numel() >= dense_min}
            assert set(rec["sent"][step]) == set(compressed), (variant, step)
            for name, p in compressed.items():
                assert rec["sent"][step][name][0].numel() == topk_count(p.numel(), sparsity)
            # What was counted is what the process wrote (DDP's own one-time broadcast of its rebuilt bucket
            # order, in step 1, aside), split into the pairs' all-gathers and the dense all-reduce.
            sent, written = rec["step_sent"][step], rec["written"][step]
            assert sent == rec["sparse_bytes"][step] + rec["dense_bytes"][step]
            assert sent == written if step != 1 else 0 < written - sent < 512, (variant, step, sent, written)
            # 2 ranks: an all-gather sends this rank's pairs once (int32 index + fp32 value = 8 bytes), a ring
            # all-reduce the whole payload once; on the wire, gloo adds 48-byte headers (3 per message).
            expected_sparse = sum(8 * topk_count(p.numel(), sparsity) for p in compressed.values())
            expected_dense = 4 * sum(p.numel() for n, p in init.items() if n not in compressed)
            assert (rec["sparse_bytes"][step] > expected_sparse) == (expected_sparse > 0), (variant, step)
            assert rec["sparse_bytes"][step] <= expected_sparse + 2 * 6 * 48, (variant, step)  # two all-gathers
            assert expected_dense <= rec["dense_bytes"][step] <= expected_dense + 12 * 48, (variant, step)
            assert total_bytes <= rec["step_dense"][step] <= total_bytes + 12 * 48  # what dense DDP writes
    # At 99 % the payload is cut by well over an order of magnitude; on the wire gloo's fixed headers (over
    # 1 KiB a step) weigh on this 7 KiB model, and the cut is smaller (for real models they vanish).
    last = runs["no_warmup"][0]
    payload = sum(8 * topk_count(p.numel(), 0.99) for p in last["params_before"][0].values())
    assert sum(p.numel() * 4 for p in last["params_before"][0].values()) / payload > 20
    assert last["step_dense"][-1] / last["step_sent"][-1] > 4


def test_dense_phase_with_momentum_correction_equals_momentum_sgd(runs):
    x, y = _global_batches()
    results = runs["dense_phase"]
    model = _model(0)
    model.load_state_dict(results[0]["params_before"][0])
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for step in range(STEPS):
        optimizer.zero_grad()
        MLP.loss(model(x[step]), y[step]).backward()
        optimizer.step()
        for rank, rec in enumerate(results):
            assert not rec["sent"][step] and rec["sparse_bytes"][step] == 0
            for name, p in model.named_parameters():
                assert_close(rec["params_after"][step][name], p.detach(), rtol=RTOL, atol=ATOL,
                             msg=lambda m: f"rank {rank} step {step} {name}: {m}")
    # Negative control: the compressed run with the same momentum has left momentum SGD.
    far = max((runs["momentum_masked"][0]["params_after"][-1][n] - p.detach()).abs().max().item() for n, p in model.named_parameters())
    assert far > 1e-4


# ------------------------------------------------------------------ end to end, against one process
REF_OPTIONS = dict(sparsity=[0.5, 0.9], rampup_begin_step=1, rampup_steps=2, momentum=MOMENTUM, momentum_masking=True,
                   dense_min_numel=33)  # step 0 dense (its momentum carries over), then 50 %, then 90 %; biases dense


class _Reordered(torch.nn.Module):
    """An MLP whose layers are registered in the reverse order of their use, two hidden layers of one shape.

    DDP averages the first step in one bucket, then rebuilds its buckets in the order gradients became ready:
    with a small ``bucket_cap_mb`` the layers then sit in other buckets at other offsets. A residual or
    momentum kept by bucket position would be added to the wrong tensor after step 0 (the two hidden layers
    have the same shape, so nothing would fail loudly: training would just be worse).
    """

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(32, OUT_FEATURES)
        self.hidden2 = torch.nn.Linear(32, 32)
        self.hidden1 = torch.nn.Linear(32, 32)
        self.body = torch.nn.Linear(IN_FEATURES, 32)

    def forward(self, x):
        for layer in (self.body, self.hidden1, self.hidden2):
            x = torch.relu(layer(x))
        return self.head(x)


@counts_own_traffic
def _layout_recording_hook(state, bucket):
    state.layouts.append((state.step, bucket.index(), [state.names[p] for p in bucket.parameters()]))
    return dgc_hook(state, bucket)


def _train_reordered(rank, world_size):
    x, y = _global_batches()
    rows = _rows(rank)
    torch.manual_seed(INIT_SEED + rank)  # DDP broadcasts rank 0's weights
    model = _Reordered()
    stats = CommStats()
    state = DGCState(dist.group.WORLD, stats=stats, **REF_OPTIONS)
    state.layouts, state.names = [], {p: n for n, p in model.named_parameters()}
    ddp = apply_ddp(model, process_group=dist.group.WORLD, comm_hook=_layout_recording_hook, comm_state=state,
                    bucket_cap_mb=0.004)  # about 1,000 floats a bucket: one layer each after the rebuild
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR)  # momentum lives in the hook (correction)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    weights = []
    for step in range(STEPS):
        state.begin_step(step)
        optimizer.zero_grad(set_to_none=True)
        MLP.loss(ddp(x[step, rows]), y[step, rows]).backward()
        optimizer.step()
        weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"init": init, "weights": weights, "layouts": state.layouts, "sparse_bytes": stats.bytes(DGC_SPARSE)}


def _reference_dgc(init, swap_after_first_step=()):
    """The paper's algorithm in one process: for each simulated rank, on its own rows, per tensor
    u ← m·u + g, v ← v + u, send the top-k of |v|, clear v and u where sent; sum what was sent, divide by
    the ranks, plain SGD. ``swap_after_first_step`` names two tensors whose residual and momentum trade places
    after step 0, as a store keyed by bucket position would do (the negative control)."""
    x, y = _global_batches()
    schedule = DGCState(None, **REF_OPTIONS)
    model = _Reordered()
    model.load_state_dict(init)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    names = [n for n, _ in model.named_parameters()]
    u = [{n: torch.zeros(p.numel()) for n, p in model.named_parameters()} for _ in range(WORLD_SIZE)]
    v = [{n: torch.zeros(p.numel()) for n, p in model.named_parameters()} for _ in range(WORLD_SIZE)]
    weights = []
    for step in range(STEPS):
        grads = []
        for rank in range(WORLD_SIZE):
            model.zero_grad(set_to_none=True)
            MLP.loss(model(x[step, _rows(rank)]), y[step, _rows(rank)]).backward()
            grads.append({n: p.grad.detach().reshape(-1).clone() for n, p in model.named_parameters()})
        sparsity = schedule.sparsity_at(step)
        for name, p in model.named_parameters():
            total = torch.zeros(p.numel())
            for rank in range(WORLD_SIZE):
                u[rank][name].mul_(MOMENTUM).add_(grads[rank][name])
                if sparsity == 0 or p.numel() < REF_OPTIONS["dense_min_numel"]:
                    total += u[rank][name]
                    continue
                v[rank][name].add_(u[rank][name])
                index = torch.topk(v[rank][name].abs(), topk_count(p.numel(), sparsity), sorted=False).indices
                total.index_add_(0, index, v[rank][name][index])
                v[rank][name][index] = 0
                u[rank][name][index] = 0
            p.grad = (total / WORLD_SIZE).view_as(p)
        optimizer.step()
        weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
        if step == 0 and swap_after_first_step:
            a, b = swap_after_first_step
            for store in (*u, *v):
                store[a], store[b] = store[b], store[a]
    assert set(names) == set(weights[0])
    return weights


@pytest.fixture(scope="module")
def reordered(tmp_path_factory):
    return run_ranks(_train_reordered, WORLD_SIZE, tmp_path_factory.mktemp("dgc_reordered"))


def test_end_to_end_equals_single_process_algorithm_across_a_bucket_rebuild(reordered):
    layouts = reordered[0]["layouts"]
    first = [names for step, _, names in layouts if step == 0]
    later = [names for step, _, names in layouts if step == 1]
    assert len(first) == 1 and len(later) > 2, layouts  # one bucket at step 0, then DDP rebuilt them
    assert reordered[0]["sparse_bytes"] > 0 and reordered[1]["sparse_bytes"] > 0  # it did compress
    expected = _reference_dgc(reordered[0]["init"])
    for rank, result in enumerate(reordered):
        assert all(torch.equal(result["init"][n], reordered[0]["init"][n]) for n in result["init"])
        for step in range(STEPS):
            for name, weight in expected[step].items():
                assert_close(result["weights"][step][name], weight, rtol=RTOL, atol=ATOL,
                             msg=lambda m: f"rank {rank} step {step} {name}: {m}")
    # Negative control: residuals and momenta of the two same-shaped layers swapped after the rebuild.
    swapped = _reference_dgc(reordered[0]["init"], swap_after_first_step=("hidden1.weight", "hidden2.weight"))
    with pytest.raises(AssertionError):
        for name, weight in swapped[-1].items():
            assert_close(reordered[0]["weights"][-1][name], weight, rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------ the callback's checks (no processes)
def test_callback_refuses_strategies_without_a_ddp_comm_hook():
    from parallelkit.callbacks.dgc import DeepGradientCompression
    from parallelkit.errors import ConfigError
    from parallelkit.strategies import DDPStrategy, SingleStrategy
    from parallelkit.capabilities import LIGHTNING_BACKWARD, REPLICATED_PARAMS

    class NoHookStrategy:  # a strategy decided by its capabilities, whatever its class
        strategy_name = "pp"

        def supports(self, capability):
            return capability in {LIGHTNING_BACKWARD, REPLICATED_PARAMS}

    for strategy, message in ((SingleStrategy(), "strategy=single"), (NoHookStrategy(), "strategy=pp")):
        with pytest.raises(ConfigError, match=f"callbacks=\\[dgc\\] does not work with {message}.*'ddp_comm_hook'"):
            DeepGradientCompression().check_strategy(strategy)
    with pytest.raises(ConfigError, match="already sets one"):
        DeepGradientCompression().check_strategy(DDPStrategy(ddp_comm_hook=lambda state, bucket: None))
    strategy = DDPStrategy()
    DeepGradientCompression().check_strategy(strategy)  # DDP without a hook: accepted, and reserved
    DeepGradientCompression().check_strategy(strategy)  # the same owner may ask again (setup after the pre-check)


def test_callback_warns_when_the_run_is_too_short_for_its_sparsity():
    import warnings

    from parallelkit.callbacks.dgc import DeepGradientCompression

    callback = DeepGradientCompression(rampup_steps=60)  # 99.9 % from step 60
    with pytest.warns(UserWarning, match=r"240 steps at that sparsity \(about 0.2 sends per coordinate\)"):
        callback._warn_if_short(300)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        callback._warn_if_short(12_500)  # 12.4 sends per coordinate: no warning
        callback._warn_if_short(-1)  # epoch-based run: nothing to judge
        DeepGradientCompression(sparsity=[0.75, 0.99], rampup_steps=60)._warn_if_short(1_100)  # 10.4 sends


@pytest.mark.parametrize("kwargs,message", [
    (dict(sparsity=[0.9, 0.5]), "should not decrease"),
    (dict(sparsity=[1.0]), r"fractions in \[0, 1\)"),
    (dict(rampup_steps=-1), "rampup_steps should be an int >= 0"),
    (dict(local_clip_norm=0), "local_clip_norm should be a number > 0"),
    (dict(momentum_correction=False, momentum_masking=True), "momentum_masking=true needs momentum correction"),
])
def test_callback_validates_its_arguments(kwargs, message):
    from parallelkit.callbacks.dgc import DeepGradientCompression
    from parallelkit.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        DeepGradientCompression(**kwargs)
