"""The layouts real large-model runs use, end to end through ``train.py``: tensor × sequence × pipeline parallel in
bf16 on a Hugging Face Llama, untied and with tied input/output embeddings, against one process in the same
precision; tied weights after tp=2 and pp=2 exported as one tensor equal to one process's; ``strategy=auto``
choosing among such layouts.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from test_composition_matrix import half_tolerance
from test_hf_train import LLAMA
from test_train import max_rel_diff, run_ok

BF16 = ["trainer.precision=bf16-mixed"]
TIED = ["+model.overrides.tie_word_embeddings=true"]
HYBRID = ["strategy=hybrid4d", "strategy.dp=1", "strategy.tp=2", "strategy.pp=2", "strategy.sequence_parallel=true",
          "strategy.microbatches=2", "trainer.devices=4"]
STEPS = 12  # LLAMA's trainer.max_steps, 8 sequences of 16 tokens each
BF16_TOL = half_tolerance("bf16", steps=STEPS, tokens=8 * 16)


@pytest.fixture(scope="module")
def singles(tmp_path_factory):
    """``strategy=single`` runs by name (run once when first asked for); each summary gets its ``run_dir``."""
    cache: dict[str, dict] = {}

    def get(name: str, *args: str) -> dict:
        if name not in cache:
            run_dir = tmp_path_factory.mktemp(f"single_{name}") / "run"
            cache[name] = {**run_ok([*LLAMA, *args, "strategy=single"], run_dir), "run_dir": run_dir}
        return cache[name]

    return get


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_tp_sp_pp_in_bf16_matches_single_in_bf16(tied, singles, tmp_path):
    extra = [*BF16, *(TIED if tied else [])]
    single = singles("bf16_tied" if tied else "bf16", *extra)
    run = run_ok([*LLAMA, *extra, *HYBRID], tmp_path / "run")
    assert run["dims"] == {"dp": 1, "sharding": 1, "cp": 1, "tp": 2, "pp": 2, "ep": 1}
    assert max_rel_diff(run["train_loss"], single["train_loss"]) <= BF16_TOL, (run["train_loss"], single["train_loss"])
    assert run["train_loss"][-1] < run["train_loss"][0] - 0.3  # it learned
    kinds = {k for k, v in run["comm"]["by_kind"].items() if v["bytes_per_step"] > 0}
    assert {"pp_p2p", "tp_block.reduce_scatter"} <= kinds, kinds  # the pipeline ran, and SP's collectives
    assert ("tied_embedding_allreduce" in kinds) == tied, kinds
    if tied:
        assert run["num_params"] == single["num_params"]  # the tied weight is counted once, as one process counts it


def _export(ckpt, out) -> dict:
    from safetensors.torch import load_file

    proc = subprocess.run([sys.executable, "-m", "parallelkit.export", str(ckpt), str(out)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(out / "model.safetensors")


@pytest.mark.parametrize("layout", [["strategy=tp", "strategy.tp=2"], ["strategy=pp", "strategy.pp=2", "strategy.microbatches=2"]],
                         ids=["tp2", "pp2"])
def test_tied_weights_after_20_steps_export_as_one_tensor_equal_to_single(layout, singles, tmp_path):
    steps = ["trainer.max_steps=20"]
    single = singles("fp32_tied_20", *TIED, *steps)
    run_ok([*LLAMA, *TIED, *steps, *layout, "trainer.devices=2"], tmp_path / "run")
    ours = _export(tmp_path / "run" / "checkpoints" / "last.ckpt", tmp_path / "ours")
    reference = _export(single["run_dir"] / "checkpoints" / "last.ckpt", tmp_path / "single")
    embedding = "model.embed_tokens.weight"
    assert "lm_head.weight" not in ours and embedding in ours  # one tensor: transformers ties the head to it on load
    torch.testing.assert_close(ours[embedding], reference[embedding], rtol=1e-4, atol=1e-6)  # 20 AdamW steps of fp32 round-off
    # Negative control: the comparison tells another trajectory's weight apart (one process, another seed).
    other = singles("fp32_tied_20_seed9", *TIED, *steps, "seed=9")
    assert not torch.allclose(_export(other["run_dir"] / "checkpoints" / "last.ckpt", tmp_path / "other")[embedding],
                              ours[embedding], rtol=1e-4, atol=1e-6)
