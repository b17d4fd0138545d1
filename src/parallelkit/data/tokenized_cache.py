"""The user's documents, read from their files and tokenized once into a memory-mapped cache.

Documents: a ``.txt`` file is one document (the whole file, UTF-8); a ``.jsonl`` file holds one document
per line (a JSON object whose field ``data.field`` is the text; blank lines are skipped); a ``.parquet``
file holds one document per row (the string column ``data.field``). Anything else is refused by name.

Cache layout, in ``cache_dir`` (by default ``<run dir>/data``)::

    tokens-<key>.bin    the ids of every document, each document followed by the end-of-document id,
                        as raw native-endian uint16 (vocabulary ≤ 65,536) or uint32
    tokens-<key>.json   what was tokenized and how: files, field, tokenizer, dtype, num_tokens, num_documents

``<key>`` hashes the format version, each input file's absolute path, size and modification time (ns), the
field, and the tokenizer's identity: a changed input gets another key and is tokenized again; an unchanged
one finds its files and is memory-mapped without reading the inputs.

Every rank builds the data: rank 0 before it starts the others, early-started local ranks at the same time
as rank 0, each torchrun rank on its own. So the cache is written to be safe under concurrent writers:
one writer at a time per directory (an advisory ``flock`` on the directory, where the file system has
locks: the others wait, then find the finished cache and reuse it), and in any case every file is written
under a temporary name unique to the process and renamed into place (``os.replace`` is atomic), the
``.json`` last. A reader trusts a cache only when the ``.json`` describes exactly its input and the
``.bin`` has the length it names, so a crash half-way leaves nothing that could be read as whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from parallelkit.errors import ConfigError

SUFFIXES = (".txt", ".jsonl", ".parquet")
FORMAT_VERSION = 1  # bump when the layout or the tokenization rules change: old caches are then ignored
_READS = (".txt (one document per file), .jsonl (one document per line, in field data.field) and "
          ".parquet (one document per row, in column data.field)")


# --------------------------------------------------------------------------- the input files


def expand_files(patterns: Iterable[str] | str) -> list[Path]:
    """``data.files`` as absolute paths, in the order given (each glob's matches sorted)."""
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]  # data.files=a.jsonl without brackets
    paths = []
    for pattern in patterns:
        text = os.path.expanduser(str(pattern))
        if any(ch in text for ch in "*?["):
            import glob

            matches = sorted(m for m in glob.glob(text, recursive=True) if os.path.isfile(m))
            if not matches:
                raise ConfigError(
                    f"data.files: the pattern {str(pattern)!r} matches no file (relative paths start at {os.getcwd()}). "
                    f"data=text reads {_READS}."
                )
        elif not os.path.isfile(text):
            raise ConfigError(
                f"data.files: {text!r} does not exist or is not a file (relative paths start at {os.getcwd()}). "
                f"Give paths or globs of files; data=text reads {_READS}."
            )
        else:
            matches = [text]
        for match in matches:
            path = Path(match).resolve()
            if path.suffix.lower() not in SUFFIXES:
                raise ConfigError(
                    f"data.files: {path} has the extension {path.suffix or '(none)'!r}, which data=text does not read. "
                    f"It reads {_READS}: rename or convert the file."
                )
            paths.append(path)
    return paths


def iter_documents(path: Path, field: str) -> Iterator[str]:
    """The documents of one file, in file order; bad content raises a ConfigError naming file and line/row."""
    suffix = path.suffix.lower()
    if suffix == ".txt":
        return _txt_documents(path)
    if suffix == ".jsonl":
        return _jsonl_documents(path, field)
    return _parquet_documents(path, field)


def _txt_documents(path: Path) -> Iterator[str]:
    try:
        yield path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"data.files: {path} is not UTF-8 text (invalid byte at offset {err.start}). Convert it to UTF-8 "
            "(e.g. `iconv -f latin1 -t utf-8`)."
        ) from None


def _jsonl_documents(path: Path, field: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise ConfigError(
                    f"data.files: {path}, line {number}, is not JSON ({err}). A .jsonl file holds one JSON object "
                    f"per line, with the document's text in the field data.field={field!r}."
                ) from None
            if not isinstance(record, dict) or field not in record:
                keys = sorted(record) if isinstance(record, dict) else []
                found = f"its fields are {keys}" if keys else f"it is a JSON {type(record).__name__}, not an object"
                hint = f" (e.g. data.field={keys[0]})" if keys else ""
                raise ConfigError(
                    f"data.files: {path}, line {number}, has no field {field!r} (data.field); {found}. Set data.field "
                    f"to the field that holds the text{hint}, or add the field to every line."
                )
            text = record[field]
            if not isinstance(text, str):
                raise ConfigError(
                    f"data.files: {path}, line {number}: the field {field!r} holds {type(text).__name__} "
                    f"{str(text)[:40]!r}, not text. Every line's data.field must be a string."
                )
            yield text


def _parquet_documents(path: Path, field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise ConfigError(f"data.files: {path} is not a readable Parquet file ({err}).") from None
    schema = parquet.schema_arrow
    if field not in schema.names:
        hint = f" (e.g. data.field={schema.names[0]})" if schema.names else ""
        raise ConfigError(
            f"data.files: {path} has no column {field!r} (data.field); its columns are {schema.names}. Set "
            f"data.field to the column that holds the text{hint}."
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or getattr(pa.types, "is_string_view", bool)(kind)):
        raise ConfigError(f"data.files: {path}: the column {field!r} (data.field) holds {kind}, not strings. Name a string column.")
    row = 0
    for batch in parquet.iter_batches(columns=[field], batch_size=1024):
        texts = batch.column(0).to_pylist()
        if None in texts:
            raise ConfigError(
                f"data.files: {path}, row {row + texts.index(None)} (counting from 0): the column {field!r} is null. "
                "Drop or fill the rows without text."
            )
        yield from texts
        row += len(texts)


# --------------------------------------------------------------------------- the cache


def cache_key(files: list[Path], field: str, tokenizer: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(key, description)``: the description is what the cache was made from, the key its hash."""
    described = {
        "format": FORMAT_VERSION,
        "files": [{"path": str(p), "size": (s := p.stat()).st_size, "mtime_ns": s.st_mtime_ns} for p in files],
        "field": field,
        "tokenizer": tokenizer,
    }
    key = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:20]
    return key, described


@dataclass(frozen=True)
class CachedTokens:
    """A finished cache entry: ``array()`` memory-maps the token ids (read-only)."""

    path: Path
    meta: dict[str, Any]
    reused: bool

    @property
    def num_tokens(self) -> int:
        return int(self.meta["num_tokens"])

    def array(self) -> np.ndarray:
        if self.num_tokens == 0:  # np.memmap refuses an empty file
            return np.zeros(0, dtype=self.meta["dtype"])
        return np.memmap(self.path, dtype=np.dtype(self.meta["dtype"]), mode="r", shape=(self.num_tokens,))


def load_or_build(
    cache_dir: Path,
    key: str,
    described: dict[str, Any],
    dtype: np.dtype,
    chunks: Callable[[], Iterable[tuple[np.ndarray, int]]],
    check: Callable[[dict[str, Any]], None],
) -> CachedTokens:
    """The cache entry ``key`` in ``cache_dir``: reused if whole, else written from ``chunks()``.

    ``chunks()`` yields ``(token ids, number of documents they hold)``; ``check(meta)`` may refuse the result
    (a corpus too short) before anything is renamed into place, and is applied to a reused entry too.
    """
    bin_path, meta_path = cache_dir / f"tokens-{key}.bin", cache_dir / f"tokens-{key}.json"
    found = _read(bin_path, meta_path, key, described)
    if found is None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with _one_writer(cache_dir):
            found = _read(bin_path, meta_path, key, described)  # another rank may have finished while we waited
            if found is None:
                meta = _write(cache_dir, bin_path, meta_path, key, described, np.dtype(dtype), chunks, check)
                return CachedTokens(bin_path, meta, reused=False)
    check(found.meta)
    return found


def _read(bin_path: Path, meta_path: Path, key: str, described: dict[str, Any]) -> CachedTokens | None:
    try:
        meta = json.loads(meta_path.read_text())
        whole = meta["key"] == key and {k: meta[k] for k in described} == described
        whole = whole and bin_path.stat().st_size == int(meta["num_tokens"]) * np.dtype(meta["dtype"]).itemsize
    except (OSError, ValueError, KeyError, TypeError):  # absent, or not ours to trust: build it again
        return None
    return CachedTokens(bin_path, meta, reused=True) if whole else None


def _write(cache_dir, bin_path, meta_path, key, described, dtype, chunks, check) -> dict[str, Any]:
    unique = f"{os.getpid()}.{secrets.token_hex(4)}.tmp"
    tmp_bin, tmp_meta = cache_dir / f".{bin_path.name}.{unique}", cache_dir / f".{meta_path.name}.{unique}"
    try:
        num_documents = 0
        with open(tmp_bin, "wb") as f:
            for ids, documents in chunks():
                f.write(np.ascontiguousarray(ids, dtype=dtype).tobytes())
                num_documents += documents
            num_tokens = f.tell() // dtype.itemsize
            f.flush()
            os.fsync(f.fileno())
        meta = {**described, "key": key, "dtype": dtype.name, "num_tokens": num_tokens, "num_documents": num_documents}
        check(meta)  # bad input stops here: nothing is renamed into place
        tmp_meta.write_text(json.dumps(meta, indent=1))
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_meta, meta_path)  # last: its presence says the .bin beside it is whole
        return meta
    finally:
        tmp_bin.unlink(missing_ok=True)
        tmp_meta.unlink(missing_ok=True)


@contextmanager
def _one_writer(directory: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``directory`` (released when the descriptor closes).

    Only an optimisation (the other ranks wait instead of tokenizing the same files again): without
    ``fcntl`` or on a file system that refuses locks, the atomic renames alone keep the cache whole.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)
