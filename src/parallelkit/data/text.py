"""The user's own text, tokenized: ``data=text data.files=[...] data.tokenizer=PATH``.

Documents come from ``.txt`` files (a file is one document), ``.jsonl`` files (a line is one document, its
field ``data.field``) and ``.parquet`` files (a row is one document, its column ``data.field``), in the order
of ``data.files`` (a glob's matches sorted). Each document is tokenized without special tokens and followed
by the tokenizer's end-of-document id, and the stream is cut like ``data=chars``: the last ``val_fraction``
of the *tokens* is the validation set (so one long document can be split too), and each part is cut into
windows of ``seq_len + 1`` tokens (the target is the input shifted by one; windows may span documents, which
the end-of-document id separates, as in GPT-2's packing).

Tokenizers: ``data.tokenizer=PATH``, any directory written by ``save_pretrained`` (loaded with
``transformers.AutoTokenizer.from_pretrained(PATH, local_files_only=True)``: nothing is downloaded; its
``eos_token`` ends each document), or ``null``: bytes, where a document's ids are its UTF-8 bytes
(0..255) and 256 ends it, a vocabulary of 257.

The files are tokenized once into a memory-mapped cache in the run's ``data/`` directory
(:mod:`parallelkit.data.tokenized_cache`), shared by the ranks and reused by a rerun while the inputs are
unchanged. With no ``data.files``, the corpus is the Python documentation bundled with Python (``data=chars``'s
default, as one document): it is tokenized in memory and nothing is written.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import Dataset
from typing_extensions import override

from parallelkit.data.base import DataParallelDataModule
from parallelkit.data.chars import load_python_docs
from parallelkit.data.tokenized_cache import cache_key, expand_files, iter_documents, load_or_build
from parallelkit.errors import ConfigError

BYTE_VOCAB = 257  # bytes 0..255, and the end-of-document id
BYTE_EOS = 256
_CHUNK_CHARS = 1 << 22  # documents handed to the tokenizer at once: large batches, bounded memory


class ByteTokenizer:
    """Byte-level tokenizer: a document's UTF-8 bytes are its ids; :data:`BYTE_EOS` ends a document."""

    vocab_size = BYTE_VOCAB
    eos_id = BYTE_EOS

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        # The end of a document reads as a blank line; ids past the vocabulary (padding) are left out.
        out = bytearray()
        for i in ids:
            if i < 256:
                out.append(i)
            elif i == BYTE_EOS:
                out += b"\n\n"
        return out.decode("utf-8", errors="replace")

    def identity(self) -> dict[str, Any]:
        return {"kind": "bytes", "vocab_size": BYTE_VOCAB, "eos_id": BYTE_EOS}


class PretrainedTokenizer:
    """A tokenizer directory written by ``save_pretrained``, loaded from local files only."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path).expanduser().resolve()
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        # transformers reports an unusable directory with OSError, ValueError, KeyError or its own types,
        # depending on which file is missing or wrong: any of them is the user's directory being unusable.
        except Exception as err:  # noqa: BLE001
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(
                f"data.tokenizer={self.path}: transformers could not load a tokenizer from this directory ({reason}). "
                "Point data.tokenizer at a directory written by tokenizer.save_pretrained(...) (tokenizer.json or the "
                "slow tokenizer's vocabulary files, and tokenizer_config.json), or set data.tokenizer=null for bytes."
            ) from None
        self.eos_id = self.tokenizer.eos_token_id
        if self.eos_id is None:
            raise ConfigError(
                f"data.tokenizer={self.path}: this tokenizer has no eos_token, which data=text puts after every "
                "document. Set one and save it again (tokenizer.eos_token = '</s>'; tokenizer.save_pretrained(...)), "
                "or use data.tokenizer=null for bytes."
            )
        self.vocab_size = len(self.tokenizer)  # the base vocabulary and the added tokens

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # No special tokens: documents are delimited by the end-of-document id alone (no BOS per document).
        return self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i < self.vocab_size])

    def identity(self) -> dict[str, Any]:
        # The directory's files by name, size and modification time: re-saving another tokenizer there
        # invalidates the cache, without hashing what may be gigabytes of model weights beside it.
        files = sorted([p.name, (s := p.stat()).st_size, s.st_mtime_ns] for p in self.path.iterdir() if p.is_file())
        return {"kind": "pretrained", "path": str(self.path), "class": type(self.tokenizer).__name__,
                "vocab_size": self.vocab_size, "eos_id": self.eos_id, "files": files}


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every id: uint16 up to 65,536 tokens, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def tokenize(documents: Iterable[str], tokenizer: ByteTokenizer | PretrainedTokenizer, dtype: np.dtype) -> Iterator[tuple[np.ndarray, int]]:
    """``(ids, number of documents)`` per batch of documents; each document's ids end with the EOS id."""
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    batch: list[str] = []
    size = 0

    def flush() -> tuple[np.ndarray, int]:
        encoded = tokenizer.encode_batch(batch)
        ids = np.concatenate([part for doc in encoded for part in (np.asarray(doc, dtype=np.int64), eos)])
        if len(ids) and ids.max() >= tokenizer.vocab_size:  # an embedding lookup would fail far from here
            raise ConfigError(f"data.tokenizer produced id {int(ids.max())}, outside its vocabulary of {tokenizer.vocab_size}.")
        return ids.astype(dtype), len(batch)

    for document in documents:
        batch.append(document)
        size += len(document)
        if size >= _CHUNK_CHARS or len(batch) >= 4096:
            yield flush()
            batch, size = [], 0
    if batch:
        yield flush()


class TokenWindows(Dataset):
    """Windows of ``seq_len + 1`` tokens of ``tokens[start:end]``; the target is the input shifted by one.

    ``tokens`` may be a read-only ``np.memmap``: a window is copied out only when it is read, and a
    DataLoader worker started by spawn reopens the file instead of receiving a copy of the whole array.
    """

    def __init__(self, tokens: np.ndarray, start: int, end: int, seq_len: int, stride: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.starts = range(start, end - seq_len, stride)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.starts[index]
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if isinstance(self.tokens, np.memmap):
            state["tokens"] = (self.tokens.filename, self.tokens.dtype.str, len(self.tokens))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state["tokens"], tuple):
            filename, dtype, length = state["tokens"]
            state["tokens"] = np.memmap(filename, dtype=np.dtype(dtype), mode="r", shape=(length,))
        self.__dict__.update(state)


class TextDataModule(DataParallelDataModule):
    """The user's documents, tokenized, cached, packed into ``seq_len`` sequences.

    Args:
        files: ``.txt``, ``.jsonl`` and ``.parquet`` paths or globs; empty: the bundled Python documentation.
        field: the ``.jsonl`` field / ``.parquet`` column holding a document's text.
        tokenizer: a ``save_pretrained`` directory, or ``None`` for bytes (vocabulary 257, EOS 256).
        seq_len: tokens per training sequence (the model's context length).
        stride: distance between the starts of consecutive training windows (``None``: ``seq_len``, no overlap).
        val_fraction: share of the token stream (taken from its end) held out for validation.
        vocab_multiple: pad the model's vocabulary size up to a multiple of this (shardable by tensor parallel).
        cache_dir: where the token cache goes; ``None``: ``<run_dir>/data``.
        run_dir: the run directory (``${hydra:runtime.output_dir}`` in conf/data/text.yaml); ``None`` outside a
            Hydra run: the cache then goes to ``./.parallelkit_cache``.
        global_batch_size / per_device_batch_size / val_batch_size / seed / num_workers: see the base class.

    Example::

        dm = TextDataModule(files=["corpus/*.jsonl"], tokenizer="my_tokenizer", seq_len=256, global_batch_size=32)
        dm.configure(data_parallel_size=2, accumulate=1)
        dm.model_kwargs()   # {"vocab_size": len(tokenizer) padded to 64, "block_size": 256}
    """

    def __init__(
        self,
        files: list[str] | str | None = None,
        field: str = "text",
        tokenizer: str | None = None,
        seq_len: int = 128,
        stride: int | None = None,
        val_fraction: float = 0.1,
        vocab_multiple: int = 64,
        cache_dir: str | None = None,
        run_dir: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        for name, value in (("seq_len", seq_len), ("vocab_multiple", vocab_multiple), ("stride", stride)):
            if name == "stride" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"data.{name} should be an int greater than 0. Got {value!r}.")
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be between 0 and 1 (exclusive). Got {val_fraction!r}.")
        if not isinstance(field, str) or not field:
            raise ConfigError(f"data.field must name the .jsonl field / .parquet column holding the text. Got {field!r}.")
        if tokenizer is not None and not Path(tokenizer).expanduser().is_dir():
            raise ConfigError(
                f"data.tokenizer={tokenizer}: no such directory (relative paths start at {os.getcwd()}). Give a directory "
                "written by tokenizer.save_pretrained(...), or data.tokenizer=null for bytes (ids 0..255, 256 ends a document)."
            )
        self.files = [files] if isinstance(files, str) else list(files or [])
        self.field = field
        # Absolute: the checkpoint records it for `python -m parallelkit.export`, which may run elsewhere.
        self.tokenizer_path = None if tokenizer is None else str(Path(tokenizer).expanduser().resolve())
        self.seq_len = seq_len
        self.stride = stride or seq_len
        self.val_fraction = val_fraction
        self.vocab_multiple = vocab_multiple
        self.cache_dir = cache_dir
        self.run_dir = run_dir
        self.cache_path: Path | None = None  # the .bin in use, when the corpus came from files
        self._tokenizer: ByteTokenizer | PretrainedTokenizer | None = None

    @property
    def tokenizer(self) -> ByteTokenizer | PretrainedTokenizer:
        if self._tokenizer is None:
            self._tokenizer = ByteTokenizer() if self.tokenizer_path is None else PretrainedTokenizer(self.tokenizer_path)
        return self._tokenizer

    def resolved_cache_dir(self) -> Path:
        if self.cache_dir is not None:
            return Path(self.cache_dir).expanduser()
        return Path(self.run_dir) / "data" if self.run_dir else Path.cwd() / ".parallelkit_cache"

    @override
    def build(self) -> None:
        tokenizer = self.tokenizer
        dtype = token_dtype(tokenizer.vocab_size)
        if not self.files:
            ids = [chunk for chunk, _ in tokenize([load_python_docs()], tokenizer, dtype)]
            tokens = np.concatenate(ids)
            self._check({"num_tokens": len(tokens), "num_documents": 1})
        else:
            paths = expand_files(self.files)
            key, described = cache_key(paths, self.field, tokenizer.identity())
            cache_dir = self.resolved_cache_dir()

            def documents() -> Iterator[str]:
                for path in paths:
                    yield from iter_documents(path, self.field)

            cached = load_or_build(cache_dir, key, described, dtype, lambda: tokenize(documents(), tokenizer, dtype), self._check)
            verb = "reused" if cached.reused else "wrote"
            rank_zero_info(f"parallelkit: data=text {verb} {cached.num_tokens} tokens of {cached.meta['num_documents']} "
                           f"document(s) in {cached.path}")
            self.cache_path = cached.path
            tokens = cached.array()
        split = int(len(tokens) * (1 - self.val_fraction))
        self.train_set = TokenWindows(tokens, 0, split, self.seq_len, self.stride)
        self.val_set = TokenWindows(tokens, split, len(tokens), self.seq_len, self.seq_len)

    def _check(self, meta: dict[str, Any]) -> None:
        """Refuse a corpus without text, or too short for one training and one validation sequence."""
        tokens, documents = int(meta["num_tokens"]), int(meta["num_documents"])
        where = f"data.files={self.files}" if self.files else "the Python documentation corpus"
        if tokens <= documents:  # nothing but end-of-document ids
            raise ConfigError(
                f"The corpus from {where} is empty: {documents} document(s) without text. Check data.files and "
                f"data.field={self.field!r} (the .jsonl field / .parquet column that holds the text)."
            )
        split = int(tokens * (1 - self.val_fraction))  # as build() cuts it
        if min(split, tokens - split) < self.seq_len + 1:
            raise ConfigError(
                f"The corpus from {where} is too short: {tokens} tokens in {documents} document(s) give {split} for "
                f"training and {tokens - split} for validation (data.val_fraction={self.val_fraction}), but a sequence "
                f"of data.seq_len={self.seq_len} needs {self.seq_len + 1} in each. Use more text or a smaller data.seq_len."
            )

    @property
    def tokenizer_vocab_size(self) -> int:
        """The ids the tokenizer can produce (``len(tokenizer)``; 257 for bytes), before padding."""
        return self.tokenizer.vocab_size

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary: the tokenizer's (``len(tokenizer)``), padded up to ``vocab_multiple``."""
        return -(-self.tokenizer.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @override
    def model_kwargs(self) -> dict[str, Any]:
        return {"vocab_size": self.vocab_size, "block_size": self.seq_len}

    def encode(self, text: str) -> list[int]:
        """A prompt's ids (no end-of-document id), for generation."""
        return [int(i) for i in self.tokenizer.encode_batch([text])[0]]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids])
