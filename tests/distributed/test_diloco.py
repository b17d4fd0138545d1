"""DiLoCo and Streaming DiLoCo on 2 real gloo ranks.

Each rank trains on its own half of every global batch with its own SGD-with-momentum inner optimizer; DDP's
gradient all-reduce is off (the Local SGD hook with ``sync_grads=False``). References computed here: plain
DDP on the same data (H=1, outer lr 1, no outer momentum must equal it step for step: momentum SGD is linear,
so averaging the replicas' steps is averaging their gradients), and a one-process simulation of both
replicas with the outer Nesterov SGD (H=4). Traffic: counted bytes are DDP's ÷ 4 (÷ 8 for bf16 outer
gradients) and equal to what the processes wrote. Resume: a run checkpointed mid-outer-step (and, streaming,
with a fragment's all-reduce in flight), reloaded into fresh replicas of another initialisation, reproduces
the uninterrupted run bit for bit. Negative controls: outer momentum left on at H=1 (must not equal DDP),
DDP's all-reduce left on (the bytes check must catch it), a resume that forgets the outer momentum.
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations at run time.

import io

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from parallelkit.distributed.comm_stats import CommStats, collective_bytes
from parallelkit.distributed.data_parallel import apply_ddp
from parallelkit.distributed.diloco import OUTER_ALLREDUCE, DiLoCo
from parallelkit.distributed.local_sgd import GRAD_ALLREDUCE, LocalSGDState, local_sgd_hook
from parallelkit.models.mlp import MLP
from parallelkit.process_stats import os_bytes_written

from .harness import run_ranks

WORLD_SIZE = 2
IN_FEATURES, OUT_FEATURES, HIDDEN = 16, 8, [256, 256]  # ~72k parameters: gloo's headers are < 1 % of a fragment
LOCAL_BATCH = 8
STEPS = 12
RESUME_AT = 6  # steps done before the checkpoint: mid-period for H=4; streaming: fragment 0 in flight
LR, MOMENTUM = 0.05, 0.9
INIT_SEED, DATA_SEED = 1000, 7

PLAIN = dict(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
H4 = dict(inner_steps=4, outer_lr=0.7, outer_momentum=0.9, nesterov=True)
STREAM = dict(H4, fragments=2, overlap_steps=1, mix=0.5, outer_dtype="bf16")
VARIANTS = {
    "ddp": None,
    "h1": PLAIN,
    "h1_outer_momentum": dict(PLAIN, outer_momentum=0.9),  # negative control: not DDP
    "h4": H4,
    "stream": STREAM,
    "h4_allreduce_left_on": H4,  # negative control: DDP's own all-reduce stays on
}
RESUMED = {"h4": H4, "stream": STREAM}


def _global_batches():
    gen = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(STEPS, WORLD_SIZE * LOCAL_BATCH, IN_FEATURES, generator=gen)
    w = torch.randn(IN_FEATURES, OUT_FEATURES, generator=gen)
    return x, x @ w


def _rows(rank):
    return slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)


def _model(seed):
    torch.manual_seed(seed)
    return MLP(in_features=IN_FEATURES, out_features=OUT_FEATURES, hidden=HIDDEN)


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _replica(rank, name, options, seed):
    model = _model(seed)
    stats = CommStats()
    if options is None or name == "h4_allreduce_left_on":
        ddp = apply_ddp(model, process_group=dist.group.WORLD, comm_stats=stats)
    else:
        state = LocalSGDState(dist.group.WORLD, stats)
        state.sync_grads = False
        ddp = apply_ddp(model, process_group=dist.group.WORLD, comm_hook=local_sgd_hook, comm_state=state)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    diloco = DiLoCo(ddp.parameters(), dist.group.WORLD, stats, **options) if options else None
    return model, ddp, optimizer, diloco, stats


def _steps(rank, parts, steps, rec):
    model, ddp, optimizer, diloco, stats = parts
    x, y = _global_batches()
    for step in steps:
        optimizer.zero_grad(set_to_none=True)
        MLP.loss(ddp(x[step, _rows(rank)]), y[step, _rows(rank)]).backward()
        optimizer.step()
        if diloco:
            rec["applied"].append(diloco.after_step(step, force=step == STEPS - 1))
        rec["params"].append(_params(model))
        rec["bytes"].append(stats.bytes(GRAD_ALLREDUCE) + stats.bytes(OUTER_ALLREDUCE))


def _train(rank, world_size, variants, resumed):
    out = {}
    for name, options in variants.items():
        parts = _replica(rank, name, options, INIT_SEED + rank)
        rec = {"init": _params(parts[0]), "params": [], "bytes": [], "applied": []}
        written = os_bytes_written()
        _steps(rank, parts, range(STEPS), rec)
        rec["written"] = os_bytes_written() - written
        rec["outer_steps"] = list(parts[3].outer_steps) if parts[3] else []
        if parts[3]:  # what the backend's algorithm writes for one all-reduce of each fragment in the outer dtype
            size = parts[3].dtype.itemsize
            rec["fragment_wire"] = [collective_bytes(sum(parts[3].params[i].numel() for i in idx) * size, "all_reduce",
                                                     dist.group.WORLD, element_size=size) for idx in parts[3].fragments]
        out[name] = rec
    for name, options in resumed.items():
        for forget_momentum in (False, True):
            first = _replica(rank, name, options, INIT_SEED + rank)
            rec = {"params": [], "bytes": [], "applied": []}
            _steps(rank, first, range(RESUME_AT), rec)
            model, _, optimizer, diloco, _ = first
            # what a checkpoint holds for this rank, through bytes (as a file would)
            buffer = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "diloco": diloco.state_dict()}, buffer)
            in_flight = diloco.pending is not None
            del first, model, optimizer, diloco
            saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
            if forget_momentum:
                saved["diloco"]["outer"]["state"] = {}
            fresh = _replica(rank, name, options, INIT_SEED + 100 + rank)  # another init: the load must overwrite it
            fresh[0].load_state_dict(saved["model"])
            fresh[2].load_state_dict(saved["optimizer"])
            fresh[3].load_state_dict(saved["diloco"])
            rec = {"params": [], "bytes": [], "applied": [], "in_flight": in_flight}
            _steps(rank, fresh, range(RESUME_AT, STEPS), rec)
            out[f"{name}_resumed" + ("_forgot_momentum" if forget_momentum else "")] = rec
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    per_rank = run_ranks(_train, WORLD_SIZE, tmp_path_factory.mktemp("diloco"), VARIANTS, RESUMED, timeout_s=240)
    return {name: [per_rank[r][name] for r in range(WORLD_SIZE)] for name in per_rank[0]}


def _same(a, b):
    return all(torch.equal(a[n], b[n]) for n in a)


def test_h1_outer_lr_1_no_momentum_equals_ddp_step_for_step(runs):
    for rank in range(WORLD_SIZE):
        for step in range(STEPS):
            assert_close(runs["h1"][rank]["params"][step], runs["ddp"][rank]["params"][step], rtol=0, atol=1e-6,
                         msg=lambda m: f"rank {rank} step {step}: {m}")
    assert all(runs["h1"][0]["applied"])
    # negative control: outer momentum makes it another algorithm, and the comparison sees it
    with pytest.raises(AssertionError):
        assert_close(runs["h1_outer_momentum"][0]["params"][-1], runs["ddp"][0]["params"][-1], rtol=0, atol=1e-6)


def _simulate(init):
    """Both replicas in one process, each with its own momentum SGD; every 4 steps the outer Nesterov SGD
    takes the mean of (anchor - replica) as its gradient and both replicas restart from the anchor."""
    x, y = _global_batches()
    models = [_model(0) for _ in range(WORLD_SIZE)]
    for m in models:
        m.load_state_dict(init)
    inner = [torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM) for m in models]
    anchor = [p.detach().clone() for p in models[0].parameters()]
    outer = torch.optim.SGD(anchor, lr=H4["outer_lr"], momentum=H4["outer_momentum"], nesterov=True)
    trajectory = []
    for step in range(STEPS):
        for r, (m, opt) in enumerate(zip(models, inner)):
            opt.zero_grad()
            MLP.loss(m(x[step, _rows(r)]), y[step, _rows(r)]).backward()
            opt.step()
        if (step + 1) % 4 == 0:
            with torch.no_grad():
                for i, a in enumerate(anchor):
                    a.grad = sum(a - list(m.parameters())[i] for m in models) / WORLD_SIZE
                outer.step()
                for m in models:
                    for p, a in zip(m.parameters(), anchor):
                        p.copy_(a)
        trajectory.append([_params(m) for m in models])
    return trajectory


def test_h4_matches_two_replica_simulation_and_replicas_drift_between_outer_steps(runs):
    a, b = runs["h4"]
    assert [s for s, f in a["outer_steps"]] == [3, 7, 11]
    reference = _simulate(a["init"])
    for step in range(STEPS):
        for rank, rec in enumerate((a, b)):
            assert_close(rec["params"][step], reference[step][rank], rtol=1e-5, atol=1e-6,
                         msg=lambda m: f"rank {rank} step {step}: {m}")
        assert _same(a["params"][step], b["params"][step]) == ((step + 1) % 4 == 0), step


def _bytes_first_8_steps(rec):
    return rec["bytes"][7]  # cumulative after step 7: two whole periods, before the end's forced sync


def test_h4_sends_ddp_bytes_divided_by_4_and_streaming_bf16_by_8_counted_equals_written(runs):
    for rank in range(WORLD_SIZE):
        dense = _bytes_first_8_steps(runs["ddp"][rank])
        assert dense > 0
        assert _bytes_first_8_steps(runs["h4"][rank]) * 4 == dense  # one all-reduce of the same size per 4 steps
        ratio = dense / _bytes_first_8_steps(runs["stream"][rank])
        assert abs(ratio - 8) / 8 < 0.01, ratio  # half the bytes, and gloo's headers on twice as many messages
        # exactly what the algorithm of the backend writes, fragment by fragment, in bf16
        expected = sum(runs["stream"][rank]["fragment_wire"]) * 2  # each fragment twice in 8 steps
        assert _bytes_first_8_steps(runs["stream"][rank]) == expected
        for name in ("ddp", "h4", "stream"):
            rec = runs[name][rank]
            # DDP's one-time broadcast of its rebuilt bucket order (a few hundred bytes) is its own, uncounted
            assert 0 <= rec["written"] - rec["bytes"][-1] < 512, (name, rec["written"], rec["bytes"][-1])


def test_negative_control_allreduce_left_on_is_caught(runs):
    dense = _bytes_first_8_steps(runs["ddp"][0])
    assert _bytes_first_8_steps(runs["h4_allreduce_left_on"][0]) * 4 != dense


def test_streaming_stagger_overlap_and_merge(runs):
    a, b = runs["stream"]
    # fragment 0 starts after steps 1, 5, 9 and lands one step later; fragment 1 after 3, 7 (11: due at the end, with fragment 0 averaged)
    assert a["outer_steps"][:5] == [(2, 0), (4, 1), (6, 0), (8, 1), (10, 0)], a["outer_steps"]
    assert _same(a["params"][-1], b["params"][-1])  # the end: one model
    assert not _same(a["params"][6], b["params"][6])  # merged with the local steps: replicas still differ


@pytest.mark.parametrize("name", ["h4", "stream"])
def test_resume_mid_outer_step_reproduces_the_uninterrupted_run(runs, name):
    for rank in range(WORLD_SIZE):
        straight, resumed = runs[name][rank], runs[f"{name}_resumed"][rank]
        assert resumed["in_flight"] == (name == "stream")  # streaming: checkpointed with a fragment in flight
        for i, step in enumerate(range(RESUME_AT, STEPS)):
            assert _same(resumed["params"][i], straight["params"][step]), f"{name} rank {rank} step {step}"
        forgot = runs[f"{name}_resumed_forgot_momentum"][rank]
        assert not _same(forgot["params"][-1], straight["params"][-1])  # negative control


# ------------------------------------------------------------------ the callback's checks (no processes)
@pytest.mark.parametrize("kwargs,message", [
    (dict(inner_steps=0), r"inner_steps should be an int >= 1\. Got 0"),
    (dict(inner_steps=4, fragments=3), r"fragments \(3\) should divide inner_steps \(4\)"),
    (dict(inner_steps=4, fragments=2, overlap_steps=2), r"overlap_steps \(2\) should be < inner_steps / fragments \(2\)"),
    (dict(outer_dtype="int4"), "outer_dtype should be one of"),
    (dict(outer_momentum=1.0), r"outer_momentum should be in \[0, 1\)"),
    (dict(outer_momentum=0.0), "nesterov=true needs outer_momentum > 0"),
    (dict(mix=1.5), r"mix should be in \[0, 1\]"),
])
def test_callback_refuses_bad_settings(kwargs, message):
    from parallelkit.callbacks.diloco import DiLoCoCallback
    from parallelkit.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        DiLoCoCallback(**kwargs)


def test_callback_needs_a_hook_and_replicas():
    from parallelkit.callbacks.diloco import DiLoCoCallback
    from parallelkit.callbacks.local_sgd import LocalSGDCallback
    from parallelkit.errors import ConfigError
    from parallelkit.strategies import DDPStrategy, SingleStrategy

    with pytest.raises(ConfigError, match="does not work with strategy=single"):
        DiLoCoCallback().check_strategy(SingleStrategy())
    strategy = DDPStrategy()
    LocalSGDCallback().check_strategy(strategy)
    with pytest.raises(ConfigError, match=r"both install a DDP comm hook"):
        DiLoCoCallback().check_strategy(strategy)


def test_fragments_are_contiguous_non_empty_and_balanced():
    from parallelkit.distributed.diloco import split_fragments

    sizes = [100, 10, 10, 100, 5, 200, 1]
    for n in range(1, len(sizes) + 1):
        parts = split_fragments([torch.zeros(s) for s in sizes], n)
        assert [i for p in parts for i in p] == list(range(len(sizes))) and all(parts), (n, parts)
    assert split_fragments([torch.zeros(s) for s in sizes], 2) == [[0, 1, 2, 3], [4, 5, 6]]  # 220 | 206 elements
    with pytest.raises(ValueError):
        split_fragments([torch.zeros(1)], 2)


def _end_in_flight(rank, world_size):
    torch.manual_seed(rank)  # different local progress per rank
    params = [torch.nn.Parameter(torch.zeros(64)) for _ in range(4)]
    stats = CommStats()
    diloco = DiLoCo(params, dist.group.WORLD, stats, **STREAM)
    for step in range(7):  # fragment 0 starts after step 5 and is still in flight when step 6 ends the run
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(64))
        in_flight = diloco.pending is not None
        diloco.after_step(step, force=step == 6)
    return {"in_flight_at_end": in_flight, "params": [p.detach().clone() for p in params],
            "anchors_equal": all(torch.equal(p, a) for p, a in zip(params, diloco.anchors)), "bytes": stats.bytes(OUTER_ALLREDUCE)}


def test_the_end_with_a_fragment_in_flight_leaves_one_model(tmp_path):
    a, b = run_ranks(_end_in_flight, WORLD_SIZE, tmp_path)
    assert a["in_flight_at_end"] and a["anchors_equal"] and b["anchors_equal"] and a["bytes"] > 0
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
