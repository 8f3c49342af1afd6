"""Prepared token stores under faults: errors and kills mid-prepare leave nothing that opens,
damaged stores are refused naming the file, memory stays bounded."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
from store_cases import check_documents, make_corpus, make_lines

from flaxformer_lite.data import store as store_module
from flaxformer_lite.data import store_writer
from flaxformer_lite.data.config import DataConfig
from flaxformer_lite.data.pipeline import build_data
from flaxformer_lite.data.store import open_store, prepare_store
from flaxformer_lite.data.tasks import TASKS
from flaxformer_lite.data.tokenizers import (
    SPECIAL_TOKENS,
    ByteTokenizer,
    WordTokenizer,
)


@pytest.fixture
def corpus(tmp_path):
    return make_corpus(tmp_path)


def test_an_error_while_encoding_leaves_nothing(corpus, tmp_path, monkeypatch):
    pattern, lines = corpus
    calls = []

    def failing(self, texts):
        calls.append(len(texts))
        if len(calls) == 3:
            raise RuntimeError("boom")
        return [self.encode(t) for t in texts]

    monkeypatch.setattr(ByteTokenizer, "encode_batch", failing)
    with pytest.raises(RuntimeError, match="boom"):
        prepare_store(
            tmp_path / "store", source="text", path=pattern, documents="lines", batch_size=10
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt"]
    monkeypatch.undo()
    store = prepare_store(
        tmp_path / "store", source="text", path=pattern, documents="lines", batch_size=10
    )
    check_documents(store, [(line,) for line in lines])


def test_bad_data_is_named_and_leaves_nothing(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"fine\n" * 50 + b"caf\xe9\n")
    with pytest.raises(ValueError, match=r"a.txt: not valid UTF-8 at line 51"):
        prepare_store(tmp_path / "store", source="text", path=str(tmp_path / "a.txt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]
    with pytest.raises(FileNotFoundError, match="missing.txt: file not found"):
        prepare_store(tmp_path / "store", source="text", path=str(tmp_path / "missing.txt"))


def swap_offsets(path):
    offsets = np.fromfile(path, np.int64)
    offsets[5], offsets[6] = offsets[6], offsets[5]
    offsets.tofile(path)


def edit_manifest(path, **values):
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


def scramble(path):
    """Random bytes, as many as the file had: only a checksum tells."""
    path.write_bytes(np.random.default_rng(0).bytes(path.stat().st_size))


def move_an_offset(path):
    """Document 5 starts where document 4 does: the offsets are still in order, from 0 to the
    end."""
    offsets = np.fromfile(path, np.int64)
    offsets[5] = offsets[4]
    offsets.tofile(path)


@pytest.mark.parametrize(
    "name, damage, reason",
    [
        ("text.tokens", lambda p: p.write_bytes(p.read_bytes()[:-2]), "bytes, but the manifest"),
        ("manifest.json", Path.unlink, r"no manifest.json\): an interrupted prepare\?"),
        ("manifest.json", lambda p: p.write_text('{"format": '), "not valid UTF-8 JSON"),
        ("manifest.json", lambda p: edit_manifest(p, version=99), "store format version 99"),
        ("digests.u64", Path.unlink, "missing from the store"),
        ("text.offsets", swap_offsets, "corrupt"),
        ("text.offsets", move_an_offset, "not the file the store was made with"),
        ("digests.u64", scramble, "not the file the store was made with"),
        ("tokenizer/vocab.json", lambda p: p.write_text("{}"), "not the tokenizer file the store"),
        ("tokenizer/vocab.json", Path.unlink, "missing from the store"),
    ],
)
def test_a_damaged_store_is_refused_naming_the_file(corpus, tmp_path, name, damage, reason):
    pattern, _ = corpus
    prepare_store(
        tmp_path / "store", source="text", path=pattern, documents="lines", tokenizer_name="char"
    )
    damage(tmp_path / "store" / name)
    with pytest.raises(ValueError, match=reason) as info:
        open_store(tmp_path / "store")
    named = tmp_path / "store" / name
    if name == "manifest.json" and damage is Path.unlink:
        named = named.parent  # no manifest: not a store at all
    assert str(info.value).startswith(f"{named}: ")
    with pytest.raises(ValueError):  # nor is it taken for a finished store, nor overwritten
        prepare_store(
            tmp_path / "store",
            source="text",
            path=pattern,
            documents="lines",
            tokenizer_name="char",
        )
    with pytest.raises(FileNotFoundError, match="no prepared store"):
        open_store(tmp_path / "nowhere")


def test_a_store_prepared_before_checksums_opens_unchecked(corpus, tmp_path):
    pattern, lines = corpus
    out = tmp_path / "store"
    prepare_store(out, source="text", path=pattern, documents="lines")
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["sha256"]) == ["digests.u64", "text.offsets"]  # not text.tokens
    del manifest["sha256"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    check_documents(open_store(out), [(line,) for line in lines])


def damaged_char_store(tmp_path, name, damage):
    """A char store of 60 lines (the source kept), its file ``name`` damaged."""
    (tmp_path / "lines.txt").write_text("\n".join(make_lines(60)) + "\n")
    path = str(tmp_path / "lines.txt")
    store = prepare_store(
        tmp_path / "store", source="text", path=path, documents="lines", tokenizer_name="char"
    )
    damage(store.path / name)
    return store


def big_ids(path):
    """Ids far past the vocabulary, as many bytes as the file had."""
    np.full(path.stat().st_size // 2, 60_000, np.uint16).tofile(path)


def test_ids_past_the_vocabulary_are_refused_as_batches_are_made(tmp_path):
    store = damaged_char_store(tmp_path, "text.tokens", big_ids)
    vocab = store.tokenizer.vocab_size
    for rows in ("documents", "windows"):
        cfg = DataConfig(source="prepared", path=str(store.path), seq_len=16, lm_rows=rows)
        data = build_data(cfg, task=TASKS["lm"], seed=0, batch_size=4, directory=tmp_path / rows)
        message = f"{store.path / 'text.tokens'}: token id 60000 is not in the vocabulary"
        with pytest.raises(ValueError, match=f"{message} of the store's tokenizer \\({vocab} ids"):
            next(data.train)
        with pytest.raises(ValueError, match=message):
            next(data.eval_batches())
    cfg = DataConfig(source="prepared", path=str(store.path), seq_len=16)
    data = build_data(cfg, task=TASKS["mlm"], seed=0, batch_size=4, directory=tmp_path / "mlm")
    with pytest.raises(ValueError, match=message):
        next(data.train)


@pytest.mark.parametrize(
    "name, damage, reason",
    [
        ("digests.u64", scramble, "not the file the store was made with"),
        # Found by the first batch, after the model is made: seconds.
        pytest.param("text.tokens", big_ids, "token id 60000", marks=pytest.mark.slow),
    ],
)
def test_train_from_a_damaged_store_exits_2_naming_the_file(tmp_path, capsys, name, damage, reason):
    from flaxformer_lite.cli.train import train_main

    store = damaged_char_store(tmp_path, name, damage)
    run_dir = tmp_path / "run"
    overrides = ["data.source=prepared", f"data.path={store.path}", "data.seq_len=16"]
    overrides += ["model.preset=gpt2-tiny", "train.batch_size=8", "train.steps=2"]
    assert train_main(["--no-progress", f"run_dir={run_dir}", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")
    assert f"{store.path / name}: " in err[0] and reason in err[0]


def test_a_leftover_partial_directory_is_never_picked_up(corpus, tmp_path):
    pattern, _ = corpus
    done = prepare_store(tmp_path / "done", source="text", path=pattern, documents="lines")
    host = socket.gethostname()
    dead = tmp_path / f".store.partial-{host}-999999999"
    alive = tmp_path / f".store.partial-{host}-{os.getppid()}"
    # Another machine's process (a shared file system) cannot be asked whether it still runs.
    elsewhere = tmp_path / f".store.partial-{host}-other-999999999"
    for leftover in (dead, alive, elsewhere):
        shutil.copytree(done.path, leftover)  # even complete, manifest and all
    with pytest.raises(FileNotFoundError):
        open_store(tmp_path / "store")
    prepare_store(tmp_path / "store", source="text", path=pattern, documents="lines")
    assert not dead.exists()  # its process is gone
    assert alive.exists()  # a running process may still be writing it
    assert elsewhere.exists()


# A child that prepares a corpus slowly (a pause per batch), to be killed halfway.
SLOW_PREPARE = """
import sys, time
from flaxformer_lite.data import store, tokenizers
encode_batch = tokenizers.ByteTokenizer.encode_batch
def slow(self, texts):
    time.sleep(0.02)
    return encode_batch(self, texts)
tokenizers.ByteTokenizer.encode_batch = slow
store.prepare_store(sys.argv[1], source="text", path=sys.argv[2], documents="lines", batch_size=64)
"""


def big_corpus(path, megabytes):
    """``megabytes`` MB of lines of 200 to 1,600 bytes."""
    block = "\n".join(make_lines(1000, seed=5, words=200)) + "\n"
    with path.open("w", encoding="utf-8") as file:
        for i in range(megabytes * 2**20 // len(block.encode()) + 1):
            file.write(f"block {i}\n{block}")
    return path


def test_a_killed_prepare_leaves_nothing_that_opens(tmp_path):
    corpus = big_corpus(tmp_path / "big.txt", 4)
    out = tmp_path / "store"
    child = subprocess.Popen([sys.executable, "-c", SLOW_PREPARE, str(out), str(corpus)])
    partial = tmp_path / f".store.partial-{socket.gethostname()}-{child.pid}"
    deadline = time.monotonic() + 60
    while not ((partial / "text.tokens").is_file() and (partial / "text.tokens").stat().st_size):
        assert child.poll() is None and time.monotonic() < deadline, "the child did not start"
        time.sleep(0.005)
    child.send_signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    assert not out.exists() and partial.is_dir()
    with pytest.raises(FileNotFoundError):
        open_store(out)
    with pytest.raises(ValueError, match=r"no manifest.json\): an interrupted prepare\?"):
        open_store(partial)
    store = prepare_store(out, source="text", path=str(corpus), documents="lines", batch_size=4096)
    assert not partial.exists()
    assert store.documents.lengths("text").sum() == len(corpus.read_bytes().replace(b"\n", b""))


# Peak resident memory while preparing, past a warm-up; this child imports no JAX. Lines are
# streamed: a "file" document (or one long paragraph) is held whole.
MEASURE_PREPARE = """
import resource, sys
from flaxformer_lite.data import readers, store, store_writer
from flaxformer_lite.data.tasks import TASKS
readers.CHUNK_BYTES = store_writer.READ_BYTES = 1 << 16
big, small, out = sys.argv[1:]
settings = dict(source="text", documents="lines")
for name in ("byte", "char"):
    store.prepare_store(f"{out}/warm-{name}", path=small, tokenizer_name=name, **settings)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for name in ("byte", "char"):
    store.prepare_store(f"{out}/{name}", path=big, tokenizer_name=name, batch_size=8, **settings)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_a_corpus_larger_than_the_memory_given_is_prepared(tmp_path):
    big = big_corpus(tmp_path / "big.txt", 24)
    small = tmp_path / "small.txt"
    small.write_text("\n".join(make_lines(200)))
    command = [sys.executable, "-c", MEASURE_PREPARE, str(big), str(small), str(tmp_path)]
    growth = int(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    assert growth < big.stat().st_size / 4, growth
    store = open_store(tmp_path / "char")
    assert store.documents.lengths("text").sum() == len(big.read_text().replace("\n", ""))


class Bars:
    """A tqdm-like factory that records each bar's description, total and updates."""

    def __init__(self):
        self.bars = []

    def __call__(self, total, desc):
        self.bars.append(bar := types.SimpleNamespace(desc=desc, total=total, done=0, closed=0))
        bar.update = lambda n: setattr(bar, "done", bar.done + n)
        bar.close = lambda: setattr(bar, "closed", bar.closed + 1)
        return bar


@pytest.mark.parametrize(
    "documents, passes",
    [
        ("lines", ["splitting", "fitting", "encoding"]),  # the first pass also hashes the files
        ("paragraphs", ["splitting", "fitting", "encoding"]),
        ("file", ["fitting", "encoding"]),  # each file's tail is held out: no digests to split
    ],
)
def test_progress_bars_count_every_pass_over_the_source_bytes(
    corpus, tmp_path, capfd, documents, passes
):
    pattern, _ = corpus
    size = sum(p.stat().st_size for p in tmp_path.glob("*.txt"))
    settings = dict(source="text", path=pattern, documents=documents, tokenizer_name="word")
    bars = Bars()
    prepare_store(tmp_path / "store", progress=bars, **settings)
    assert [(b.desc, b.total, b.done, b.closed) for b in bars.bars] == [
        (p, size, size, 1) for p in passes
    ]
    bars = Bars()
    prepare_store(tmp_path / "store", progress=bars, **settings)
    assert [b.desc for b in bars.bars] == ["hashing"]  # a no-op only checks the files
    assert capfd.readouterr() == ("", "")  # nothing printed


def test_batches_hold_at_most_batch_size_texts_and_batch_chars_characters(
    corpus, tmp_path, monkeypatch
):
    pattern, lines = corpus
    monkeypatch.setattr(store_writer, "BATCH_CHARS", 100)
    batches = []
    encode_batch = ByteTokenizer.encode_batch

    def spy(self, texts):
        batches.append(texts)
        return encode_batch(self, texts)

    monkeypatch.setattr(ByteTokenizer, "encode_batch", spy)
    store = prepare_store(
        tmp_path / "store", source="text", path=pattern, documents="lines", batch_size=7
    )
    check_documents(store, [(line,) for line in lines])
    assert [t for batch in batches for t in batch] == lines
    assert max(map(len, batches)) == 7
    # A batch closes with the text that takes it to BATCH_CHARS or beyond.
    assert all(sum(map(len, batch[:-1])) < 100 for batch in batches)
    assert any(len(batch) < 7 for batch in batches[:-1])


def test_a_manifest_naming_other_files_is_refused(corpus, tmp_path):
    pattern, _ = corpus
    out = tmp_path / "store"
    prepare_store(out, source="text", path=pattern, documents="lines")
    manifest = json.loads((out / "manifest.json").read_text())
    for change in (
        {"fields": {"../text": manifest["fields"]["text"]}},
        {"fields": {"text": {**manifest["fields"]["text"], "dtype": "object"}}},
        {"tokenizer": {**manifest["tokenizer"], "files": {"../../a.txt": {}}}},
        {"documents": "many"},
    ):
        (out / "manifest.json").write_text(json.dumps({**manifest, **change}))
        with pytest.raises(ValueError, match="manifest.json: not a valid store manifest"):
            open_store(out)


def test_ids_of_a_vocabulary_over_65536_are_stored_as_uint32(tmp_path):
    words = [f"w{i}" for i in range(70_000)]
    tokenizer = WordTokenizer([*SPECIAL_TOKENS, *words])
    (tmp_path / "a.txt").write_text("w69999 w1\nw65532 w65531 w0\n")
    store = prepare_store(
        tmp_path / "s", source="text", path=str(tmp_path / "a.txt"), tokenizer=tokenizer
    )
    assert store.documents.tokens["text"].dtype == np.uint32
    assert store.documents.tokens["text"].tolist() == [70_003, 5, 65_536, 65_535, 4]
    assert open_store(tmp_path / "s").manifest["fields"]["text"]["dtype"] == "uint32"


def test_a_prepare_that_finishes_second_opens_the_first_ones_store(corpus, tmp_path, monkeypatch):
    pattern, lines = corpus
    first = prepare_store(tmp_path / "first", source="text", path=pattern, documents="lines")
    rename = os.rename

    def race(partial, out):  # another process renames its store into place just before
        shutil.copytree(first.path, out)
        rename(partial, out)

    monkeypatch.setattr(store_module.os, "rename", race)
    store = prepare_store(tmp_path / "store", source="text", path=pattern, documents="lines")
    check_documents(store, [(line,) for line in lines])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "first", "store"]
