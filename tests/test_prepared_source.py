"""Training data from prepared stores: ``data.source=prepared``, and text sources prepared into a
cached store on first use (one read path for both)."""

import re

import numpy as np
import pytest

from flaxformer_lite.data.config import DataConfig
from flaxformer_lite.data.pipeline import build_data
from flaxformer_lite.data.store import prepare_store
from flaxformer_lite.data.tasks import TASKS
from flaxformer_lite.data.tokenizers import ByteTokenizer
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.run_dir import RunDir

LINES = [f"line {i} " + "abc"[i % 3] * (i % 11) for i in range(60)]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(LINES) + "\n")
    return path


def build(cfg, run_dir, **kwargs):
    run = RunDir(run_dir)
    return build_data(
        cfg,
        task=TASKS["lm"],
        seed=3,
        batch_size=4,
        directory=run.tokenizer,
        prepared=run.prepared,
        **kwargs,
    )


def take(data, count):
    return [next(data.train) for _ in range(count)]


def assert_same_batches(first, second):
    for a, b in zip(first, second, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize("documents", ["file", "lines"])
@pytest.mark.parametrize("rows", ["documents", "windows"])
def test_a_prepared_store_gives_the_batches_of_its_text_source(tmp_path, corpus, rows, documents):
    store = tmp_path / "store"
    prepare_store(
        store, source="text", path=str(corpus), documents=documents, tokenizer_name="char"
    )
    settings = dict(seq_len=16, packing=True, lm_rows=rows, tokenizer="char")
    text_cfg = DataConfig(source="text", path=str(corpus), text_documents=documents, **settings)
    from_text = build(text_cfg, tmp_path / "a")
    # A prepared store's documents are what it was prepared with (text_documents None).
    from_store = build(DataConfig(source="prepared", path=str(store), **settings), tmp_path / "b")
    assert from_store.tokenizer.same_as(from_text.tokenizer)
    assert_same_batches(take(from_text, 6), take(from_store, 6))
    assert_same_batches(list(from_text.eval_batches()), list(from_store.eval_batches()))
    assert [r["text"] for r in from_store.eval_examples] == [
        r["text"] for r in from_text.eval_examples
    ]
    assert (tmp_path / "b" / "tokenizer" / "tokenizer_kind.json").is_file()  # the run keeps it
    held_out = [r["text"] for r in from_store.eval_examples]
    if documents == "lines":
        assert len(held_out) == 6 and set(held_out) <= set(LINES)
    else:  # the tail of the one file
        text = corpus.read_text()
        assert held_out == [text[int(len(text) * 0.9) :]]
    assert from_store.eval_tokens == sum(len(t) + 1 for t in held_out)


def test_a_prepared_store_of_other_documents_is_refused(tmp_path, corpus):
    store = tmp_path / "store"
    prepare_store(store, source="text", path=str(corpus), documents="lines")
    for documents in ("lines", None):
        cfg = DataConfig(source="prepared", path=str(store), seq_len=16, text_documents=documents)
        build(cfg, tmp_path / f"ok-{documents}")
    cfg = DataConfig(source="prepared", path=str(store), seq_len=16, text_documents="file")
    with pytest.raises(ValueError, match="data.text_documents='file'") as info:
        build(cfg, tmp_path / "run")
    assert str(info.value).startswith(f"{store}: ") and "lines" in str(info.value)


def test_a_text_source_is_prepared_once_per_documents_setting(tmp_path, corpus):
    cfg = DataConfig(source="text", path=str(corpus), seq_len=16, text_documents="lines")
    lines = build(cfg, tmp_path)
    whole = build(DataConfig(source="text", path=str(corpus), seq_len=16), tmp_path)
    stores = sorted(RunDir(tmp_path).prepared.iterdir())
    assert len(stores) == 2  # one store each: never one read as the other
    assert len(lines.eval_examples) == 6 and len(whole.eval_examples) == 1


def test_a_text_source_is_prepared_once_into_the_run_directory(tmp_path, corpus):
    cfg = DataConfig(source="text", path=str(corpus), seq_len=16, tokenizer="char")
    first = build(cfg, tmp_path)
    (store,) = RunDir(tmp_path).prepared.iterdir()
    manifest = store / "manifest.json"
    stamp = manifest.stat().st_mtime_ns
    second = build(cfg, tmp_path)  # a resumed run reads the same store
    assert manifest.stat().st_mtime_ns == stamp
    assert_same_batches(take(first, 3), take(second, 3))


def test_a_store_of_another_tokenizer_is_refused(tmp_path, corpus):
    store = tmp_path / "store"
    prepare_store(store, source="text", path=str(corpus), tokenizer_name="char")
    run = tmp_path / "run"
    ByteTokenizer().save(run / "tokenizer")  # the run was made with bytes
    with pytest.raises(ValueError, match="tokenizer"):
        build(DataConfig(source="prepared", path=str(store), seq_len=16), run)


def test_a_prepared_store_must_fit_the_task(tmp_path):
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("".join(f"source {i}\ttarget {i}\n" for i in range(20)))
    store = tmp_path / "store"
    prepare_store(store, source="parallel", path=str(pairs))
    with pytest.raises(ValueError, match="cannot train on the store"):
        build(DataConfig(source="prepared", path=str(store), seq_len=16), tmp_path / "run")
    data = build_data(
        DataConfig(source="prepared", path=str(store), seq_len=16),
        task=TASKS["seq2seq"],
        seed=0,
        batch_size=2,
        directory=tmp_path / "run2" / "tokenizer",
    )
    batch = next(data.train)
    assert batch["src"].shape == (2, 16) and batch["targets"].shape == (2, 16)
    assert all({"source", "target"} <= set(r) for r in data.eval_examples)


def test_a_missing_or_unfinished_store_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere: no prepared store"):
        build(DataConfig(source="prepared", path=str(tmp_path / "nowhere")), tmp_path)
    (tmp_path / "unfinished").mkdir()  # what an interrupted prepare would leave, at most
    with pytest.raises(ValueError, match="manifest.json"):
        build(DataConfig(source="prepared", path=str(tmp_path / "unfinished")), tmp_path)


def test_validation_texts_are_the_stores_even_when_the_source_changed(tmp_path, corpus):
    store = tmp_path / "store"
    prepare_store(store, source="text", path=str(corpus), documents="lines", tokenizer_name="byte")
    cfg = DataConfig(source="prepared", path=str(store), seq_len=16)
    expected = [r["text"] for r in build(cfg, tmp_path / "a").eval_examples]
    assert set(expected) <= set(LINES)
    corpus.write_text("\n".join(f"other {i}" for i in range(len(LINES))) + "\n")  # same count
    assert [r["text"] for r in build(cfg, tmp_path / "b").eval_examples] == expected


def test_a_tokenizer_setting_other_than_the_stores_is_refused(tmp_path, corpus, capsys):
    from flaxformer_lite.cli.train import train_main

    store = tmp_path / "store"
    prepare_store(store, source="text", path=str(corpus), tokenizer_name="bpe", vocab_size=300)
    for name in ("char", "byte"):
        cfg = DataConfig(source="prepared", path=str(store), seq_len=16, tokenizer=name)
        message = (
            f"{store}: the store's tokenizer is 'bpe'; data.tokenizer says {name!r}: drop the "
            "setting (data.tokenizer=null) or set it to 'bpe'"
        )
        with pytest.raises(ValueError, match=re.escape(message)):
            build(cfg, tmp_path / name)
    for setting in (None, "bpe"):  # not set: the store's
        cfg = DataConfig(source="prepared", path=str(store), seq_len=16, tokenizer=setting)
        data = build(cfg, tmp_path / str(setting))
        data.train.close()
        assert data.tokenizer.name == "bpe"
    run_dir = tmp_path / "run"
    overrides = ["data.source=prepared", f"data.path={store}", "data.tokenizer=char"]
    assert train_main([f"run_dir={run_dir}", *overrides]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {message.replace('byte', 'char')}"]
    assert not run_dir.exists()
    # A file source's tokenizer is byte unless set; a store brings its own.
    assert DataConfig(source="text", path="a.txt").tokenizer == "byte"
    assert load_config(None, ["data.source=text", "data.path=a.txt"]).data.tokenizer == "byte"
    assert load_config(None, ["data.source=prepared", f"data.path={store}"]).data.tokenizer is None
