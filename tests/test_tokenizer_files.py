"""Tests for flaxformer_lite.data.tokenizers: saved tokenizers' files, and the errors of bad
arguments and bad files, each naming what is wrong."""

import json

import pytest
import sentencepiece
from tokenizer_cases import CORPUS, NAMES, builder, train_bpe, train_sentencepiece

from flaxformer_lite.data import tokenizers as tk
from flaxformer_lite.data.sentencepiece_tokenizer import SentencePieceTokenizer


@pytest.fixture(scope="module")
def spm_default(tmp_path_factory):
    """A model with SentencePiece's default ids: unk=0, bos=1, eos=2, no pad."""
    return train_sentencepiece(tmp_path_factory.mktemp("spm_default"))


@pytest.fixture(scope="module")
def bpe():
    return train_bpe()


@pytest.fixture
def make(spm_default, bpe):
    """Builds any tokenizer from CORPUS (the BPE one is trained once per module)."""
    return builder(spm_default, bpe)


# --- save / load ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_save_load_round_trip(make, name, tmp_path):
    tok = make(name)
    tok.save(tmp_path / "run" / "tokenizer")  # Parents are created.
    loaded = tk.load_tokenizer(tmp_path / "run" / "tokenizer")
    assert type(loaded) is type(tok)
    assert loaded.vocab_size == tok.vocab_size
    text = "the quick café ∑ fox, 日本語!"
    assert loaded.encode(text) == tok.encode(text)
    assert loaded.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    marker = json.loads((tmp_path / "run" / "tokenizer" / tk.NAME_FILE).read_text())
    assert marker == {"kind": name}


def test_saved_files_are_plain(make, tmp_path):
    for name, file in [("char", tk.VOCAB_FILE), ("word", tk.VOCAB_FILE), ("bpe", tk.BPE_FILE)]:
        make(name).save(tmp_path / name)
        json.loads((tmp_path / name / file).read_text(encoding="utf-8"))
    make("sentencepiece").save(tmp_path / "sp")
    model_file = str(tmp_path / "sp" / tk.SENTENCEPIECE_FILE)
    sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
    assert sp.get_piece_size() == make("sentencepiece").vocab_size - 1  # The model has no pad.
    assert sorted(p.name for p in (tmp_path / "word").iterdir()) == [tk.NAME_FILE, tk.VOCAB_FILE]


def test_word_lowercase_survives_save(tmp_path):
    tk.WordTokenizer.fit(["Hello World"], lowercase=True).save(tmp_path)
    assert tk.load_tokenizer(tmp_path).encode("HELLO world") == [4, 5]


def test_nothing_printed(capfd, spm_default, tmp_path):
    capfd.readouterr()
    tok = tk.BpeTokenizer.train(CORPUS, vocab_size=270)
    tok.save(tmp_path / "bpe")
    tk.load_tokenizer(tmp_path / "bpe").decode(tok.encode("the dog"))
    SentencePieceTokenizer(spm_default).save(tmp_path / "sp")
    tk.load_tokenizer(tmp_path / "sp")
    assert capfd.readouterr() == ("", "")


# --- errors -----------------------------------------------------------------------------------


def test_unknown_name_lists_valid_tokenizers():
    with pytest.raises(ValueError, match="unknown tokenizer 'bytes'; valid tokenizers: byte, char"):
        tk.make_tokenizer("bytes")


@pytest.mark.parametrize(
    "name, kwargs, missing",
    [
        ("char", {}, "texts"),
        ("word", {}, "texts"),
        ("bpe", {"vocab_size": 300}, "texts"),
        ("bpe", {"texts": CORPUS}, "vocab_size"),
        ("sentencepiece", {}, "path"),
    ],
)
def test_missing_arguments_are_named(name, kwargs, missing):
    with pytest.raises(ValueError, match=f"'{name}' needs {missing}"):
        tk.make_tokenizer(name, **kwargs)


@pytest.mark.parametrize("name", ["char", "word", "bpe"])
def test_empty_or_bare_string_texts(name):
    with pytest.raises(ValueError, match=f"cannot fit a {name} tokenizer: the texts are empty"):
        tk.make_tokenizer(name, texts=["", ""], vocab_size=300)
    with pytest.raises(TypeError, match="not a single string"):
        tk.make_tokenizer(name, texts="some text", vocab_size=300)


def test_word_size_errors():
    with pytest.raises(ValueError, match="no word is seen 5"):
        tk.WordTokenizer.fit(["a b"], min_count=5)
    with pytest.raises(ValueError, match="word vocab_size must be > 4"):
        tk.make_tokenizer("word", texts=["a b"], vocab_size=4)


def test_sentencepiece_missing_or_corrupt_file_is_named(tmp_path):
    missing = tmp_path / "nope.model"
    with pytest.raises(FileNotFoundError, match="nope.model: file not found"):
        tk.make_tokenizer("sentencepiece", path=missing)
    corrupt = tmp_path / "bad.model"
    corrupt.write_bytes(b"\x00not a protobuf")
    with pytest.raises(ValueError, match="bad.model: not a readable SentencePiece model"):
        tk.make_tokenizer("sentencepiece", path=corrupt)


def test_load_without_marker_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tk.NAME_FILE}: missing"):
        tk.load_tokenizer(tmp_path)


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"", "not valid UTF-8 JSON"),
        (b"{kind: byte", "not valid UTF-8 JSON"),
        (b"\xff\xfe\x00", "not valid UTF-8 JSON"),
        (b'["byte"]', "expected a JSON object, got list"),
        (b'{"kind": "bytes"}', "unknown tokenizer 'bytes'; valid tokenizers: byte, char"),
        (b'{"kind": ["byte"]}', "unknown tokenizer"),
    ],
)
def test_corrupt_marker_is_named(tmp_path, content, reason):
    (tmp_path / tk.NAME_FILE).write_bytes(content)
    with pytest.raises(ValueError, match=f"{tk.NAME_FILE}: {reason}"):
        tk.load_tokenizer(tmp_path)


def test_corrupt_or_missing_bpe_file_is_named(bpe, tmp_path):
    bpe.save(tmp_path)
    path = tmp_path / tk.BPE_FILE
    path.write_text('{"version": "1.0", "model": {"type": "BPE"', encoding="utf-8")
    with pytest.raises(ValueError, match="tokenizer.json: not a valid Hugging Face tokenizer"):
        tk.load_tokenizer(tmp_path)
    path.unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json: file not found"):
        tk.load_tokenizer(tmp_path)


def test_bpe_file_with_other_specials_is_rejected(bpe, tmp_path):
    bpe.save(tmp_path)
    path = tmp_path / tk.BPE_FILE
    path.write_text(path.read_text(encoding="utf-8").replace("<sos>", "<bos>"), encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer.json: .*must have ids 0..3, got \[0, None"):
        tk.load_tokenizer(tmp_path)


@pytest.mark.parametrize(
    "name, vocab, reason",
    [
        ("char", {"itos": ["a", "b"]}, "must start with"),
        ("char", {"itos": [*tk.SPECIAL_TOKENS, "a", "a"]}, "distinct"),
        ("word", {"itos": [*tk.SPECIAL_TOKENS, 5]}, "non-empty strings"),
        ("word", {"itos": list(tk.SPECIAL_TOKENS), "casefold": True}, "unexpected keyword"),
        ("word", {}, "itos"),
    ],
)
def test_corrupt_vocab_is_named(tmp_path, name, vocab, reason):
    (tmp_path / tk.NAME_FILE).write_text(json.dumps({"kind": name}))
    (tmp_path / tk.VOCAB_FILE).write_text(json.dumps(vocab))
    with pytest.raises(ValueError, match=f"vocab.json: not a valid {name} vocabulary .*{reason}"):
        tk.load_tokenizer(tmp_path)
