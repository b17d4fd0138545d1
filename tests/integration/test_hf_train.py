"""Hugging Face causal LMs (``model=hf``) through ``train.py``: every strategy against one process, export back to
``transformers``, and bad input about them.

A tiny Llama-family config (2 layers, 4 attention heads over 2 key/value heads: grouped-query attention) on the
character corpus (vocabulary 128 after padding); its plans come from its own ``transformers`` config
(``parallelkit/models/hf/parallelize.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from test_train import REL_TOL, max_rel_diff, run_ok, train

LLAMA = ["model=hf", "model.family=llama", "model.num_hidden_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
         "model.num_key_value_heads=2", "model.intermediate_size=64", "data.seq_len=16", "data.global_batch_size=8",
         "trainer.max_steps=12", "trainer.val_check_interval=6", "trainer.limit_val_batches=2",
         "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return run_ok([*LLAMA, "strategy=single"], tmp_path_factory.mktemp("hf_single") / "run")


LAYOUTS = {
    "ddp": ["strategy=ddp", "trainer.devices=2"],
    "zero3": ["strategy=zero", "strategy.stage=3", "trainer.devices=2"],
    "tp2": ["strategy=tp", "strategy.tp=2", "trainer.devices=2"],
    "tp2-sequence-parallel": ["strategy=tp", "strategy.tp=2", "strategy.sequence_parallel=true", "trainer.devices=2"],
    "pp2-1f1b": ["strategy=pp", "strategy.pp=2", "strategy.schedule=1f1b", "strategy.microbatches=2", "trainer.devices=2"],
    "tp2xdp2": ["strategy=tp", "strategy.tp=2", "trainer.devices=4"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hf_llama_trains_like_one_process(single, layout, tmp_path):
    mine = run_ok([*LLAMA, *LAYOUTS[layout]], tmp_path / "run")
    assert mine["num_params"] == single["num_params"]
    assert max_rel_diff(mine["train_loss"], single["train_loss"]) <= REL_TOL
    assert mine["train_loss"][-1] < mine["train_loss"][0] - 0.3  # it learned
    assert mine["comm"]["bytes_sent_per_step"] > 0
    kinds = mine["comm"]["by_kind"]
    if layout.startswith("tp2"):  # the config's plan split the decoder layers: their collectives counted there
        if layout.endswith("sequence-parallel"):  # each all-reduce became a reduce-scatter and an all-gather
            assert kinds["tp_block.reduce_scatter"]["bytes_per_step"] > 0 and "tp_block.all_reduce" not in kinds
        else:
            assert kinds["tp_block.all_reduce"]["bytes_per_step"] > 0
        assert mine["model_state_bytes"]["params"] < single["model_state_bytes"]["params"]
    if layout == "zero3":  # one sharding unit per decoder layer: each rank holds half the parameters
        assert mine["model_state_bytes"]["params"] * 2 == pytest.approx(single["model_state_bytes"]["params"], rel=0.02)
    if layout.startswith("pp2"):
        assert mine["pipeline"]["stage_blocks"] == [[0, 1], [1, 2]]


def test_negative_control_other_seed(single, tmp_path):
    other = run_ok([*LLAMA, *LAYOUTS["tp2"], "seed=9"], tmp_path / "run")
    assert max_rel_diff(other["train_loss"], single["train_loss"]) > 1e-3


@pytest.mark.slow
def test_hf_llama_under_hybrid4d_on_8_ranks(single, tmp_path):
    """tp=2 × pp=2 × dp=2 on one mesh: the single-process trajectory (1e-4 for 8 ranks, as the issue bounds it)."""
    mine = run_ok([*LLAMA, "strategy=hybrid4d", "strategy.tp=2", "strategy.pp=2", "strategy.microbatches=2",
                   "trainer.devices=8"], tmp_path / "run")
    assert mine["dims"] == {"dp": 2, "sharding": 1, "cp": 1, "tp": 2, "pp": 2, "ep": 1}
    assert max_rel_diff(mine["train_loss"], single["train_loss"]) <= 1e-4


FAMILY = {
    "qwen2": [a.replace("family=llama", "family=qwen2") for a in LLAMA],
    "gpt2": [a.replace("family=llama", "family=gpt2") for a in LLAMA if "key_value" not in a],
    "mixtral": [a.replace("family=llama", "family=mixtral") for a in LLAMA] + ["model.num_local_experts=4", "model.num_experts_per_tok=2"],
}


EXPERT_LAYOUTS = {
    "ep2": ["strategy=moe", "strategy.ep=2", "trainer.devices=2"],
    "ep2xdp2": ["strategy=moe", "strategy.ep=2", "trainer.devices=4"],
    "hybrid-pp2xep2": ["strategy=hybrid4d", "strategy.tp=1", "strategy.pp=2", "strategy.ep=2", "strategy.microbatches=2", "trainer.devices=4"],
    "hybrid-tp2xep2": ["strategy=hybrid4d", "strategy.tp=2", "strategy.pp=1", "strategy.ep=2", "trainer.devices=4"],
}


@pytest.mark.parametrize(
    "family,layout",
    [
        ("qwen2", "tp2"),
        ("qwen2", "tp2-sequence-parallel"),
        ("gpt2", "pp2-1f1b"),
        ("mixtral", "zero3"),
        ("mixtral", "pp2-1f1b"),
        ("mixtral", "tp2"),
        ("mixtral", "ep2"),
        ("mixtral", "ep2xdp2"),
        ("mixtral", "hybrid-pp2xep2"),
        ("mixtral", "hybrid-tp2xep2"),
    ],
)
def test_other_families_train_like_one_process(family, layout, tmp_path):
    one = run_ok([*FAMILY[family], "strategy=single"], tmp_path / "single")
    proc = train([*FAMILY[family], *{**LAYOUTS, **EXPERT_LAYOUTS}[layout], f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mine = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert max_rel_diff(mine["train_loss"], one["train_loss"]) <= REL_TOL
    # Tensor parallelism without ep keeps Mixtral's experts whole on every tp rank: said once, and only then.
    said = (proc.stdout + proc.stderr).count("whole on every tensor-parallel rank")
    assert said == (1 if (family, layout) == ("mixtral", "tp2") else 0), proc.stderr[-3000:]
    if layout in EXPERT_LAYOUTS:  # each rank holds half of the 4 experts; their tokens travelled by all-to-all
        assert mine["expert_parallel"]["ep"] == 2 and len(mine["expert_parallel"]["local_experts"]) == 2
        assert mine["comm"]["by_kind"]["moe_all_to_all"]["bytes_per_step"] > 0


# ------------------------------------------------------------------------------------ export
CHECK_EXPORT = textwrap.dedent('''
    import json, sys
    import torch
    try:
        import parallelkit  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("parallelkit is importable here: the check would not show that transformers alone loads it")
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], local_files_only=True).eval()
    ids = torch.tensor(json.loads(sys.argv[2]))
    with torch.no_grad():
        torch.save(model(input_ids=ids).logits, sys.argv[3])
''')


def test_export_after_tp_loads_in_transformers_with_equal_logits(tmp_path):
    """Train at tp=2 (a sharded checkpoint), export, load with transformers alone: the logits of parallelkit's
    single-device model on the same checkpoint, within fp32 round-off."""
    import torch

    run_dir = tmp_path / "run"
    run_ok([*LLAMA, *LAYOUTS["tp2"]], run_dir)
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    out = tmp_path / "exported"
    exported = subprocess.run([sys.executable, "-m", "parallelkit.export", str(ckpt), str(out)], capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()

    ids = [[3, 17, 42, 5, 99, 7, 1, 64], [10, 11, 12, 13, 14, 15, 16, 17]]
    # transformers alone: no site-packages .pth (the editable parallelkit), the packages' directory on the path
    import transformers

    site = str(Path(transformers.__file__).resolve().parents[1])
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": site, "HF_HUB_OFFLINE": "1"}
    theirs = subprocess.run([sys.executable, "-S", "-c", CHECK_EXPORT, str(out), json.dumps(ids), str(tmp_path / "theirs.pt")],
                            capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert theirs.returncode == 0, theirs.stderr[-3000:]

    from omegaconf import OmegaConf

    from parallelkit.models.hf import HFCausalLM
    from parallelkit.models.module import TrainModule
    from parallelkit.tools.predict import load_weights

    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    kwargs = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "_target_"}
    model = HFCausalLM(vocab_size=128, block_size=16, **kwargs)
    load_weights(TrainModule(model, None), ckpt)
    with torch.no_grad():
        ours = model.eval()(torch.tensor(ids))
    torch.testing.assert_close(torch.load(tmp_path / "theirs.pt"), ours, rtol=1e-6, atol=1e-6)
    # Negative control: a freshly initialised model gives other logits (the comparison is not vacuous).
    fresh = HFCausalLM(vocab_size=128, block_size=16, **kwargs).eval()
    with torch.no_grad():
        assert not torch.allclose(fresh(torch.tensor(ids)), ours, atol=1e-3)
    # Nothing is overwritten: exporting into the same directory again is refused.
    again = subprocess.run([sys.executable, "-m", "parallelkit.export", str(ckpt), str(out)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "already holds files" in again.stderr


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("case", ["kv-heads", "heads", "sequence-parallel", "gpt2-tp", "vocab", "two-sources", "llama-ep"])
def test_bad_input_about_a_hf_model(case, tmp_path):
    small_config = tmp_path / "small"
    small_config.mkdir()
    (small_config / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 2,
                                                          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64,
                                                          "max_position_embeddings": 64}))
    args, words = {
        "kv-heads": (["model.num_key_value_heads=1", *LAYOUTS["tp2"]], ["strategy.tp=2 does not divide", "model.num_key_value_heads=1",
                                                                       "grouped-query attention"]),
        "heads": (["model.num_attention_heads=2", "model.num_key_value_heads=1", "strategy=tp", "strategy.tp=4", "trainer.devices=4"],
                  ["strategy.tp=4 does not divide", "model.num_attention_heads=2"]),
        "sequence-parallel": (["model.family=mixtral", *LAYOUTS["tp2"], "strategy.sequence_parallel=true"],
                              ["strategy.sequence_parallel=true with model=hf (mixtral)", "routes the whole residual stream"]),
        "gpt2-tp": (["model.family=gpt2", "model.num_key_value_heads=null", *LAYOUTS["tp2"], "strategy.sequence_parallel=true"],
                    ["strategy.sequence_parallel=true with model=hf (gpt2)", "learned positions"]),
        "vocab": (["model.family=null", f"model.config={small_config}", "model.hidden_size=null", "model.num_hidden_layers=null",
                   "model.num_attention_heads=null", "model.num_key_value_heads=null", "model.intermediate_size=null"],
                  ["has a vocabulary of 50 tokens", "up to 127"]),
        "two-sources": ([f"model.config={small_config}"], ["model.config and model.family are both set"]),
        "llama-ep": (["strategy=moe", "strategy.ep=2", "trainer.devices=2"], ["model=hf (llama) has no Mixture-of-Experts layers"]),
    }[case]
    run_dir = tmp_path / "run"
    proc = train([*LLAMA, *args, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert len([line for line in proc.stderr.splitlines() if line.startswith("parallelkit: error:")]) == 1, proc.stderr[-3000:]
    for word in words:
        assert word in proc.stderr, f"{word!r} missing from:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "summary.json").exists() and not (run_dir / "checkpoints").exists()


# ------------------------------------------------------------------------------------ with the user's tokenized text
from test_text_data_train import inputs  # noqa: E402,F401 - the fixture: a .jsonl and a local BPE tokenizer


def test_hf_llama_on_tokenized_text_under_tp_and_export_carries_the_tokenizer(inputs, tmp_path):  # noqa: F811
    """The README's use: a Llama-family model on the user's .jsonl with their tokenizer, tensor parallel like one
    process; the export holds the tokenizer too, and transformers encodes with it as the run did."""
    text = ["data=text", f"data.files=[{inputs['jsonl']}]", f"data.tokenizer={inputs['tok']}"]
    env = {"HF_HUB_OFFLINE": "1"}
    one = run_ok([*LLAMA, *text, "strategy=single"], tmp_path / "single", env=env)
    mine = run_ok([*LLAMA, *text, *LAYOUTS["tp2"]], tmp_path / "tp", env=env)
    assert max_rel_diff(mine["train_loss"], one["train_loss"]) <= REL_TOL
    out = tmp_path / "exported"
    done = subprocess.run([sys.executable, "-m", "parallelkit.export", str(tmp_path / "tp" / "checkpoints" / "last.ckpt"), str(out)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    from transformers import AutoTokenizer

    theirs, ours = AutoTokenizer.from_pretrained(str(out), local_files_only=True), AutoTokenizer.from_pretrained(str(inputs["tok"]), local_files_only=True)
    sample = "def parallel(model):\n    return model"
    assert theirs(sample)["input_ids"] == ours(sample)["input_ids"] and theirs.eos_token == ours.eos_token
