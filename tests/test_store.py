"""Prepared token stores (``data.store``): exact round trips, no-op re-runs, interrupted
prepares, refused stores, bounded memory."""

import hashlib
import json

import pytest
import sentencepiece
from store_cases import FITTED, all_files, check_documents, make_corpus, make_lines

from flaxformer_lite.data import tokenizers
from flaxformer_lite.data.documents import split_documents
from flaxformer_lite.data.store import check_tokenizer, open_store, prepare_store, text_documents
from flaxformer_lite.data.tokenizers import (
    BpeTokenizer,
    make_tokenizer,
)


@pytest.fixture
def corpus(tmp_path):
    return make_corpus(tmp_path)


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    prefix = tmp_path_factory.mktemp("spm") / "spm"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(make_lines(300, seed=1)),
        model_prefix=str(prefix),
        vocab_size=40,
        hard_vocab_limit=False,  # The corpus is too small to guarantee exactly 40 pieces.
        minloglevel=2,
    )
    return prefix.with_suffix(".model")


def settings(name, spm_model=None):
    return {
        "tokenizer_name": name,
        "vocab_size": 300 if name == "bpe" else None,
        "tokenizer_path": spm_model if name == "sentencepiece" else None,
    }


@pytest.mark.parametrize("name", ["byte", *FITTED, "sentencepiece"])
def test_a_store_round_trips_every_document(corpus, tmp_path, spm_model, name):
    pattern, lines = corpus
    store = prepare_store(
        tmp_path / "store",
        source="text",
        path=pattern,
        documents="lines",
        batch_size=16,
        **settings(name, spm_model),
    )
    check_documents(store, [(line,) for line in lines])
    assert store.tokenizer.name == name
    reopened = open_store(tmp_path / "store")
    assert reopened.manifest == store.manifest and reopened.tokenizer.same_as(store.tokenizer)
    if name in FITTED:  # fitted on the training documents only, as split_documents holds out
        train, valid = split_documents(store.documents.digests, 0.1, pattern)
        assert len(valid) == round(0.1 * len(lines))
        fitted = make_tokenizer(name, texts=[lines[i] for i in train], vocab_size=300)
        assert fitted.same_as(store.tokenizer)
        assert not make_tokenizer(name, texts=lines, vocab_size=300).same_as(store.tokenizer)


@pytest.mark.parametrize("name", ["byte", "word"])
def test_the_manifest_records_exactly_the_files_read(corpus, tmp_path, monkeypatch, name):
    """Each source file's size and sha256 (hashed while the first pass reads it); a file that
    the glob matches only once the prepare has started is neither read nor recorded."""
    pattern, lines = corpus
    files = sorted(tmp_path.glob("*.txt"))
    make = tokenizers.make_tokenizer

    def make_and_add_a_file(*args, **kwargs):
        (tmp_path / "c.txt").write_text("a late line\n")
        return make(*args, **kwargs)

    monkeypatch.setattr(tokenizers, "make_tokenizer", make_and_add_a_file)
    store = prepare_store(
        tmp_path / "store", source="text", path=pattern, documents="lines", tokenizer_name=name
    )
    assert (tmp_path / "c.txt").is_file()
    recorded = [
        {
            "path": str(p),
            "size": p.stat().st_size,
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
        }
        for p in files
    ]
    assert store.manifest["source"]["files"] == recorded
    check_documents(store, [(line,) for line in lines])


@pytest.mark.parametrize("layout", ["tsv", "pair"])
def test_parallel_sources_store_source_and_target(tmp_path, layout):
    sources_, targets = make_lines(40, seed=2), make_lines(40, seed=3)
    targets[5] = ""  # one side may be blank
    if layout == "tsv":
        rows = [f"{s}\t{t}" for s, t in zip(sources_, targets, strict=True)]
        (tmp_path / "pairs.tsv").write_text("\n".join(rows) + "\n")
        path = str(tmp_path / "pairs.tsv")
    else:
        (tmp_path / "src.txt").write_text("\n".join(sources_) + "\n")
        (tmp_path / "tgt.txt").write_text("\n".join(targets) + "\n")
        path = f"{tmp_path / 'src.txt'},{tmp_path / 'tgt.txt'}"
    store = prepare_store(tmp_path / "store", source="parallel", path=path, tokenizer_name="word")
    assert store.documents.fields == ("source", "target")
    check_documents(store, list(zip(sources_, targets, strict=True)), ("source", "target"))
    assert [f["path"] for f in store.manifest["source"]["files"]] == path.split(",")


def test_jsonl_sources_store_the_named_field(tmp_path):
    lines = make_lines(30, seed=4)
    rows = [json.dumps({"id": i, "body": line}, ensure_ascii=False) for i, line in enumerate(lines)]
    (tmp_path / "data.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    path = str(tmp_path / "data.jsonl")
    store = prepare_store(tmp_path / "store", source="jsonl", path=path, field="body")
    check_documents(store, [(line,) for line in lines])
    assert store.manifest["source"]["field"] == "body"
    with pytest.raises(ValueError, match="other inputs"):
        prepare_store(tmp_path / "store", source="jsonl", path=path, field="id")


def test_a_given_tokenizer_is_used_and_saved(corpus, tmp_path):
    pattern, lines = corpus
    bpe = BpeTokenizer.train(lines, vocab_size=280)
    store = prepare_store(
        tmp_path / "store", source="text", path=pattern, documents="lines", tokenizer=bpe
    )
    check_documents(store, [(line,) for line in lines])
    assert store.tokenizer.same_as(bpe) and store.manifest["tokenizer"]["fitted"] is None
    check_tokenizer(store, bpe)
    other = BpeTokenizer.train(lines, vocab_size=270)
    with pytest.raises(ValueError, match="another tokenizer") as info:
        check_tokenizer(store, other)
    assert str(tmp_path / "store" / "tokenizer") in str(info.value)
    assert "tokenizer.json" in str(info.value)
    with pytest.raises(ValueError, match="other inputs .*another tokenizer's files"):
        prepare_store(
            tmp_path / "store", source="text", path=pattern, documents="lines", tokenizer=other
        )


def test_preparing_again_is_a_no_op(corpus, tmp_path):
    pattern, _ = corpus
    first = prepare_store(
        tmp_path / "store", source="text", path=pattern, documents="lines", **settings("bpe")
    )
    before = all_files(tmp_path)
    again = prepare_store(
        tmp_path / "store", source="text", path=pattern, documents="lines", **settings("bpe")
    )
    assert all_files(tmp_path) == before  # nothing written, nothing left beside the store
    assert again.manifest == first.manifest
    # The split a byte store is prepared with does not matter: it fits nothing.
    prepare_store(tmp_path / "bytes", source="text", path=pattern, documents="lines")
    before = all_files(tmp_path)
    prepare_store(
        tmp_path / "bytes", source="text", path=pattern, documents="lines", validation_fraction=0.3
    )
    assert all_files(tmp_path) == before


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"tokenizer_name": "char"}, "a 'bpe' tokenizer, not 'char'"),
        ({"vocab_size": 290}, "fitted with"),
        ({"validation_fraction": 0.2}, "fitted with"),
        ({"source": "jsonl"}, "source 'text'"),
        ({"documents": "file"}, "'lines' documents, not 'file'"),
        ({"documents": "paragraphs"}, "'lines' documents, not 'paragraphs'"),
        ({"edit": "b.txt"}, "b.txt differs"),  # the same size, other bytes
        ({"edit": "c.txt"}, "2 source files, not 3"),
    ],
)
def test_a_store_of_other_inputs_is_refused_and_kept(corpus, tmp_path, change, reason):
    pattern, _ = corpus
    out = tmp_path / "store"
    prepare_store(out, source="text", path=pattern, documents="lines", **settings("bpe"))
    before = all_files(out)
    kwargs = {"source": "text", "path": pattern, "documents": "lines", **settings("bpe")}
    if "edit" in change:
        path = tmp_path / change.pop("edit")
        content = path.read_bytes() if path.exists() else b"more\n"
        path.write_bytes(content.replace(b"a", b"e"))
    with pytest.raises(ValueError, match=reason) as info:
        prepare_store(out, **{**kwargs, **change})
    assert f"{out}: holds a store of other inputs" in str(info.value)
    assert all_files(out) == before


def test_a_directory_that_is_not_a_store_is_never_overwritten(corpus, tmp_path):
    pattern, _ = corpus
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=f"{tmp_path / 'out'}: exists and is not a prepared store"):
        prepare_store(tmp_path / "out", source="text", path=pattern, documents="lines")
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()  # an empty directory is filled
    assert (
        len(
            prepare_store(
                tmp_path / "empty", source="text", path=pattern, documents="lines"
            ).documents
        )
        == 120
    )


def test_file_documents_keep_each_file_whole_and_fit_on_its_head(corpus, tmp_path):
    pattern, _ = corpus
    files = sorted(tmp_path.glob("*.txt"))
    texts = [p.read_bytes().decode("utf-8") for p in files]  # CRLF and blank lines as they are
    store = prepare_store(tmp_path / "store", source="text", path=pattern, tokenizer_name="char")
    check_documents(store, [(text,) for text in texts])
    assert store.manifest["source"]["documents"] == "file"  # the default
    assert text_documents(store.manifest) == "file"
    # Fitted on the training part of each file: its head, by characters (the tails hold out).
    heads = [text[: int(len(text) * 0.9)] for text in texts]
    assert make_tokenizer("char", texts=heads).same_as(store.tokenizer)
    assert not make_tokenizer("char", texts=texts).same_as(store.tokenizer)
    assert "\n" in store.tokenizer.itos  # a line break is a character like any other
    assert "\r" not in store.tokenizer.itos  # a.txt's only one ends it: in the held-out tail
    # With no validation fraction (the validation data come from elsewhere), on all of it.
    whole = prepare_store(
        tmp_path / "whole",
        source="text",
        path=pattern,
        tokenizer_name="char",
        validation_fraction=None,
    )
    assert make_tokenizer("char", texts=texts).same_as(whole.tokenizer)


def test_paragraph_documents_are_split_on_blank_lines(corpus, tmp_path):
    pattern, lines = corpus  # a.txt: a blank line after each line; b.txt: none
    store = prepare_store(
        tmp_path / "store", source="text", path=pattern, documents="paragraphs", **settings("word")
    )
    check_documents(store, [(line,) for line in lines[:70]] + [("\n".join(lines[70:]),)])
    assert text_documents(store.manifest) == "paragraphs"
    train, _ = split_documents(store.documents.digests, 0.1, pattern)  # split as lines are
    texts = [*lines[:70], "\n".join(lines[70:])]
    assert make_tokenizer("word", texts=[texts[i] for i in train]).same_as(store.tokenizer)


def test_a_manifest_from_before_the_documents_setting_reads_as_lines(corpus, tmp_path):
    pattern, _ = corpus
    out = tmp_path / "store"
    made = prepare_store(out, source="text", path=pattern, documents="lines")
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["source"]["documents"]
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    before = all_files(tmp_path)
    assert text_documents(open_store(out).manifest) == "lines"
    again = prepare_store(out, source="text", path=pattern, documents="lines")  # a no-op
    assert all_files(tmp_path) == before and len(again.documents) == len(made.documents)
    with pytest.raises(ValueError, match="'lines' documents, not 'file'"):
        prepare_store(out, source="text", path=pattern)
    assert all_files(tmp_path) == before
