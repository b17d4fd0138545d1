"""``data=text``: the user's files, tokenized once into a memory-mapped cache, packed, sharded, resumable.

References are computed here from the inputs directly: the expected token stream from the ``tokenizers``
object the test trained (not through transformers' loader, which the data module uses) or from the UTF-8
bytes, the expected batches from ``torch.randperm`` (the sampler's documented order). Negative controls:
another seed gives other batches, a changed file gives another cache, a resume from another position
gives other batches.
"""

from __future__ import annotations

import json
import os
import pickle
import threading
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be downloaded; the tokenizer is local

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from parallelkit.data import text as text_module
from parallelkit.data import tokenized_cache
from parallelkit.data.chars import load_python_docs
from parallelkit.data.text import BYTE_EOS, TextDataModule, token_dtype
from parallelkit.errors import ConfigError

EOS = "<|endoftext|>"
SEQ = 16


# --------------------------------------------------------------------------- inputs written by the test


def documents() -> list[str]:
    """Real prose of varying length: the paragraphs of a few pydoc topics."""
    paragraphs = [p.strip() for p in load_python_docs().split("\n\n") if p.strip()]
    return paragraphs[:120]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small byte-level BPE trained on the documents, saved with save_pretrained: (directory, Tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(documents(), trainer)
    directory = tmp_path_factory.mktemp("tok") / "tok"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(str(directory))
    return directory, tok


@pytest.fixture
def corpus(tmp_path):
    """The first 70 documents in a .jsonl (field "text"), the other 50 in a .parquet (column "text")."""
    docs = documents()
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" + ("\n" if i % 10 == 0 else "") for i, d in enumerate(docs[:70])))
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.table({"id": list(range(70, 120)), "text": docs[70:]}), parquet, row_group_size=16)
    return SimpleNamespace(docs=docs, jsonl=jsonl, parquet=parquet, files=[str(jsonl), str(parquet)])


def reference_stream(docs: list[str], tok) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    return np.array([i for d in docs for i in (*tok.encode(d).ids, eos)], dtype=np.int64)


def make(files, tmp_path, **kwargs) -> TextDataModule:
    dp = kwargs.pop("dp", 1)
    kwargs = {"seq_len": SEQ, "global_batch_size": 8, "cache_dir": str(tmp_path / "cache"), **kwargs}
    dm = TextDataModule(files=files, **kwargs)
    dm.configure(data_parallel_size=dp, accumulate=1)
    return dm


def attach(dm: TextDataModule, dp: int, rank: int, epoch: int = 0, processed: int = 0) -> None:
    """What the data module reads from Lightning's trainer: the strategy's sharding and the loop's progress."""
    progress = SimpleNamespace(current=SimpleNamespace(processed=processed))
    dm.trainer = SimpleNamespace(
        strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": dp, "rank": rank}),
        current_epoch=epoch,
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)),
    )


def epoch_batches(dm: TextDataModule, dp: int = 1, rank: int = 0, epoch: int = 0) -> list[torch.Tensor]:
    attach(dm, dp, rank)
    loader = dm.train_dataloader()
    loader.batch_sampler.set_epoch(epoch)
    return [inputs for inputs, _ in loader]


def cache_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


# --------------------------------------------------------------------------- the token stream


def test_stream_equals_the_documents_tokenized_directly(corpus, trained, tmp_path):
    directory, tok = trained
    dm = make(corpus.files, tmp_path, tokenizer=str(directory))
    expected = reference_stream(corpus.docs, tok)
    stream = np.asarray(dm.train_set.tokens)
    assert isinstance(dm.train_set.tokens, np.memmap) and dm.train_set.tokens.dtype == np.uint16
    assert np.array_equal(stream.astype(np.int64), expected)
    # Packed into non-overlapping windows; the validation set is the tail of the token stream.
    split = int(len(expected) * 0.9)
    assert len(dm.train_set) == (split - 1) // SEQ and len(dm.val_set) == (len(expected) - split - 1) // SEQ
    for ds, base, index in ((dm.train_set, 0, 0), (dm.train_set, 0, 7), (dm.val_set, split, 3)):
        x, y = ds[index]
        window = torch.from_numpy(expected[base + index * SEQ : base + index * SEQ + SEQ + 1])
        assert torch.equal(x, window[:-1]) and torch.equal(y, window[1:])
    # The model's vocabulary: the tokenizer's, padded to a multiple of 64.
    vocab = tok.get_vocab_size(with_added_tokens=True)
    assert dm.model_kwargs() == {"vocab_size": -(-vocab // 64) * 64, "block_size": SEQ}
    assert dm.tokenizer_vocab_size == vocab and dm.tokenizer_path == str(directory.resolve())
    assert make(corpus.files, tmp_path, tokenizer=str(directory), vocab_multiple=1).model_kwargs()["vocab_size"] == vocab
    assert dm.decode(expected[:40].tolist()) == tok.decode(expected[:40].tolist(), skip_special_tokens=False)
    assert dm.encode(corpus.docs[3]) == tok.encode(corpus.docs[3]).ids


def test_byte_level_txt_files_are_one_document_each(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first paragraph\n\nsecond paragraph of the same file, é ü\n" * 20, encoding="utf-8")
    b.write_text("another file " * 40, encoding="utf-8")
    dm = make([str(tmp_path / "*.txt")], tmp_path, global_batch_size=2)  # a glob: matches sorted
    expected = [*a.read_bytes(), BYTE_EOS, *b.read_bytes(), BYTE_EOS]
    assert np.asarray(dm.train_set.tokens).tolist() == expected
    assert dm.model_kwargs() == {"vocab_size": 320, "block_size": SEQ}  # 257 padded to 64
    assert dm.decode([*"é ü".encode(), BYTE_EOS, 300]) == "é ü\n\n"  # padding ids are left out


def test_default_is_the_python_docs_in_memory_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dm = TextDataModule(seq_len=64, global_batch_size=32)
    dm.configure(data_parallel_size=1, accumulate=1)
    expected = np.frombuffer(load_python_docs().encode(), dtype=np.uint8).tolist() + [BYTE_EOS]
    tokens = dm.train_set.tokens
    assert not isinstance(tokens, np.memmap) and tokens.tolist() == expected
    assert list(tmp_path.iterdir()) == []
    assert dm.model_kwargs() == {"vocab_size": 320, "block_size": 64}


def test_token_dtype_fits_the_vocabulary():
    assert token_dtype(257) == np.uint16 and token_dtype(1 << 16) == np.uint16
    assert token_dtype((1 << 16) + 1) == np.uint32 and token_dtype(151_936) == np.uint32


# --------------------------------------------------------------------------- batches: seed, shards, resume


def test_same_seed_same_batches_another_seed_other_batches(corpus, trained, tmp_path):
    directory, tok = trained
    first = epoch_batches(make(corpus.files, tmp_path, tokenizer=str(directory), seed=3))
    again = epoch_batches(make(corpus.files, tmp_path, tokenizer=str(directory), seed=3))
    other = epoch_batches(make(corpus.files, tmp_path, tokenizer=str(directory), seed=4))
    assert len(first) == len(again) == len(other) > 3
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(torch.stack(first), torch.stack(other))  # negative control
    # The order is the documented one: a permutation of the windows from seed + epoch.
    expected = reference_stream(corpus.docs, tok)
    num_windows = (int(len(expected) * 0.9) - 1) // SEQ
    order = torch.randperm(num_windows, generator=torch.Generator().manual_seed(3)).tolist()
    for step in (0, len(first) - 1):
        rows = [torch.from_numpy(expected[i * SEQ : i * SEQ + SEQ]) for i in order[step * 8 : step * 8 + 8]]
        assert torch.equal(first[step], torch.stack(rows))


def test_the_ranks_shards_partition_the_global_batch(corpus, trained, tmp_path):
    directory, _ = trained
    single = epoch_batches(make(corpus.files, tmp_path, tokenizer=str(directory)), epoch=1)
    ranks = [epoch_batches(make(corpus.files, tmp_path, tokenizer=str(directory), dp=2), dp=2, rank=r, epoch=1) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == len(single)
    for step, whole in enumerate(single):
        shard0, shard1 = ranks[0][step], ranks[1][step]
        assert shard0.shape == shard1.shape == (4, SEQ)
        assert torch.equal(torch.cat([shard0, shard1]), whole)  # rank r holds rows r·4 … r·4+3 of the step
        assert not torch.equal(shard0, shard1)


def test_mid_epoch_resume_continues_where_the_checkpoint_left(corpus, trained, tmp_path):
    directory, _ = trained
    dm = make(corpus.files, tmp_path, tokenizer=str(directory))
    full = epoch_batches(dm, epoch=2)
    attach(dm, 1, 0, epoch=2, processed=3)
    state = dm.state_dict()
    assert state == {"epoch": 2, "batches_done": 3}

    resumed = make(corpus.files, tmp_path, tokenizer=str(directory))
    resumed.load_state_dict(state)
    rest = epoch_batches(resumed, epoch=2)
    assert len(rest) == len(full) - 3
    assert all(torch.equal(a, b) for a, b in zip(rest, full[3:]))
    # Negative control: another position gives other batches; the next epoch starts from its beginning.
    elsewhere = make(corpus.files, tmp_path, tokenizer=str(directory))
    elsewhere.load_state_dict({"epoch": 2, "batches_done": 2})
    assert not torch.equal(epoch_batches(elsewhere, epoch=2)[0], rest[0])
    assert len(epoch_batches(resumed, epoch=3)) == len(full)


def test_windows_survive_pickling_as_a_memory_map(corpus, tmp_path):
    dm = make(corpus.files, tmp_path)
    copy = pickle.loads(pickle.dumps(dm.train_set))
    assert isinstance(copy.tokens, np.memmap) and copy.tokens.filename == dm.train_set.tokens.filename
    assert len(pickle.dumps(dm.train_set)) < 2000  # the path, not the tokens
    assert all(torch.equal(a, b) for a, b in zip(copy[5], dm.train_set[5]))


# --------------------------------------------------------------------------- the cache


@pytest.fixture
def tokenize_calls(monkeypatch):
    calls = []
    real = text_module.tokenize

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(text_module, "tokenize", spy)
    return calls


def test_cache_is_reused_and_invalidated_by_a_changed_file(corpus, trained, tmp_path, tokenize_calls):
    directory, tok = trained
    first = make(corpus.files, tmp_path, tokenizer=str(directory))
    assert len(tokenize_calls) == 1
    bin_path = first.cache_path
    meta = json.loads(bin_path.with_suffix(".json").read_text())
    assert meta["num_documents"] == 120 and meta["dtype"] == "uint16" and meta["tokenizer"]["vocab_size"] == tok.get_vocab_size(with_added_tokens=True)
    assert cache_files(tmp_path / "cache") == sorted([bin_path.name, bin_path.with_suffix(".json").name])
    before = bin_path.stat()

    second = make(corpus.files, tmp_path, tokenizer=str(directory))
    assert len(tokenize_calls) == 1 and second.cache_path == bin_path  # not tokenized again
    assert (bin_path.stat().st_ino, bin_path.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)

    with corpus.jsonl.open("a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    third = make(corpus.files, tmp_path, tokenizer=str(directory))
    assert len(tokenize_calls) == 2 and third.cache_path != bin_path
    docs = [*corpus.docs[:70], "one more document", *corpus.docs[70:]]
    assert np.array_equal(np.asarray(third.train_set.tokens).astype(np.int64), reference_stream(docs, tok))
    # Bytes instead of the tokenizer: another key too.
    fourth = make(corpus.files, tmp_path)
    assert len(tokenize_calls) == 3 and fourth.cache_path not in (bin_path, third.cache_path)


def test_a_damaged_cache_is_built_again(corpus, tmp_path, tokenize_calls):
    first = make(corpus.files, tmp_path)
    good = np.asarray(first.train_set.tokens).copy()
    with open(first.cache_path, "r+b") as f:  # a crash after the rename of a truncated .bin
        f.truncate(100)
    (tmp_path / "cache" / f".{first.cache_path.name}.123.abcd.tmp").write_bytes(b"a writer that died")
    again = make(corpus.files, tmp_path)
    assert len(tokenize_calls) == 2 and np.array_equal(np.asarray(again.train_set.tokens), good)


@pytest.mark.parametrize("locking", [True, False], ids=["locked", "no-locks"])
def test_concurrent_builders_leave_one_whole_cache(corpus, tmp_path, monkeypatch, tokenize_calls, locking):
    """Ranks build at the same time. With locks one tokenizes and the others reuse its cache; without locks
    (a file system that refuses them) each writes, and the atomic renames still leave one whole cache."""
    if not locking:
        monkeypatch.setattr(tokenized_cache, "_one_writer", lambda directory: nullcontext())
    results, errors = [None] * 4, []

    def build(i: int) -> None:
        try:
            results[i] = np.asarray(make(corpus.files, tmp_path).train_set.tokens).copy()
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=build, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    expected = [b for d in corpus.docs for b in (*d.encode(), BYTE_EOS)]
    assert all(r.tolist() == expected for r in results)
    names = cache_files(tmp_path / "cache")
    assert len(names) == 2 and not any(n.endswith(".tmp") for n in names), names
    if locking:
        assert len(tokenize_calls) == 1


def test_one_writer_excludes_another_open_of_the_directory(tmp_path):
    fcntl = pytest.importorskip("fcntl")
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        with tokenized_cache._one_writer(tmp_path):
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released on leaving
    finally:
        os.close(fd)


def test_a_cache_finished_while_waiting_for_the_lock_is_reused(corpus, tmp_path, monkeypatch, tokenize_calls):
    """The writer looks again once it holds the lock: another rank may have written the cache meanwhile."""
    first = make(corpus.files, tmp_path)
    real_read, reads = tokenized_cache._read, []

    def read_missing_before_the_lock(*args):
        reads.append(1)
        return None if len(reads) == 1 else real_read(*args)  # the first look happens before the lock

    monkeypatch.setattr(tokenized_cache, "_read", read_missing_before_the_lock)
    second = make(corpus.files, tmp_path)
    assert len(reads) == 2 and len(tokenize_calls) == 1 and second.cache_path == first.cache_path


# --------------------------------------------------------------------------- bad input: one clear ConfigError


def refused(files, tmp_path, **kwargs) -> str:
    with pytest.raises(ConfigError) as err:
        make(files, tmp_path, **kwargs)
    # Nothing half-written: no cache file and no temporary beside it.
    leftovers = [n for n in cache_files(tmp_path / "cache") if n.startswith(("tokens-", ".tokens-"))]
    assert leftovers == [], leftovers
    return " ".join(str(err.value).split())


def test_missing_tokenizer_directory(tmp_path, corpus):
    message = refused(corpus.files, tmp_path, tokenizer=str(tmp_path / "no_such_tok"))
    assert str(tmp_path / "no_such_tok") in message and "save_pretrained" in message and "data.tokenizer=null" in message


def test_directory_that_holds_no_tokenizer(tmp_path, corpus):
    (tmp_path / "not_a_tok").mkdir()
    (tmp_path / "not_a_tok" / "notes.md").write_text("hello")
    message = refused(corpus.files, tmp_path, tokenizer=str(tmp_path / "not_a_tok"))
    assert "could not load a tokenizer" in message and "not_a_tok" in message and "save_pretrained" in message


def test_jsonl_line_without_the_field_names_file_line_and_fields(tmp_path, corpus):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine " * 50}) + "\n\n" + json.dumps({"body": "x", "id": 2}) + "\n")
    message = refused([str(bad)], tmp_path)
    assert f"{bad}, line 3, has no field 'text'" in message
    assert "['body', 'id']" in message and "data.field=body" in message
    message = refused([str(corpus.jsonl)], tmp_path, field="content")
    assert f"{corpus.jsonl}, line 1, has no field 'content'" in message and "['id', 'text']" in message


def test_jsonl_line_that_is_not_json_or_not_text(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    assert f"{bad}, line 2, is not JSON" in refused([str(bad)], tmp_path)
    bad.write_text('{"text": "ok"}\n{"text": 42}\n')
    assert f"{bad}, line 2: the field 'text' holds int" in refused([str(bad)], tmp_path)


def test_parquet_without_the_column_or_with_a_null_row(tmp_path, corpus):
    message = refused([str(corpus.parquet)], tmp_path, field="body")
    assert f"{corpus.parquet} has no column 'body'" in message and "['id', 'text']" in message
    holes = tmp_path / "holes.parquet"
    pq.write_table(pa.table({"text": ["a document"] * 20 + [None]}), holes, row_group_size=8)
    assert f"{holes}, row 20 (counting from 0): the column 'text' is null" in refused([str(holes)], tmp_path)


def test_unknown_extension_missing_file_and_empty_glob(tmp_path):
    csv = tmp_path / "data.csv"
    csv.write_text("text\nhello\n")
    message = refused([str(csv)], tmp_path)
    assert str(csv) in message and "'.csv'" in message and ".txt" in message and ".jsonl" in message and ".parquet" in message
    assert f"{tmp_path / 'nope.jsonl'!s}' does not exist" in refused([str(tmp_path / "nope.jsonl")], tmp_path)
    assert "matches no file" in refused([str(tmp_path / "*.parquet")], tmp_path)


def test_empty_corpus_and_too_short_corpus(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": ""}) + "\n")
    message = refused([str(empty)], tmp_path)
    assert "is empty: 2 document(s) without text" in message
    (tmp_path / "nothing.txt").write_text("")
    assert "is empty" in refused([str(tmp_path / "nothing.txt")], tmp_path)
    short = tmp_path / "short.txt"
    short.write_text("x" * 100)
    message = refused([str(short)], tmp_path, seq_len=32)
    assert "too short: 101 tokens" in message and "data.seq_len=32" in message


@pytest.mark.parametrize(
    "kwargs, words",
    [({"seq_len": 0}, "data.seq_len"), ({"stride": -1}, "data.stride"), ({"stride": 0}, "data.stride"), ({"val_fraction": 1.0}, "data.val_fraction"),
     ({"vocab_multiple": 0}, "data.vocab_multiple"), ({"field": ""}, "data.field")],
)
def test_invalid_settings(kwargs, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        TextDataModule(**kwargs)
