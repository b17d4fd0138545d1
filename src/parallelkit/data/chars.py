"""Character-level language modelling on real text that ships with every Python installation.

The default corpus is the Python documentation bundled in the standard library (``pydoc_data.topics``,
about 465,000 characters of English prose and code examples): no download, same text on every machine
with the same Python. Any UTF-8 text files can be used instead (``data.files=[a.txt,b.txt]``).
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch
from torch.utils.data import Dataset
from typing_extensions import override

from parallelkit.data.base import DataParallelDataModule
from parallelkit.errors import ConfigError

PYTHON_DOCS = "python_docs"


def load_python_docs() -> str:
    """The pydoc topic texts of this Python installation, joined in sorted key order (deterministic)."""
    try:
        topics = importlib.import_module("pydoc_data.topics").topics
    except ImportError as err:  # a stripped-down Python without pydoc_data
        raise ConfigError(
            "data=chars with data.source=python_docs needs the standard library's pydoc_data module, which this "
            "Python installation lacks. Point data.files at one or more UTF-8 text files instead."
        ) from err
    return "\n\n".join(topics[key] for key in sorted(topics))


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
