"""Tensor parallel with sequence parallel (SP) composed with FSDP2 sharding and with pipeline parallelism.

Four gloo ranks, fp32, compared with one process that trains the whole model on the whole batch (computed here,
in the test's own process): the loss of every step and the weights after 3 SGD steps (with momentum) must equal
it within fp32 round-off. The compositions are the ones the strategies make:

- **tp=2 × sharding=2**: ``apply_tp`` (SP plan), then ``apply_fsdp`` over the ``sharding`` axis (FSDP2 makes the
  parameters 2-D DTensors on ``(sharding, tp)``), then per step backward, ``TensorParallel.sync()``, the
  optimizer. The two sharding ranks read different halves of each batch; tp peers read the same half. Under SP the
  norms' weights see only their sequence shard: their gradients are partial sums over tp. FSDP2 reduces them itself:
  before its reduce-scatter over ``sharding`` it redistributes each DTensor gradient to its parameter's placements
  (``Partial`` → ``Replicate``: an all-reduce over tp, one per norm parameter, counted under the tp kinds of the
  backward), so ``sync`` finds nothing left. The negative control drops that reduction (relabels the partial sums
  as replicated, as a composition that loses the placement would): the comparison must fail.
- **tp=2 × pp=2**: ``apply_tp`` on the whole model, then the cut (``pipeline_stages``) and ``apply_pp`` (1F1B, 2
  micro-batches), the schedule run inside the TP context (``loss_parallel`` on the last stage), then ``sync``:
  here the norms' partial sums are summed by ``sync``, in one counted all-reduce per step (without it DTensor
  would sum them anyway, one all-reduce per parameter inside the optimizer step: ``sync`` fuses and counts, it is
  not what makes the result exact). The negative control drops the partial sums as above. A stage hands on this
  rank's sequence shard: ``pp_p2p`` counts half the bytes per hand-off of the same run without SP.
- **Hugging Face Llama** (``model=hf``), the same two compositions. Its stages build the causal mask and the
  rotary positions from the sequence they receive; with SP the plan's
  :func:`~parallelkit.distributed.tensor_parallel.sequence_parallel_blocks` makes the hand-off a DTensor, so the
  next stage sees the whole sequence's shape, and ``apply_pp`` gives the stages the mesh lookup that DTensor
  hand-offs need. Without that plan entry the second stage builds positions for seq / tp tokens and fails
  (negative control). The pipeline also runs with FSDP2 on its stages (``sharding`` = 1: the smallest
  tp × pp × sharding composition 4 ranks allow).

Every step's traffic is counted and equals what each rank's process wrote (after the first step of a pipeline,
which also exchanges the stages' metadata).
"""

from __future__ import annotations

import pytest
import torch

from .harness import RankFailure, run_ranks

TINY = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
HF_TINY = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
BATCH, STEPS, LR, MOMENTUM, MICRO = 8, 3, 0.5, 0.9, 2
SHARDS = 2  # data-parallel (sharding) ranks of the FSDP2 runs; the pipeline runs have one
TOL = dict(rtol=1e-5, atol=1e-6)
LOSS_PARALLEL_ALL_REDUCES = 3  # vocabulary-parallel cross-entropy's forward: the max, the sum of exponentials, the target logit
SP_NORMS = ("ln_1", "ln_2", "ln_f", "input_layernorm", "post_attention_layernorm", "norm")


def _gpt():
    from parallelkit.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(**TINY)


def _llama():
    from parallelkit.models.hf import HFCausalLM

    torch.manual_seed(0)
    return HFCausalLM(vocab_size=TINY["vocab_size"], block_size=TINY["block_size"], family="llama", **HF_TINY)


MODELS = {"gpt": _gpt, "llama": _llama}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    shape = (BATCH, TINY["block_size"])
    return torch.randint(0, TINY["vocab_size"], shape, generator=g), torch.randint(0, TINY["vocab_size"], shape, generator=g)


def _rows(shard: int, shards: int) -> slice:
    per = BATCH // shards
    return slice(shard * per, (shard + 1) * per)


def _value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: the whole DTensor (gathered), or the tensor itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _plan(model, sp: bool, without_sp_blocks: bool = False):
    from parallelkit.models.plans import model_plans

    plan = model_plans(model).tensor_parallel_plan(2, sequence_parallel=sp)
    if without_sp_blocks:  # negative control: the plan as it was before sequence_parallel_blocks
        plan.layout = {k: v for k, v in plan.layout.items() if not k.endswith("layers.*")}
    return plan


def _drop_partial_sums(model: torch.nn.Module) -> None:
    """Negative control: the norms' partial-sum gradients relabelled as replicated without being summed over tp.

    A tensor hook on the parameter the norm really uses (FSDP2's unsharded parameter, set before the norm runs),
    registered once per tensor; FSDP2 then finds the placements matching and reduce-scatters each tp rank's own
    partial sum."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    hooked: set[int] = set()

    def relabel(grad):
        if isinstance(grad, DTensor) and any(isinstance(p, Partial) for p in grad.placements):
            return DTensor.from_local(grad.to_local(), grad.device_mesh, [Replicate()], run_check=False)
        return grad

    def hook(module, args):
        for param in module.parameters(recurse=False):
            if id(param) not in hooked:
                hooked.add(id(param))
                param.register_hook(relabel)

    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in SP_NORMS:
            module.register_forward_pre_hook(hook)


def _kinds(stats) -> dict[str, tuple[int, int]]:
    return {kind: (v["collectives"], v["bytes"]) for kind, v in stats.totals()["by_kind"].items()}


# ------------------------------------------------------------------------------------------- the ranks
def _fsdp_run(family: str, mesh, per_block: bool = True, drop_partial_sums: bool = False) -> dict:
    from parallelkit.distributed.comm_stats import CommStats
    from parallelkit.distributed.fsdp import apply_fsdp
    from parallelkit.distributed.tensor_parallel import apply_tp
    from parallelkit.process_stats import os_bytes_written

    model = MODELS[family]()
    stats = CommStats()
    tp = apply_tp(model, mesh["tp"], _plan(model, True), comm_stats=stats)
    if drop_partial_sums:
        _drop_partial_sums(model)
    apply_fsdp(model, mesh["sharding"], units=None if per_block else [], reshard_after_forward=per_block, comm_stats=stats)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    rows = _rows(mesh.get_local_rank("sharding"), SHARDS)
    losses, counted, written, synced = [], [], [], []
    for step in range(STEPS):
        x, y = _batch(step)
        before = (stats.bytes(), os_bytes_written())
        with tp.context():
            loss = model.loss(model(x[rows]), y[rows])
            loss.backward()
        kinds = _kinds(stats)
        tp.sync()  # after the last backward, before the optimizer (hybrid4d: the first of its gradient syncs)
        synced.append({k: v for k, v in _kinds(stats).items() if v != kinds.get(k)})
        with tp.context():
            opt.step()
        opt.zero_grad()
        counted.append(stats.bytes() - before[0])
        written.append(os_bytes_written() - before[1])
        losses.append(_value(loss.detach()))
    return {"losses": losses, "weights": {n: _value(p.detach()) for n, p in model.named_parameters()},
            "kinds": _kinds(stats), "synced": synced, "counted": counted, "written": written,
            "placements": {n: str(p.placements) for n, p in model.named_parameters()}}


def _pp_run(family: str, mesh, sp: bool, drop_partial_sums: bool = False, without_sp_blocks: bool = False, fsdp_mesh=None) -> dict:
    from parallelkit.distributed.comm_stats import CommStats
    from parallelkit.distributed.fsdp import apply_fsdp
    from parallelkit.distributed.pipeline_parallel import PP_P2P, apply_pp, stage_blocks
    from parallelkit.distributed.tensor_parallel import apply_tp
    from parallelkit.models.plans import model_plans
    from parallelkit.process_stats import os_bytes_written

    model = MODELS[family]()
    stats = CommStats()
    tp = apply_tp(model, mesh["tp"], _plan(model, sp, without_sp_blocks), comm_stats=stats)  # 1. TP on the whole model
    if drop_partial_sums:
        _drop_partial_sums(model)
    plans = model_plans(model)
    loss_fn = plans.pipeline_loss()
    stage = mesh.get_local_rank("pp")
    stages = plans.pipeline_stages(stage_blocks(plans.pipeline_blocks(), 2), [stage])  # 2. the cut
    if fsdp_mesh is not None:  # 3. sharding on the stage (kept gathered through the step, as with a pipeline)
        apply_fsdp(stages[0], fsdp_mesh, reshard_after_forward=False, comm_stats=stats)
    pipe = apply_pp(stages, [stage], 2, mesh.get_group("pp"), microbatches=MICRO, schedule="1f1b", loss_fn=loss_fn,
                    device=torch.device("cpu"), comm_stats=stats)  # 4. the schedule
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses, counted, written = [], [], []
    for step in range(STEPS):
        x, y = _batch(step)
        before = (stats.bytes(), os_bytes_written())
        with tp.context():  # the schedule's forward, loss (loss_parallel) and backward
            loss = pipe.train_step(x, y)
        tp.sync()
        with tp.context():
            opt.step()
        opt.zero_grad()
        counted.append(stats.bytes() - before[0])
        written.append(os_bytes_written() - before[1])
        losses.append(None if loss is None else _value(loss))
    return {"losses": losses, "weights": {n: _value(p.detach()) for n, p in model.named_parameters()},
            "p2p": (stats.calls(PP_P2P), stats.bytes(PP_P2P)), "kinds": _kinds(stats), "counted": counted,
            "written": written, "stage": stage}


def _compositions(rank: int, world: int, family: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    sharded = init_device_mesh("cpu", (SHARDS, 2), mesh_dim_names=("sharding", "tp"))
    piped = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "sharding", "tp"))
    out = {"fsdp": _fsdp_run(family, sharded), "pp_sp": _pp_run(family, piped, sp=True), "pp_plain": _pp_run(family, piped, sp=False)}
    if family == "gpt":  # the other FSDP2 layout, and the negative controls
        out["fsdp_whole"] = _fsdp_run(family, sharded, per_block=False)
        out["fsdp_no_partial_sum"] = _fsdp_run(family, sharded, drop_partial_sums=True)
        out["pp_sp_no_partial_sum"] = _pp_run(family, piped, sp=True, drop_partial_sums=True)
    else:  # FSDP2 on the stages too, and DTensor hand-offs (the HF plan)
        out["pp_sp_fsdp"] = _pp_run(family, piped, sp=True, fsdp_mesh=piped["sharding"])
    return out


def _pipeline_without_sp_blocks(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    return _pp_run("llama", mesh, sp=True, without_sp_blocks=True)


# ------------------------------------------------------------------------------------------- the reference
def _reference(family: str, shards: int) -> dict:
    """One process, the whole model and batch; each data shard's mean loss per step (what a rank reports)."""
    model = MODELS[family]()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        logits = model(x)
        model.loss(logits, y).backward()
        with torch.no_grad():
            losses.append([model.loss(logits[_rows(s, shards)], y[_rows(s, shards)]) for s in range(shards)])
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "weights": {n: p.detach() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory) -> list[dict]:
    return run_ranks(_compositions, 4, tmp_path_factory.mktemp("sp_gpt"), "gpt", timeout_s=300)


@pytest.fixture(scope="module")
def llama_runs(tmp_path_factory) -> list[dict]:
    pytest.importorskip("transformers")
    return run_ranks(_compositions, 4, tmp_path_factory.mktemp("sp_llama"), "llama", timeout_s=300)


def _errors(result: dict, ref: dict, shard_of) -> list[str]:
    """What differs from the reference: losses of the steps this rank computed, and its weights."""
    bad = []
    for step, loss in enumerate(result["losses"]):
        if loss is not None and not torch.allclose(loss, ref["losses"][step][shard_of], **TOL):
            bad.append(f"loss of step {step}: {float(loss)} vs {float(ref['losses'][step][shard_of])}")
    for name, weight in result["weights"].items():
        if not torch.allclose(weight, ref["weights"][name], **TOL):
            bad.append(f"weight {name}: max error {float((weight - ref['weights'][name]).abs().max()):.3g}")
    return bad


def _check_fsdp(runs: list[dict], key: str, family: str) -> None:
    ref = _reference(family, SHARDS)
    for rank, r in enumerate(runs):
        out = r[key]
        assert _errors(out, ref, rank // 2) == [], (rank, key)  # mesh (sharding, tp): ranks 0-1 read shard 0
        assert out["counted"] == out["written"], (rank, out["counted"], out["written"])  # counted = wire
        kinds = out["kinds"]
        # communication happened: FSDP2 gathered and reduce-scattered, TP's SP regions gathered and scattered
        for kind in ("param_all_gather", "grad_reduce_scatter", "tp_block.all_gather", "tp_block.reduce_scatter"):
            assert kinds.get(kind, (0, 0))[0] > 0, (rank, kind, kinds)
        # FSDP2 reduced the norms' partial sums over tp within its own reduction: nothing left for sync. It did so
        # with one all-reduce per norm parameter per step (beside loss_parallel's 3 in each forward)
        assert out["synced"] == [{}] * STEPS, out["synced"]
        norm_params = sum(1 for name in out["weights"] if name.split(".")[-2] in SP_NORMS)
        assert kinds["tp.all_reduce"][0] == STEPS * (norm_params + LOSS_PARALLEL_ALL_REDUCES), (kinds, norm_params)
        assert all(p.startswith("(") and "Shard(dim=0)" in p for p in out["placements"].values())


@pytest.mark.parametrize("key", ["fsdp", "fsdp_whole"], ids=["per_block_units", "one_unit"])
def test_tp_sp_with_fsdp2_matches_one_process(gpt_runs, key):
    _check_fsdp(gpt_runs, key, "gpt")


def test_negative_control_fsdp2_without_the_partial_sum_reduction_fails(gpt_runs):
    ref = _reference("gpt", SHARDS)
    for rank, r in enumerate(gpt_runs):
        bad = _errors(r["fsdp_no_partial_sum"], ref, rank // 2)
        # the norms' weights are wrong (each tp rank kept its own half-sequence sum), and then everything after them
        assert any(("ln_1" in b or "ln_f" in b) for b in bad), (rank, bad)


def _payload_bytes(sp: bool, hidden: int) -> int:
    """One hand-off: a micro-batch's residual stream, (B/M, T, C) fp32, or its sequence shard (T/tp) under SP."""
    return BATCH // MICRO * TINY["block_size"] // (2 if sp else 1) * hidden * 4


def _check_pipeline(runs: list[dict], key: str, family: str, sp: bool, hidden: int) -> None:
    ref = _reference(family, 1)
    seen = set()
    for rank, r in enumerate(runs):
        out = r[key]
        assert _errors(out, ref, 0) == [], (rank, key)
        assert (out["losses"][0] is not None) == (out["stage"] == 1)  # the loss lives on the last stage
        seen |= set(out["weights"])
        assert out["counted"][1:] == out["written"][1:], (rank, out["counted"], out["written"])  # counted = wire
        assert 0 < out["counted"][0] <= out["written"][0]  # + the stages' metadata, exchanged once, not counted
        # Each step a stage sends M hand-offs (activations forward, or gradients back) and receives M: a send writes
        # the payload and 2 gloo headers of 48 bytes, a receive 1 header.
        calls, nbytes = out["p2p"]
        assert calls == 2 * MICRO * STEPS, out["p2p"]
        assert nbytes == MICRO * STEPS * (_payload_bytes(sp, hidden) + 3 * 48), (out["p2p"], _payload_bytes(sp, hidden))
    assert seen == set(ref["weights"])  # together the stages hold the whole model


def test_tp_sp_with_pipeline_matches_one_process_and_hands_off_half_the_bytes(gpt_runs):
    _check_pipeline(gpt_runs, "pp_sp", "gpt", sp=True, hidden=TINY["n_embd"])
    _check_pipeline(gpt_runs, "pp_plain", "gpt", sp=False, hidden=TINY["n_embd"])
    for r in gpt_runs:
        sp, plain = r["pp_sp"]["p2p"], r["pp_plain"]["p2p"]
        headers = MICRO * STEPS * 3 * 48
        assert sp[0] == plain[0] and 2 * (sp[1] - headers) == plain[1] - headers  # half the bytes per hand-off
        # under SP the norms' partial sums were summed by TensorParallel.sync, once per step, counted
        assert r["pp_sp"]["kinds"]["tp_grad_allreduce"][0] == STEPS
        assert "tp_grad_allreduce" not in r["pp_plain"]["kinds"]
        assert r["pp_sp"]["kinds"]["tp_block.reduce_scatter"][0] > 0 and r["pp_plain"]["kinds"]["tp_block.all_reduce"][0] > 0


def test_negative_control_pipeline_without_the_partial_sum_reduction_fails(gpt_runs):
    ref = _reference("gpt", 1)
    for rank, r in enumerate(gpt_runs):
        bad = _errors(r["pp_sp_no_partial_sum"], ref, 0)
        assert any(".ln_" in b or "ln_f" in b for b in bad), (rank, bad)


def test_hf_llama_tp_sp_with_fsdp2_and_with_pipeline_match_one_process(llama_runs):
    _check_fsdp(llama_runs, "fsdp", "llama")
    hidden = HF_TINY["hidden_size"]
    _check_pipeline(llama_runs, "pp_sp", "llama", sp=True, hidden=hidden)
    _check_pipeline(llama_runs, "pp_plain", "llama", sp=False, hidden=hidden)
    _check_pipeline(llama_runs, "pp_sp_fsdp", "llama", sp=True, hidden=hidden)


def test_negative_control_hf_pipeline_without_sequence_parallel_blocks_fails(tmp_path):
    """A plain sequence shard handed on: the next stage builds rotary positions for seq / tp tokens."""
    pytest.importorskip("transformers")
    with pytest.raises(RankFailure, match="must match the size of tensor b"):
        run_ranks(_pipeline_without_sp_blocks, 4, tmp_path, timeout_s=120, pg_timeout_s=20)
