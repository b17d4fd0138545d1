"""``python train.py data=text ...`` end to end: the user's .jsonl with a local tokenizer trains a GPT with
the same per-step loss on 2 ranks (ddp) as in one process, the token cache lands in the run directory, and
a file without the field stops the run with one paragraph and exit code 2, before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parallelkit.data.chars import load_python_docs
from tests.integration.test_train import max_rel_diff, run_ok, train

EOS = "<|endoftext|>"
ENV = {"HF_HUB_OFFLINE": "1"}  # nothing may be downloaded: the tokenizer is a local directory


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("text_inputs")
    docs = [p.strip() for p in load_python_docs().split("\n\n") if p.strip()][:300]
    (root / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (root / "bad.jsonl").write_text(json.dumps({"text": docs[0]}) + "\n" + json.dumps({"body": docs[1]}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=500, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(str(root / "tok"))
    return {"root": root, "jsonl": root / "a.jsonl", "bad": root / "bad.jsonl", "tok": root / "tok"}


def args(inputs: dict, files: Path) -> list[str]:
    return [
        "model=gpt", "model.n_layer=2", "model.n_embd=32", "model.n_head=2",
        "data=text", f"data.files=[{files}]", f"data.tokenizer={inputs['tok']}", "data.seq_len=16", "data.global_batch_size=8",
        "trainer.max_steps=20", "trainer.val_check_interval=10", "trainer.limit_val_batches=2",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
    ]


def test_ddp_reproduces_single_and_caches_in_the_run_dir(inputs, tmp_path):
    base = args(inputs, inputs["jsonl"])
    single = run_ok([*base, "strategy=single"], tmp_path / "single", env=ENV)
    ddp = run_ok([*base, "strategy=ddp", "trainer.devices=2"], tmp_path / "ddp", env=ENV)
    other_seed = run_ok([*base, "strategy=single", "seed=7"], tmp_path / "seed7", env=ENV)

    assert ddp["world_size"] == 2 and ddp["steps"] == single["steps"] == 20
    assert max_rel_diff(ddp["train_loss"], single["train_loss"]) <= 1e-5
    assert ddp["train_loss"][-1] < ddp["train_loss"][0] - 0.2  # it learned something
    assert max_rel_diff(other_seed["train_loss"], single["train_loss"]) > 1e-3  # negative control
    # One whole cache per run directory, though both ranks built the data; its header names the input.
    for run in ("single", "ddp"):
        data = tmp_path / run / "data"
        names = sorted(p.name for p in data.iterdir())
        assert len(names) == 2 and names[0].endswith(".bin") and names[1].endswith(".json"), names
        meta = json.loads((data / names[1]).read_text())
        assert meta["files"][0]["path"] == str(inputs["jsonl"]) and meta["num_documents"] == 300
        assert meta["tokenizer"]["path"] == str(inputs["tok"]) and meta["dtype"] == "uint16"
        assert (data / names[0]).stat().st_size == meta["num_tokens"] * 2


def test_a_jsonl_line_without_the_field_is_one_clear_error(inputs, tmp_path):
    run_dir = tmp_path / "run"
    proc = train([*args(inputs, inputs["bad"]), "strategy=ddp", "trainer.devices=2", f"hydra.run.dir={run_dir}"],
                 cwd=tmp_path, env=ENV, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    message = proc.stderr.strip()
    assert f"{inputs['bad']}, line 2, has no field 'text'" in message and "data.field=body" in message
    assert "Traceback" not in message and len(message.splitlines()) <= 3, message
    assert not (run_dir / "summary.json").exists() and not (run_dir / "checkpoints").exists()
    leftovers = [p.name for p in (run_dir / "data").iterdir()] if (run_dir / "data").exists() else []
    assert leftovers == [], leftovers
