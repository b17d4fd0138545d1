"""Character-level language modelling on real text that ships with parallelkit.

The default corpus is the Python documentation's topic pages (``pydoc_data.topics`` of CPython 3.11.7, about
465,000 characters of English prose and code examples, PSF license), kept in the package as
``corpora/python_docs_3.11.7.txt.gz``: no download, and the same text on every machine whatever Python runs it.
It used to be read from the running Python's own ``pydoc_data``, which differs between builds (Debian's 3.11.2
has 1,049 more characters than 3.11.7), so losses and the README's figures depended on the installation.
Any UTF-8 text files can be used instead (``data.files=[a.txt,b.txt]``).
"""

from __future__ import annotations

import gzip
import hashlib
from importlib import resources
from pathlib import Path

import torch
from torch.utils.data import Dataset
from typing_extensions import override

from parallelkit.data.base import DataParallelDataModule
from parallelkit.errors import ConfigError

PYTHON_DOCS = "python_docs"
PYTHON_DOCS_SNAPSHOT = "python_docs_3.11.7.txt.gz"
# The text's sha256, checked on every load: a damaged or replaced file must not silently change every loss.
PYTHON_DOCS_SHA256 = "71f2ff5d99bdc1f9c48c5c2353ad138201c5ca1c377e0226857ef8fa89b8bcee"


def load_python_docs() -> str:
    """The default corpus: CPython 3.11.7's pydoc topic texts joined in sorted key order, from the package."""
    path = resources.files("parallelkit.data").joinpath("corpora", PYTHON_DOCS_SNAPSHOT)
    text = gzip.decompress(path.read_bytes())
    if hashlib.sha256(text).hexdigest() != PYTHON_DOCS_SHA256:
        raise ConfigError(
            f"the packaged corpus {path} is not the one parallelkit shipped (sha256 {hashlib.sha256(text).hexdigest()}, "
            f"expected {PYTHON_DOCS_SHA256}). Reinstall parallelkit, or train on your own text with data.source=files data.files=[...]."
        )
    return text.decode("utf-8")


def load_files(files: list[str]) -> str:
    texts = []
    for name in files:
        path = Path(name).expanduser()
        if not path.is_file():
            raise ConfigError(f"data.files: {str(path)!r} does not exist or is not a file. Give paths to UTF-8 text files.")
        texts.append(path.read_text(encoding="utf-8", errors="replace"))
    return "\n\n".join(texts)


class CharDataset(Dataset):
    """Windows of ``seq_len + 1`` token ids; the target is the input shifted by one."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, stride: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.starts = range(0, len(tokens) - seq_len - 1 + 1, stride)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.starts[index]
        window = self.tokens[start : start + self.seq_len + 1]
        return window[:-1], window[1:]


class CharsDataModule(DataParallelDataModule):
    """A character-level corpus split into a training head and a validation tail.

    Args:
        source: ``python_docs`` (the default corpus) or ``files``.
        files: text files to read when ``source=files``.
        seq_len: characters per training sequence (the model's context length).
        stride: distance between the starts of consecutive windows (``seq_len`` = no overlap).
        val_fraction: share of the text (taken from its end) held out for validation.
        vocab_multiple: pad the vocabulary size up to a multiple of this (shardable by tensor parallel).
        global_batch_size / per_device_batch_size / val_batch_size / seed / num_workers: see the base class.

    Example::

        dm = CharsDataModule(seq_len=64, global_batch_size=32)
        dm.configure(data_parallel_size=2, accumulate=1)   # micro-batch 16 per rank
    """

    def __init__(
        self,
        source: str = PYTHON_DOCS,
        files: list[str] | None = None,
        seq_len: int = 64,
        stride: int | None = None,
        val_fraction: float = 0.1,
        vocab_multiple: int = 64,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if source not in (PYTHON_DOCS, "files"):
            raise ConfigError(f"data.source must be 'python_docs' or 'files'. Got {source!r}.")
        if source == "files" and not files:
            raise ConfigError("data.source=files needs data.files=[path, ...] with at least one text file.")
        if source == PYTHON_DOCS and files:
            raise ConfigError(
                f"data.files={list(files)} is set but data.source=python_docs ignores it. Add data.source=files to "
                "train on those files, or drop data.files."
            )
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be between 0 and 1 (exclusive). Got {val_fraction!r}.")
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ConfigError(f"data.seq_len should be an int greater than 0. Got {seq_len!r}.")
        self.source = source
        self.files = list(files or [])
        self.seq_len = seq_len
        self.stride = stride or seq_len
        self.val_fraction = val_fraction
        self.vocab_multiple = vocab_multiple
        self.chars: list[str] = []

    @override
    def build(self) -> None:
        text = load_python_docs() if self.source == PYTHON_DOCS else load_files(self.files)
        needed = 2 * (self.seq_len + 1)
        if len(text.strip()) == 0 or len(text) < needed / min(self.val_fraction, 1 - self.val_fraction):
            where = "the Python documentation corpus" if self.source == PYTHON_DOCS else f"data.files={self.files}"
            raise ConfigError(
                f"The corpus from {where} is empty or too short ({len(text)} characters) for sequences of "
                f"data.seq_len={self.seq_len}. Use longer text files or a smaller data.seq_len."
            )
        self.chars = sorted(set(text))
        index = {ch: i for i, ch in enumerate(self.chars)}
        tokens = torch.tensor([index[ch] for ch in text], dtype=torch.long)
        split = int(len(tokens) * (1 - self.val_fraction))
        self.train_set = CharDataset(tokens[:split], self.seq_len, self.stride)
        self.val_set = CharDataset(tokens[split:], self.seq_len, self.seq_len)

    @property
    def vocab_size(self) -> int:
        multiple = self.vocab_multiple
        return -(-len(self.chars) // multiple) * multiple

    @override
    def model_kwargs(self) -> dict:
        return {"vocab_size": self.vocab_size, "block_size": self.seq_len}

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] if i < len(self.chars) else "?" for i in ids)
