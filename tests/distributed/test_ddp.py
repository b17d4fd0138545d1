"""``apply_ddp`` on 2 real gloo ranks against a single-process reference.

Each rank builds the model from its *own* seed and trains on its *own* half of every global batch. DDP must
make the replicas identical (broadcast from rank 0) and average the gradients, so the run must equal one
process that starts from rank 0's initial weights and trains on the whole batch (mean loss): same loss, same
gradients, same stepped weights, within fp32 round-off. The gradient traffic counted must be what each rank's
process really wrote during the step (``/proc/self/io`` ``wchar``), byte for byte.

All variants run in one launch of 2 ranks (a gloo launch costs seconds on 2 cores); the tests below each
examine one aspect of the results.
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations at run time.

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from parallelkit.callbacks.run_summary import os_bytes_written
from parallelkit.distributed.comm_hooks import GRAD_ALLREDUCE, GRAD_HOOK_INPUT, fp16_compress_hook
from parallelkit.distributed.comm_stats import CommStats
from parallelkit.distributed.data_parallel import apply_ddp
from parallelkit.models.mlp import MLP

from .harness import run_ranks

WORLD_SIZE = 2
IN_FEATURES, OUT_FEATURES, HIDDEN = 16, 8, [32, 32]
LOCAL_BATCH = 8
STEPS = 4
LR, MOMENTUM = 0.05, 0.9
INIT_SEED = 1000  # rank r initialises with INIT_SEED + r
DATA_SEED = 7
# fp32 round-off: the reduction order of DDP's averaged gradients differs from one full-batch backward.
RTOL, ATOL = 1e-5, 1e-6
# 16 bytes: smaller than every gradient of the model (the smallest, the last bias, is 8 floats = 32 bytes), so
# each parameter gets its own bucket, against one bucket for the default 25 MiB.
SMALL_BUCKET_MB = 16 / 2**20


def _local_only_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Broken on purpose: hands back this rank's own gradients, never all-reduced (the negative control)."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


HOOKS = {"allreduce": None, "fp16": fp16_compress_hook, "local_only": _local_only_hook}
VARIANTS = {
    "default": {"hook": "allreduce", "bucket_cap_mb": 25.0},
    "small_buckets": {"hook": "allreduce", "bucket_cap_mb": SMALL_BUCKET_MB},
    "fp16": {"hook": "fp16", "bucket_cap_mb": 25.0},
    "local_only": {"hook": "local_only", "bucket_cap_mb": 25.0},
}


# --------------------------------------------------------------------------------------- shared pieces
def _global_batches() -> tuple[torch.Tensor, torch.Tensor]:
    """``STEPS`` global batches; rank r trains on rows ``[r * LOCAL_BATCH, (r + 1) * LOCAL_BATCH)``."""
    gen = torch.Generator().manual_seed(DATA_SEED)
    x = torch.randn(STEPS, WORLD_SIZE * LOCAL_BATCH, IN_FEATURES, generator=gen)
    y = torch.randn(STEPS, WORLD_SIZE * LOCAL_BATCH, OUT_FEATURES, generator=gen)
    return x, y


def _rows(rank: int) -> slice:
    return slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)


def _model(seed: int) -> MLP:
    torch.manual_seed(seed)
    return MLP(in_features=IN_FEATURES, out_features=OUT_FEATURES, hidden=HIDDEN)


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _grad_bytes(params: dict[str, torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params.values())


# ---------------------------------------------------------------------------------------------- ranks
def _train_ddp(rank: int, world_size: int, variants: dict) -> dict:
    """Train every variant for ``STEPS`` steps on this rank's half of the data; record everything."""
    x, y = _global_batches()
    rows = _rows(rank)
    out = {}
    for name, spec in variants.items():
        model = _model(INIT_SEED + rank)
        record = {"init": _params(model)}
        stats = CommStats()
        ddp = apply_ddp(
            model,
            process_group=dist.group.WORLD,
            bucket_cap_mb=spec["bucket_cap_mb"],
            comm_hook=HOOKS[spec["hook"]],
            comm_stats=stats,
        )
        record["wrapped"] = _params(model)
        optimizer = _optimizer(ddp.parameters())
        for key in ("loss", "grads", "params_before", "params_after", "bytes", "collectives", "hook_input_bytes", "written"):
            record[key] = []
        for step in range(STEPS):
            record["params_before"].append(_params(model))
            optimizer.zero_grad(set_to_none=True)
            sent, calls = stats.bytes(GRAD_ALLREDUCE), stats.calls(GRAD_ALLREDUCE)
            hook_input = stats.bytes(GRAD_HOOK_INPUT)
            written = os_bytes_written()
            loss = MLP.loss(ddp(x[step, rows]), y[step, rows])
            loss.backward()  # returns once DDP has waited for every bucket's collective
            record["written"].append(os_bytes_written() - written)
            record["loss"].append(loss.detach())
            record["grads"].append(_grads(model))
            record["bytes"].append(stats.bytes(GRAD_ALLREDUCE) - sent)
            record["collectives"].append(stats.calls(GRAD_ALLREDUCE) - calls)
            record["hook_input_bytes"].append(stats.bytes(GRAD_HOOK_INPUT) - hook_input)
            optimizer.step()
            record["params_after"].append(_params(model))
        out[name] = record
    return out


# ------------------------------------------------------------------------------------------ reference
def _reference(init: dict[str, torch.Tensor]) -> dict:
    """One process, rank 0's initial weights, the whole global batch, loss = mean over it."""
    x, y = _global_batches()
    model = _model(0)
    model.load_state_dict(init)
    optimizer = _optimizer(model.parameters())
    ref = {"loss": [], "grads": [], "params_after": []}
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = MLP.loss(model(x[step]), y[step])
        loss.backward()
        ref["loss"].append(loss.detach())
        ref["grads"].append(_grads(model))
        optimizer.step()
        ref["params_after"].append(_params(model))
    return ref


def _gradients_at(params: dict[str, torch.Tensor], step: int, rows: slice) -> dict[str, torch.Tensor]:
    """Gradient of the mean loss over ``rows`` of batch ``step``, at weights ``params``."""
    x, y = _global_batches()
    model = _model(0)
    model.load_state_dict(params)
    MLP.loss(model(x[step, rows]), y[step, rows]).backward()
    return _grads(model)


def _assert_matches_reference(results: list[dict], ref: dict, checks=("loss", "grads", "params")) -> None:
    """The DDP run equals the single-process run, step by step, within fp32 round-off."""
    for step in range(STEPS):
        if "loss" in checks:
            # Equal halves: the mean of the two local mean losses is the full-batch mean loss.
            mean_loss = torch.stack([r["loss"][step] for r in results]).mean()
            assert_close(mean_loss, ref["loss"][step], rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step} loss: {m}")
        for rank, result in enumerate(results):
            if "grads" in checks:
                assert_close(result["grads"][step], ref["grads"][step], rtol=RTOL, atol=ATOL,
                             msg=lambda m: f"rank {rank} step {step} gradients: {m}")
            if "params" in checks:
                assert_close(result["params_after"][step], ref["params_after"][step], rtol=RTOL, atol=ATOL,
                             msg=lambda m: f"rank {rank} step {step} weights: {m}")


def _assert_grad_traffic(results: list[dict], bytes_per_element: int) -> None:
    """Every backward all-reduced each gradient exactly once, and parallelkit counted what the process wrote."""
    for rank, result in enumerate(results):
        counted, written = result["bytes"], result["written"]
        # DDP itself broadcasts the rebuilt bucket order from rank 0 once, in the second step's forward
        # (its C++ reducer: nothing parallelkit can count); a few hundred bytes, every other step is exact.
        assert counted[:1] + counted[2:] == written[:1] + written[2:], f"rank {rank}: counted {counted}, written {written}"
        assert 0 < written[1] - counted[1] < 512, f"rank {rank}: counted {counted}, written {written}"
        # A ring all-reduce on 2 ranks sends every gradient byte once (plus gloo's message headers).
        payload = _grad_bytes(result["init"]) // 4 * bytes_per_element
        assert all(payload <= w < payload * 1.5 for w in result["written"]), f"rank {rank}: wrote {result['written']}, payload {payload}"
        assert all(calls >= 1 for calls in result["collectives"]), f"rank {rank}: {result['collectives']}"
        assert result["hook_input_bytes"] == [0] * STEPS  # parallelkit's own hooks count as grad_allreduce


# ------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    per_rank = run_ranks(_train_ddp, WORLD_SIZE, tmp_path_factory.mktemp("ddp"), VARIANTS)
    return {name: [per_rank[rank][name] for rank in range(WORLD_SIZE)] for name in VARIANTS}


@pytest.fixture(scope="module")
def reference(runs) -> dict:
    return _reference(runs["default"][0]["init"])


# ---------------------------------------------------------------------------------------------- tests
def test_ranks_start_different_and_ddp_broadcasts_rank0_weights(runs):
    for name, results in runs.items():
        rank0_init = results[0]["init"]
        with pytest.raises(AssertionError):  # different seeds: the broadcast below is not vacuous
            assert_close(results[1]["init"], rank0_init)
        for rank, result in enumerate(results):
            assert_close(result["wrapped"], rank0_init, rtol=0, atol=0, msg=lambda m: f"{name} rank {rank}: {m}")
        # Same seeds in every variant: they all start from the weights the reference uses.
        assert_close(rank0_init, runs["default"][0]["init"], rtol=0, atol=0)


def test_each_rank_trains_on_different_data(runs):
    losses = [torch.stack(r["loss"]) for r in runs["default"]]
    # Same weights on both ranks at step 0, so only the data can make the local losses differ.
    assert (losses[0] - losses[1]).abs().min() > 1e-3, losses


def test_ddp_matches_single_process(runs, reference):
    _assert_matches_reference(runs["default"], reference)
    # Replicas stay bit-identical: they apply the same averaged gradient.
    assert_close(runs["default"][0]["params_after"], runs["default"][1]["params_after"], rtol=0, atol=0)


def test_gradient_traffic_is_counted(runs):
    _assert_grad_traffic(runs["default"], bytes_per_element=4)
    assert runs["default"][0]["collectives"] == [1] * STEPS  # the whole model fits one 25 MiB bucket


def test_small_buckets_issue_more_collectives_with_the_same_result(runs, reference):
    small, default = runs["small_buckets"], runs["default"]
    _assert_matches_reference(small, reference)
    _assert_grad_traffic(small, bytes_per_element=4)
    n_params = len(small[0]["init"])
    # DDP puts every gradient in one bucket for the first backward (find_unused_parameters=False) and
    # rebuilds the buckets by size after it; from then on each parameter is its own bucket here.
    for rank in range(WORLD_SIZE):
        assert small[rank]["collectives"][1:] == [n_params] * (STEPS - 1), small[rank]["collectives"]
        assert all(s > d for s, d in zip(small[rank]["collectives"][1:], default[rank]["collectives"][1:]))


def test_fp16_compression_halves_the_bytes_within_fp16_precision(runs):
    results = runs["fp16"]
    _assert_grad_traffic(results, bytes_per_element=2)
    # fp16 unit round-off u = eps/2 = 2**-11. The hook rounds each rank's gradient g_r to fp16
    # (error <= u*|g_r|), halves it (exact), and gloo rounds the fp16 sum once more (<= u*|sum|, and
    # |sum| <= (|g_0| + |g_1|)/2): |error| <= u*(|g_0| + |g_1|) per element. The bound uses the *local*
    # gradients: where they cancel, the relative error of the mean is unbounded. Below 2**-14 fp16 is
    # subnormal with a fixed spacing of 2**-24: those three roundings add at most 3 * 2**-25 < 2**-23.
    # RTOL covers the fp32 round-off between the reference's full-batch backward and DDP's two halves.
    u = torch.finfo(torch.float16).eps / 2
    subnormal = 2.0**-23
    for step in range(STEPS):
        # Reference at the weights the fp16 run really had (replicas identical, so rank 0's).
        weights = results[0]["params_before"][step]
        assert_close(results[1]["params_before"][step], weights, rtol=0, atol=0)
        local = [_gradients_at(weights, step, _rows(r)) for r in range(WORLD_SIZE)]
        full = _gradients_at(weights, step, slice(None))
        for rank, result in enumerate(results):
            for name, grad in result["grads"][step].items():
                bound = u * (local[0][name].abs() + local[1][name].abs()) + subnormal + RTOL * full[name].abs()
                excess = (grad - full[name]).abs() - bound
                assert excess.max() <= 0, f"rank {rank} step {step} {name}: exceeds the fp16 bound by {excess.max()}"
        # fp16 transport does not touch the forward: the mean local loss is the fp32 full-batch loss.
        x, y = _global_batches()
        model = _model(0)
        model.load_state_dict(weights)
        expected_loss = MLP.loss(model(x[step]), y[step]).detach()
        assert_close(torch.stack([r["loss"][step] for r in results]).mean(), expected_loss, rtol=RTOL, atol=ATOL)
    # The compression is visible (otherwise this test would prove nothing about fp16): not bit-exact.
    weights = results[0]["params_before"][0]
    full = _gradients_at(weights, 0, slice(None))
    assert any(not torch.equal(results[0]["grads"][0][n], full[n]) for n in full)


def test_negative_control_local_gradients_are_caught(runs, reference):
    broken = runs["local_only"]
    # Each of the three comparisons, alone, catches gradients that were never averaged.
    for check in ("loss", "grads", "params"):
        with pytest.raises(AssertionError):
            _assert_matches_reference(broken, reference, checks=(check,))
    final = [r["params_after"][-1] for r in broken]
    for rank in range(WORLD_SIZE):
        diff = max((final[rank][n] - reference["params_after"][-1][n]).abs().max().item() for n in final[rank])
        assert diff > 1e-3, f"rank {rank}: local-only training ended {diff} from the reference"
    # ... and the traffic check catches it too: nothing was all-reduced (nothing written), only the hook's input
    # was counted.
    with pytest.raises(AssertionError):
        _assert_grad_traffic(broken, bytes_per_element=4)
    assert broken[0]["bytes"] == [0] * STEPS
    assert broken[0]["written"][:1] + broken[0]["written"][2:] == [0] * (STEPS - 1)  # only DDP's bucket-order broadcast
    assert broken[0]["hook_input_bytes"] == [_grad_bytes(broken[0]["init"])] * STEPS


# ------------------------------------------------------------------------------------- bucket memory
def _bucket_memory(rank: int, world_size: int) -> dict:
    """What DDP itself reports of its buckets, against what parallelkit adds to ``model_state_bytes``."""
    from parallelkit.strategies.ddp import ddp_bucket_bytes

    out = {}
    for view in (False, True):
        model = _model(INIT_SEED)
        ddp = apply_ddp(model, process_group=dist.group.WORLD, bucket_cap_mb=SMALL_BUCKET_MB * 64, gradient_as_bucket_view=view)
        MLP.loss(ddp(torch.randn(4, IN_FEATURES)), torch.randn(4, OUT_FEATURES)).backward()
        logged = ddp._get_ddp_logging_data()
        storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
        out[view] = {"counted": ddp_bucket_bytes(ddp), "ddp_bucket_bytes": sum(int(b) for b in str(logged["bucket_sizes"]).split(", ")),
                     "grad_storages": len(storages), "params": len(list(model.parameters())), "grad_bytes": _grad_bytes(_grads(model))}
    return out


def test_ddp_buckets_are_counted_in_model_state_unless_gradients_are_views_into_them(tmp_path):
    result = run_ranks(_bucket_memory, WORLD_SIZE, tmp_path)[0]
    copy, view = result[False], result[True]
    # gradient_as_bucket_view=False (the default): every gradient lives twice, in p.grad and in DDP's buckets.
    assert copy["counted"] == copy["ddp_bucket_bytes"] == copy["grad_bytes"] > 0
    assert copy["grad_storages"] == copy["params"]  # p.grad are separate tensors, not the buckets
    # gradient_as_bucket_view=True: p.grad are views into the buckets, nothing to add (negative control).
    assert view["counted"] == 0 and view["ddp_bucket_bytes"] == view["grad_bytes"]
    assert view["grad_storages"] < view["params"]
