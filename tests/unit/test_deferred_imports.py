"""Importing Lightning through parallelkit does not import transformers; torchmetrics' BERTScore still works.

Each check runs in a fresh interpreter (this one has imported transformers long ago): the hook's effect is
on the first import of Lightning in a process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, cwd: Path | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_lightning_through_parallelkit_leaves_transformers_unimported():
    got = run_python(
        """
        import json, sys
        import parallelkit, lightning.pytorch
        import torchmetrics.functional.text.bert as fbert
        before = "transformers" in sys.modules
        deferred = [type(fbert.AutoModel).__name__, type(fbert.AutoTokenizer).__name__]
        same = fbert.AutoModel.from_pretrained == __import__("transformers").AutoModel.from_pretrained
        print(json.dumps({"before": before, "deferred": deferred, "same": same,
                          "real": hasattr(sys.modules["transformers"], "__version__")}))
        """
    )
    assert got == {"before": False, "deferred": ["DeferredName", "DeferredName"], "same": True, "real": True}


def test_without_parallelkit_lightning_imports_transformers():
    """The negative control: torchmetrics as installed does import transformers, so the test above measures the hook."""
    got = run_python('import json, sys, lightning.pytorch; print(json.dumps("transformers" in sys.modules))')
    assert got is True


def test_hook_steps_aside_when_transformers_is_already_imported():
    got = run_python(
        """
        import json, transformers, parallelkit, lightning.pytorch
        import torchmetrics.functional.text.bert as fbert
        print(json.dumps(fbert.AutoModel is transformers.AutoModel))
        """
    )
    assert got is True


def test_module_needing_more_at_import_runs_again_with_the_real_package(tmp_path):
    (tmp_path / "needs_more.py").write_text("from transformers import AutoModel, __version__\n")
    got = run_python(
        """
        import json, sys
        from parallelkit import deferred_imports
        deferred_imports.DEFERRED_MODULES = frozenset({"needs_more"})
        import needs_more
        print(json.dumps([isinstance(needs_more.AutoModel, type), needs_more.__version__ == sys.modules["transformers"].__version__]))
        """,
        cwd=tmp_path,
    )
    assert got == [True, True]  # transformers' AutoModel class itself, not a DeferredName


BERT_SCORE = """
import json, sys
{first}
from torchmetrics.functional.text import bert_score
imported_early = "transformers" in sys.modules
score = bert_score(["the cat sat on the mat", "a dog ran"], ["the cat sat", "a dog ran far"],
                   model_name_or_path=sys.argv[1] if len(sys.argv) > 1 else {model!r}, num_layers=1,
                   max_length=16, batch_size=2, num_threads=0, verbose=False)
print(json.dumps({{"imported_early": imported_early, "f1": score["f1"].tolist()}}))
"""


@pytest.mark.filterwarnings("ignore")
def test_bert_score_is_the_same_with_the_hook(tmp_path):
    """torchmetrics' BERTScore on a tiny local BERT: with parallelkit imported first (transformers imported on
    first use) it computes what it computes without parallelkit."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizer

    words = "the cat sat on mat a dog ran far".split()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    model_dir = tmp_path / "tiny_bert"
    BertTokenizer(str(tmp_path / "vocab.txt")).save_pretrained(model_dir)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)
    BertModel(config).save_pretrained(model_dir)

    with_hook = run_python(BERT_SCORE.format(first="import parallelkit, lightning.pytorch", model=str(model_dir)))
    without = run_python(BERT_SCORE.format(first="import lightning.pytorch", model=str(model_dir)))
    assert with_hook["imported_early"] is False and without["imported_early"] is True
    assert len(with_hook["f1"]) == 2
    assert with_hook["f1"] == without["f1"]
