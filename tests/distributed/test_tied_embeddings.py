"""Tied input/output embeddings under tensor and pipeline parallelism, and GPT-2's tensor-parallel plan, on real gloo
ranks against one process computed in the same test (fp32).

- **tp=2** (one launch): a GPT with ``tie_embeddings=True`` split by its plan: the embedding and the output layer hold
  one DTensor parameter (``is``), and the loss, the tied weight's gradient (both uses summed) and the weight after
  an SGD step equal one process's. Negative control: the same plan without the tie wrappers gives the two modules
  separate parameters, whose gradients miss each other's half. A Hugging Face llama with
  ``tie_word_embeddings=true`` (logits, loss, every gradient), and GPT-2 untied and tied: its fused ``c_attn``
  split by heads (logits, every gradient, the stepped weights, a ``torch.distributed.checkpoint`` written at tp=2
  that holds ``transformers``' column order and loads back). Negative control: q|k|v split in contiguous blocks
  instead of by heads gives other logits.
- **pipeline** (one launch, 4 ranks): a tied GPT cut by its plan, each data-parallel replica of the pipeline on its
  own rows, 3 SGD steps: pp=2 × dp=2 with 1F1B (the two ends on two ranks: the embedding group is the pipeline
  group), the V-shaped ``zbv`` schedule (both ends on one rank: summed locally, nothing sent) and pp=4 (a group
  of ranks 0 and 3 only). Losses, every parameter, both copies of the tied weight equal one process's, and the
  tied all-reduce's bytes are counted (one all-reduce of the weight per step where the ends are on two ranks, none
  elsewhere). And pp=2 × tp=2 as hybrid4d composes it: one sharded tied parameter, cut, its two ends' vocabulary
  shards summed. Negative control: without the sync the copies drift from one process.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from .harness import run_ranks

VOCAB, SEQ, EMBD, BATCH, STEPS, LR = 32, 8, 16, 8, 3, 0.5
TOL = dict(rtol=1e-5, atol=1e-6)


def _gpt(n_layer: int = 2, tie: bool = True):
    from parallelkit.models.gpt import GPT

    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=SEQ, n_layer=n_layer, n_head=2, n_embd=EMBD, tie_embeddings=tie)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# ============================================================================ tensor parallel, 2 ranks
def _tp_step(model, tp, x, y, lr=LR):
    """One step as the strategies run it: forward, loss and backward in the TP context, TP's gradient sync, SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with tp.context():
        logits = model(x)
        loss = model.loss(logits, y)
        loss.backward()
    tp.sync()
    grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
    with tp.context():
        opt.step()
    return _full(logits).detach(), _full(loss).detach(), grads


def _single_step(model, x, y, lr=LR):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    logits = model(x)
    loss = model.loss(logits, y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return logits.detach(), loss.detach(), grads


def _gpt_tp(mesh, world) -> dict:
    from parallelkit.distributed.comm_stats import CommStats
    from parallelkit.distributed.tensor_parallel import apply_tp
    from parallelkit.models.gpt.parallelize import tensor_parallel_plan

    x, y = _batch(0)
    out = {}
    for variant in ("tied", "untied_by_plan"):
        reference = _gpt()
        model = copy.deepcopy(reference)
        plan = tensor_parallel_plan(model, world)
        if variant == "untied_by_plan":  # negative control: the plain styles, each module gets its own new parameter
            plan.layout["tok_emb"], plan.layout["lm_head"] = plan.layout["tok_emb"].style, plan.layout["lm_head"].style
        stats = CommStats()
        tp = apply_tp(model, mesh, plan, comm_stats=stats)
        one = model.lm_head.weight is model.tok_emb.weight
        _, loss, grads = _tp_step(model, tp, x, y)
        _, ref_loss, ref_grads = _single_step(reference, x, y)
        out[variant] = {
            "one_parameter": one and isinstance(model.tok_emb.weight, torch.distributed.tensor.DTensor),
            "placements": str(model.tok_emb.weight.placements),
            "loss": loss, "ref_loss": ref_loss,
            "grad": grads["tok_emb.weight"], "ref_grad": ref_grads["tok_emb.weight"],
            "grads": grads, "ref_grads": ref_grads,
            "weight": _full(model.tok_emb.weight).detach(), "head": _full(model.lm_head.weight).detach(),
            "ref_weight": reference.tok_emb.weight.detach(),
            "counted": stats.bytes(),
        }
    return out


def _hf(family: str, tie: bool):
    from parallelkit.models.hf import HFCausalLM

    torch.manual_seed(0)
    return HFCausalLM(vocab_size=VOCAB, block_size=SEQ, family=family, hidden_size=EMBD, num_hidden_layers=2, num_attention_heads=4,
                      **({} if family == "gpt2" else {"num_key_value_heads": 2, "intermediate_size": 32}),
                      overrides={"tie_word_embeddings": tie})


def _hf_tp(mesh, world, family: str, tie: bool, checkpoint: str | None, naive_qkv: bool = False) -> dict:
    from parallelkit.distributed.tensor_parallel import apply_tp
    from parallelkit.models.hf.gpt2_tensor_parallel import Conv1DColwise, head_grouped_order
    from parallelkit.models.hf.parallelize import tensor_parallel_plan

    x, y = _batch(1)
    reference = _hf(family, tie)
    model = copy.deepcopy(reference)
    plan = tensor_parallel_plan(model, world)
    if naive_qkv:  # negative control: c_attn's columns split in contiguous blocks, not by heads
        plan.layout["hf.transformer.h.*.attn.c_attn"] = Conv1DColwise()
        tp = apply_tp(model, mesh, plan)
        with torch.no_grad(), tp.context():
            return {"logits": _full(model(x)), "ref_logits": reference(x).detach()}
    tp = apply_tp(model, mesh, plan)
    embed, head = model.hf.get_input_embeddings(), model.hf.get_output_embeddings()
    logits, loss, grads = _tp_step(model, tp, x, y)
    ref_logits, ref_loss, ref_grads = _single_step(reference, x, y)
    if family == "gpt2":  # c_attn's parameter and gradient are held in the head-grouped column order
        order = head_grouped_order(3 * EMBD, 3, 4)
        ref_grads = {n: g.index_select(g.dim() - 1, order) if ".attn.c_attn." in n else g for n, g in ref_grads.items()}
    state = {k: _full(v).clone() for k, v in model.state_dict().items()}  # checkpoints: transformers' order
    out = {"tied": embed.weight is head.weight, "logits": logits, "ref_logits": ref_logits, "loss": loss, "ref_loss": ref_loss,
           "grads": grads, "ref_grads": ref_grads, "state": state, "ref_state": dict(reference.state_dict())}
    if checkpoint:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=checkpoint)
        fresh = copy.deepcopy(reference)
        with torch.no_grad():
            for p in fresh.parameters():
                p.normal_()
        fresh_tp = apply_tp(fresh, mesh, tensor_parallel_plan(fresh, world))
        loaded = {"model": get_model_state_dict(fresh)}
        dcp.load(loaded, checkpoint_id=checkpoint)
        set_model_state_dict(fresh, loaded["model"])
        with torch.no_grad():
            with fresh_tp.context():
                out["reloaded_logits"] = _full(fresh(x))
            with tp.context():
                out["saved_logits"] = _full(model(x))
    return out


def _tensor_parallel(rank: int, world: int, checkpoint: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    return {"gpt": _gpt_tp(mesh, world), "llama_tied": _hf_tp(mesh, world, "llama", True, None),
            "gpt2": _hf_tp(mesh, world, "gpt2", False, checkpoint), "gpt2_tied": _hf_tp(mesh, world, "gpt2", True, None),
            "gpt2_naive_qkv": _hf_tp(mesh, world, "gpt2", False, None, naive_qkv=True)}


@pytest.fixture(scope="module")
def tp2(tmp_path_factory) -> tuple[list[dict], str]:
    path = tmp_path_factory.mktemp("tp2")
    checkpoint = str(path / "gpt2_tp2_checkpoint")
    return run_ranks(_tensor_parallel, 2, path, checkpoint, timeout_s=240), checkpoint


def test_tied_gpt_under_tp_is_one_sharded_parameter_and_matches_one_process(tp2):
    results, _ = tp2
    for r in results:
        out = r["gpt"]["tied"]
        assert out["one_parameter"] and out["placements"] == "(Shard(dim=0),)"  # sharded once, over the vocabulary
        assert "lm_head.weight" not in out["grads"]  # one parameter, listed once
        assert_close(out["loss"], out["ref_loss"], **TOL)
        assert_close(out["grad"], out["ref_grad"], **TOL)  # the lookups' and the logits' contributions, summed
        for name, grad in out["ref_grads"].items():
            assert_close(out["grads"][name], grad, **TOL, msg=name)
        stepped = out["ref_weight"]
        assert_close(out["weight"], stepped, **TOL)
        assert_close(out["head"], out["weight"], rtol=0, atol=0)  # one parameter: the head is the embedding
        assert out["counted"] > 0  # the vocabulary-parallel ends and the blocks communicated


def test_negative_control_plan_without_the_tie_splits_the_weight_in_two(tp2):
    results, _ = tp2
    for r in results:
        out = r["gpt"]["untied_by_plan"]
        assert not out["one_parameter"]
        assert_close(out["loss"], out["ref_loss"], **TOL)  # the forward is still right...
        with pytest.raises(AssertionError):  # ...but each copy gets only its own use's gradient
            assert_close(out["grad"], out["ref_grad"], **TOL)
        assert not torch.allclose(out["weight"], out["head"])


@pytest.mark.parametrize("case", ["llama_tied", "gpt2", "gpt2_tied"])
def test_hf_models_under_tp_match_one_process(tp2, case):
    results, _ = tp2
    for r in results:
        out = r[case]
        assert out["tied"] == case.endswith("_tied")
        assert_close(out["logits"], out["ref_logits"], **TOL)
        assert_close(out["loss"], out["ref_loss"], **TOL)
        assert set(out["grads"]) == set(out["ref_grads"])
        for name, grad in out["ref_grads"].items():
            assert_close(out["grads"][name], grad, **TOL, msg=name)
        assert set(out["state"]) == set(out["ref_state"])  # after the step, in transformers' layout
        for name, value in out["ref_state"].items():
            assert_close(out["state"][name], value, **TOL, msg=name)


def test_negative_control_gpt2_qkv_split_in_blocks_is_caught(tp2):
    """Splitting the fused q|k|v columns in contiguous blocks (rank 0: all of q and half of k) computes garbage."""
    results, _ = tp2
    for r in results:
        out = r["gpt2_naive_qkv"]
        assert not torch.allclose(out["logits"], out["ref_logits"], **TOL)


def test_gpt2_tp_checkpoint_holds_transformers_order_and_loads_back(tp2):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    results, checkpoint = tp2
    whole = Path(checkpoint + ".pt")
    dcp_to_torch_save(checkpoint, whole)
    saved = torch.load(whole, weights_only=False)["model"]
    reference = results[0]["gpt2"]["ref_state"]  # one process after the same step
    assert set(saved) == set(reference)
    for name, value in reference.items():
        assert_close(saved[name], value, **TOL, msg=name)
    for r in results:
        assert_close(r["gpt2"]["reloaded_logits"], r["gpt2"]["saved_logits"], rtol=0, atol=0)


# ============================================================================ pipeline parallel, 4 ranks
# (name, pp, schedule, virtual stages, microbatches, sync)
PIPELINES = [("1f1b", 2, "1f1b", 1, 2, True), ("1f1b_without_sync", 2, "1f1b", 1, 2, False), ("zbv", 2, "zbv", 2, 4, True),
             ("pp4", 4, "gpipe", 1, 2, True)]
N_LAYER = 4


def _pipeline(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from parallelkit.distributed.comm_stats import CommStats
    from parallelkit.distributed.grad_sync import apply_grad_allreduce
    from parallelkit.distributed.pipeline_parallel import apply_pp, stage_blocks, stage_ids_for_rank
    from parallelkit.distributed.tied_weights import TIED_EMBEDDING_ALLREDUCE, apply_tied_embedding_sync
    from parallelkit.models.gpt import GPT
    from parallelkit.models.gpt.parallelize import pipeline_stages

    results = {}
    meshes = {}
    for name, pp, schedule, virtual, microbatches, sync in PIPELINES:
        dp = world // pp
        if pp not in meshes:
            meshes[pp] = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
        mesh = meshes[pp]
        pp_rank, dp_rank = divmod(rank, dp)
        rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)  # each replica of the pipeline its own rows
        model = _gpt(N_LAYER)
        num_stages = pp * virtual
        ids = stage_ids_for_rank(pp_rank, pp, virtual, schedule)
        stages = pipeline_stages(model, stage_blocks(N_LAYER, num_stages), ids)
        stats = CommStats()
        pipe = apply_pp(stages, ids, num_stages, mesh.get_group("pp"), microbatches=microbatches, schedule=schedule,
                        loss_fn=GPT.loss, device=torch.device("cpu"), comm_stats=stats)
        syncs = [apply_tied_embedding_sync(stages, ids, num_stages, mesh.get_group("pp"), comm_stats=stats)] if sync else []
        syncs.append(apply_grad_allreduce(model.parameters(), mesh.get_group("dp"), comm_stats=stats))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses, first_grads = [], None
        for step in range(STEPS):
            x, y = _batch(step)
            opt.zero_grad()
            losses.append(pipe.train_step(x[rows], y[rows]))
            for s in syncs:  # the tied sum, then the data-parallel average (the composition's order)
                s.sync()
            if first_grads is None:
                first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            opt.step()
        results[name] = {
            "stage_ids": ids, "num_stages": num_stages, "dp_rank": dp_rank, "dp": dp, "losses": losses, "grads": first_grads,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "state_keys": sorted(model.state_dict()),
            "tied_bytes": stats.bytes(TIED_EMBEDDING_ALLREDUCE),
            "duplicates": len(syncs[0].duplicates) if sync else None,
        }
    results["tp2_pp2"] = _tp_pipeline(rank)
    return results


def _tp_pipeline(rank: int) -> dict:
    """pp=2 × tp=2 as hybrid4d composes it: TP on the whole model (one sharded tied parameter), the cut, the schedule in
    the TP context; after backward TP's sync, then the tied sum of the two ends' vocabulary shards."""
    from torch.distributed.device_mesh import init_device_mesh

    from parallelkit.distributed.comm_stats import CommStats
    from parallelkit.distributed.pipeline_parallel import apply_pp, stage_blocks, stage_ids_for_rank
    from parallelkit.distributed.tensor_parallel import apply_tp
    from parallelkit.distributed.tied_weights import TIED_EMBEDDING_ALLREDUCE, apply_tied_embedding_sync
    from parallelkit.models.gpt import GPT
    from parallelkit.models.gpt.parallelize import pipeline_stages, tensor_parallel_plan

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    model = _gpt(N_LAYER)
    stats = CommStats()
    tp = apply_tp(model, mesh["tp"], tensor_parallel_plan(model, 2), comm_stats=stats)
    ids = stage_ids_for_rank(rank // 2, 2, 1, "1f1b")
    stages = pipeline_stages(model, stage_blocks(N_LAYER, 2), ids)
    pipe = apply_pp(stages, ids, 2, mesh.get_group("pp"), microbatches=2, schedule="1f1b", loss_fn=GPT.loss,
                    device=torch.device("cpu"), comm_stats=stats)
    syncs = [tp, apply_tied_embedding_sync(stages, ids, 2, mesh.get_group("pp"), comm_stats=stats)]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        with tp.context():
            loss = pipe.train_step(x, y)
        for s in syncs:
            s.sync()
        with tp.context():
            opt.step()
        losses.append(None if loss is None else _full(loss))
    return {"stage_ids": ids, "num_stages": 2, "losses": losses, "params": {n: _full(p).detach().clone() for n, p in model.named_parameters()},
            "tied_bytes": stats.bytes(TIED_EMBEDDING_ALLREDUCE)}


def _pipeline_reference(dp: int) -> dict:
    from parallelkit.models.gpt import GPT

    model = _gpt(N_LAYER)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    per = BATCH // dp
    shard_losses, first_grads = [], None
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        logits = model(x)
        GPT.loss(logits, y).backward()
        with torch.no_grad():
            shard_losses.append([GPT.loss(logits[d * per:(d + 1) * per], y[d * per:(d + 1) * per]) for d in range(dp)])
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    return {"losses": shard_losses, "grads": first_grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _reference_name(name: str) -> str:
    return "tok_emb.weight" if name == "lm_head.weight" else name  # the last stage's copy of the tied weight


@pytest.fixture(scope="module")
def pipelines(tmp_path_factory) -> list[dict]:
    return run_ranks(_pipeline, 4, tmp_path_factory.mktemp("pp"), timeout_s=300)


@pytest.mark.parametrize("name", ["1f1b", "zbv", "pp4"])
def test_tied_gpt_under_pp_matches_one_process(pipelines, name):
    ref = _pipeline_reference(pipelines[0][name]["dp"])
    seen = set()
    copies = 0
    for rank, r in enumerate(pipelines):
        out = r[name]
        last = out["num_stages"] - 1
        if last in out["stage_ids"]:
            for step, loss in enumerate(out["losses"]):
                assert_close(loss, ref["losses"][step][out["dp_rank"]], **TOL)
        for param, value in out["params"].items():
            ref_name = _reference_name(param)
            assert_close(out["grads"][param], ref["grads"][ref_name], rtol=1e-4, atol=1e-6, msg=f"{name} rank {rank}: grad of {param}")
            assert_close(value, ref["params"][ref_name], **TOL, msg=f"{name} rank {rank}: {param}")
            seen.add(ref_name)
            copies += param in ("tok_emb.weight", "lm_head.weight")
        # Checkpoint names: the first stage's copy is tok_emb.weight, the last's lm_head.weight.
        assert ("tok_emb.weight" in out["state_keys"]) == (0 in out["stage_ids"])
        assert ("lm_head.weight" in out["state_keys"]) == (last in out["stage_ids"])
        holds_an_end = 0 in out["stage_ids"] or last in out["stage_ids"]
        sends = holds_an_end and not (0 in out["stage_ids"] and last in out["stage_ids"])
        # counted where sent, nothing else: one all-reduce of the weight per step (gloo: 12 headers of 48 bytes)
        assert out["tied_bytes"] == ((VOCAB * EMBD * 4 + 12 * 48) * STEPS if sends else 0), (name, rank, out["tied_bytes"])
        assert out["duplicates"] == int(last in out["stage_ids"])
    assert seen == set(ref["params"])
    assert copies == 2 * pipelines[0][name]["dp"]  # each replica of the pipeline: one copy per end


def test_tied_gpt_under_tp_and_pp_matches_one_process(pipelines):
    ref = _pipeline_reference(1)
    for r in pipelines:
        out = r["tp2_pp2"]
        if 1 in out["stage_ids"]:
            for step, loss in enumerate(out["losses"]):
                assert_close(loss, ref["losses"][step][0], **TOL)
        for param, value in out["params"].items():
            assert_close(value, ref["params"][_reference_name(param)], **TOL, msg=param)
        # One all-reduce per step of this rank's vocabulary shard of the tied weight (gloo: 12 headers of 48 bytes).
        assert out["tied_bytes"] == (VOCAB // 2 * EMBD * 4 + 12 * 48) * STEPS


def test_negative_control_without_the_sync_the_copies_drift(pipelines):
    ref = _pipeline_reference(2)["params"]["tok_emb.weight"]
    for r in pipelines:
        out = r["1f1b_without_sync"]
        for param in ("tok_emb.weight", "lm_head.weight"):
            if param in out["params"]:
                assert not torch.allclose(out["params"][param], ref, **TOL), param
        assert out["tied_bytes"] == 0

