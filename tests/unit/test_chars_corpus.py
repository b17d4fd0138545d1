"""The default corpus is the packaged snapshot, the same on every Python build (it used to be the running
Python's ``pydoc_data``: Debian's 3.11.2 and pyenv's 3.11.7 gave different text, hence different losses)."""

from __future__ import annotations

import gzip
import hashlib
import sys
import types

import pytest

from parallelkit.data import chars
from parallelkit.data.chars import PYTHON_DOCS_SHA256, CharsDataModule, load_python_docs
from parallelkit.errors import ConfigError


def test_the_corpus_does_not_come_from_the_running_python(monkeypatch):
    """Another Python's pydoc topics (here: a stand-in module) change nothing: the snapshot is read."""
    before = load_python_docs()
    fake = types.ModuleType("pydoc_data.topics")
    fake.topics = {"a": "some other build's documentation"}
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", fake)
    after = load_python_docs()
    assert after == before
    assert hashlib.sha256(after.encode()).hexdigest() == PYTHON_DOCS_SHA256
    # Negative control: the old loader (the running Python's topics) sees the stand-in.
    topics = sys.modules["pydoc_data.topics"].topics
    assert "\n\n".join(topics[k] for k in sorted(topics)) != after


def test_the_snapshot_is_python_documentation_of_the_stated_size():
    text = load_python_docs()
    assert len(text) == 465_126  # CPython 3.11.7's topics joined in sorted key order, as README's figures used
    assert "The \"for\" statement" in text and "def " in text


def test_a_damaged_snapshot_is_refused_with_what_to_do(monkeypatch, tmp_path):
    """A corpus whose bytes changed (a broken install, a replaced file) is an error, not silently new losses."""
    (tmp_path / "corpora").mkdir()
    original = gzip.decompress((chars.resources.files("parallelkit.data") / "corpora" / chars.PYTHON_DOCS_SNAPSHOT).read_bytes())
    (tmp_path / "corpora" / chars.PYTHON_DOCS_SNAPSHOT).write_bytes(gzip.compress(original[:-1] + b"!"))
    monkeypatch.setattr(chars.resources, "files", lambda package: tmp_path)
    with pytest.raises(ConfigError, match="not the one parallelkit shipped.*data.source=files"):
        load_python_docs()
    # Control: the same path holding the intact text loads.
    (tmp_path / "corpora" / chars.PYTHON_DOCS_SNAPSHOT).write_bytes(gzip.compress(original))
    assert load_python_docs() == original.decode()


def test_the_default_data_module_trains_on_the_snapshot():
    dm = CharsDataModule(seq_len=64, global_batch_size=8)
    dm.configure(data_parallel_size=1, accumulate=1)
    text = load_python_docs()
    head = "".join(dm.decode(dm.train_set.tokens[:200].tolist()))
    assert text.startswith(head) and len(head) == 200
