"""Tests for flaxformer_lite.data.tokenizers: layout, round trips, fitting and batched encoding
(their files and errors: test_tokenizer_files.py)."""

import json
import random

import numpy as np
import pytest
import sentencepiece
from tokenizer_cases import CORPUS, NAMES, builder, train_bpe, train_sentencepiece

from flaxformer_lite.data import tokenizers as tk
from flaxformer_lite.data.sentencepiece_tokenizer import SentencePieceTokenizer
from flaxformer_lite.data.text_pieces import text_pieces


@pytest.fixture(scope="module")
def spm_default(tmp_path_factory):
    """A model with SentencePiece's default ids: unk=0, bos=1, eos=2, no pad."""
    return train_sentencepiece(tmp_path_factory.mktemp("spm_default"))


@pytest.fixture(scope="module")
def spm_aligned(tmp_path_factory):
    """A model trained with the library's layout: pad=0, bos=1, eos=2, unk=3."""
    directory = tmp_path_factory.mktemp("spm_aligned")
    return train_sentencepiece(directory, pad_id=0, bos_id=1, eos_id=2, unk_id=3)


@pytest.fixture(scope="module")
def bpe():
    return train_bpe()


@pytest.fixture
def make(spm_default, bpe):
    """Builds any tokenizer from CORPUS (the BPE one is trained once per module)."""
    return builder(spm_default, bpe)


# --- shared layout and interface -------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_special_id_layout(make, name):
    tok = make(name)
    assert (tok.pad_id, tok.sos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.name == name
    ids = tok.encode("the quick brown fox jumps over the lazy dog.")
    assert ids and all(tk.NUM_SPECIAL <= i < tok.vocab_size for i in ids)


@pytest.mark.parametrize("name", NAMES)
def test_decode_skips_specials_and_accepts_arrays(make, name):
    tok = make(name)
    ids = tok.encode("judge my vow")
    expected = tok.decode(ids)
    assert tok.decode([tok.sos_id, *ids, tok.eos_id, tok.pad_id, tok.pad_id]) == expected
    assert tok.decode(np.array(ids, dtype=np.int32)) == expected
    assert tok.decode([tok.unk_id, tok.pad_id]) == ""


@pytest.mark.parametrize("name", NAMES)
def test_decode_rejects_bad_ids(make, name):
    tok = make(name)
    with pytest.raises(ValueError, match=f"token id {tok.vocab_size} is outside"):
        tok.decode([5, tok.vocab_size])
    with pytest.raises(ValueError, match="token id -1"):
        tok.decode([-1])
    with pytest.raises(ValueError, match=r"one sequence of ids \[T\]"):
        tok.decode([[5, 6]])


@pytest.mark.parametrize("name", ["byte", "char", "bpe", "sentencepiece"])
def test_round_trip(make, name):
    """Text made of training characters and single spaces survives every lossless tokenizer."""
    tok = make(name)
    for text in ["the lazy dog jumps.", "naïve café, jalapeño 日本語", ""]:
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("name", ["byte", "bpe"])
def test_round_trip_any_text(make, name):
    """Byte-level tokenizers have no unknowns and keep whitespace: any string comes back exactly."""
    tok = make(name)
    for text in ["Ünïcödé ✓ 🎉 Ελληνικά 中文 \x00 end", "  spaces\tand\n\nnewlines  ", " "]:
        assert tk.UNK_ID not in tok.encode(text)
        assert tok.decode(tok.encode(text)) == text


# --- byte -------------------------------------------------------------------------------------


def test_byte_ids_are_utf8_offset_by_specials():
    tok = tk.ByteTokenizer()
    assert tok.vocab_size == 260
    assert tok.encode("é") == [0xC3 + 4, 0xA9 + 4]
    assert tok.encode("\x00") == [4]
    assert tok.decode([0xC3 + 4]) == "\ufffd"  # A truncated sequence is replaced, not raised.


# --- char -------------------------------------------------------------------------------------


def test_char_vocabulary_sorted_and_deterministic():
    tok = tk.CharTokenizer.fit(["bca", "ab"])
    assert tok.itos == ["<pad>", "<sos>", "<eos>", "<unk>", "a", "b", "c"]
    shuffled = random.Random(0).sample(CORPUS, len(CORPUS))
    assert tk.CharTokenizer.fit(shuffled).itos == tk.CharTokenizer.fit(CORPUS).itos


def test_char_unknown_maps_to_unk():
    tok = tk.CharTokenizer.fit(["abc"])
    assert tok.encode("axc") == [4, tk.UNK_ID, 6]
    assert tok.decode(tok.encode("axc")) == "ac"
    # Text spelling a special token is ordinary characters, never the special id.
    assert tk.CharTokenizer.fit(["<pad>"]).encode("<pad>") == [4, 8, 6, 7, 5]  # <, >, a, d, p


# --- word -------------------------------------------------------------------------------------


def test_word_vocabulary_order_and_ties():
    tok = tk.WordTokenizer.fit(["b a c a", "b d a"])
    # a x3, b x2, then the ties c and d in code-point order.
    assert tok.itos == ["<pad>", "<sos>", "<eos>", "<unk>", "a", "b", "c", "d"]
    shuffled = random.Random(1).sample(CORPUS, len(CORPUS))
    assert tk.WordTokenizer.fit(shuffled).itos == tk.WordTokenizer.fit(CORPUS).itos


def test_word_split_unknowns_and_lossy_decode():
    tok = tk.WordTokenizer.fit(["Hi, there! hi"])
    assert tok.itos[4:] == ["!", ",", "Hi", "hi", "there"]
    ids = tok.encode("Hi, there! Bye")
    assert ids == [6, 5, 8, 4, tk.UNK_ID]
    assert tok.decode(ids) == "Hi , there !"


def test_word_min_count_max_size_lowercase():
    texts = ["a a a b b c", "A B"]
    assert tk.WordTokenizer.fit(texts, min_count=2).itos[4:] == ["a", "b"]
    assert tk.WordTokenizer.fit(texts, max_size=1).itos[4:] == ["a"]
    lower = tk.WordTokenizer.fit(texts, lowercase=True)
    assert lower.itos[4:] == ["a", "b", "c"]
    assert lower.encode("A b") == [4, 5]
    assert tk.make_tokenizer("word", texts=texts, vocab_size=6).vocab_size == 6


# --- bpe --------------------------------------------------------------------------------------


def test_bpe_vocab_size_and_merges(bpe):
    assert bpe.vocab_size == 300
    assert bpe.hf_tokenizer.get_vocab_size() == 300
    for word in ["the", "quick", "jumps"]:
        assert len(bpe.encode(word)) < len(word.encode())
    assert [bpe.hf_tokenizer.id_to_token(i) for i in range(4)] == list(tk.SPECIAL_TOKENS)


def test_bpe_training_is_deterministic(bpe):
    again = tk.BpeTokenizer.train(iter(CORPUS), vocab_size=300)  # Any iterator works.
    assert again.hf_tokenizer.get_vocab() == bpe.hf_tokenizer.get_vocab()


def test_bpe_rejects_vocab_smaller_than_bytes():
    with pytest.raises(ValueError, match="vocab_size must be >= 260"):
        tk.BpeTokenizer.train(CORPUS, vocab_size=100)


# --- sentencepiece ----------------------------------------------------------------------------


def test_sentencepiece_default_layout_is_remapped(spm_default):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_default))
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, -1)
    tok = SentencePieceTokenizer(spm_default)
    # Model ids 0..2 are specials; its regular pieces 3.. become ours 4.. (the model has no pad).
    assert tok.vocab_size == sp.get_piece_size() + 1
    assert tok.encode("the fox") == [i + 1 for i in sp.encode("the fox")]
    ids = tok.encode("the ∑ fox")  # "∑" never occurs in the corpus.
    assert tk.UNK_ID in ids
    assert tok.decode(ids) == "the  fox"


def test_sentencepiece_aligned_layout_maps_onto_itself(spm_aligned):
    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_aligned))
    tok = SentencePieceTokenizer(spm_aligned)
    assert tok.vocab_size == sp.get_piece_size()
    assert tok.encode("the lazy ∑ dog") == sp.encode("the lazy ∑ dog")


# --- batched encoding -------------------------------------------------------------------------

BATCH = ["", "the quick brown fox.", " ", "héllo wörld ∑ 🎉", "", "日本語のテキスト", "a\tb  c\r"]


def _hf_tokenizers(bpe, spm_default):
    """A checkpoint tokenizer of each layout: tokenizer.json, and Marian's three files."""
    from flaxformer_lite.data.hf_tokenizer import HfTokenizer

    specials = {"pad": 0, "sos": 1, "eos": 2, "unk": 3, "bos": None}
    json_tok = HfTokenizer({"tokenizer.json": bpe.hf_tokenizer.to_str().encode()}, specials, False)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_default))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    model = spm_default.read_bytes()
    files = {"source.spm": model, "target.spm": model, "vocab.json": json.dumps(vocab).encode()}
    marian = HfTokenizer(files, {**specials, "pad": 1, "sos": 1, "unk": 0}, False)
    return json_tok, marian


@pytest.mark.parametrize("name", NAMES)
def test_encode_batch_equals_encode_of_each(make, name):
    tok = make(name)
    texts = BATCH + CORPUS[:6]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert tok.encode_target_batch(texts) == [tok.encode_target(t) for t in texts]
    assert tok.encode_batch([]) == []
    assert tok.encode_batch(("", "")) == [[], []]  # any sequence, empty texts kept


def test_hf_encode_batch_equals_encode_of_each(bpe, spm_default):
    texts = BATCH + CORPUS[:6]
    for tok in _hf_tokenizers(bpe, spm_default):
        assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
        assert tok.encode_target_batch(texts) == [tok.encode_target(t) for t in texts]
        assert tok.encode_batch([]) == []


def test_batched_encoders_are_the_libraries_batched_ones(make, monkeypatch):
    """BPE and SentencePiece hand the whole list to their library's batched encoder once."""
    calls = []
    bpe, sp = make("bpe"), make("sentencepiece")
    bpe_batch, sp_encode = bpe.hf_tokenizer.encode_batch, sp.sp.encode

    class Spy:
        def __init__(self, wrapped):
            self.wrapped = wrapped

        def __getattr__(self, name):
            return getattr(self.wrapped, name)

        def encode_batch(self, texts, **kwargs):
            calls.append(("bpe", len(texts), kwargs))
            return bpe_batch(texts, **kwargs)

        encode_batch_fast = encode_batch  # the same ids, without offsets into the text

        def encode(self, texts, **kwargs):
            calls.append(("sp", len(texts), kwargs))
            return sp_encode(texts, **kwargs)

    monkeypatch.setattr(bpe, "hf_tokenizer", Spy(bpe.hf_tokenizer))
    monkeypatch.setattr(sp, "sp", Spy(sp.sp))
    bpe.encode_batch(BATCH)
    sp.encode_batch(BATCH)
    assert [call[:2] for call in calls] == [("bpe", len(BATCH)), ("sp", len(BATCH))]
    assert calls[0][2] == {"add_special_tokens": False} and "num_threads" in calls[1][2]


def test_long_texts_are_encoded_in_pieces_with_the_whole_texts_ids():
    """Cut before a space that follows a non-space, byte-level BPE's pre-tokenizer splits the
    same: the pieces' ids are those of the whole text (the library encoding it at once)."""
    rng = random.Random(0)
    words = ["alpha", "beta", "x", "yy", "  ", "\t", "it's", "42", "!?", "\n", "é"]
    text = " ".join(rng.choice(words) for _ in range(6000))
    tok = tk.BpeTokenizer.train([text[:3000]], 300)
    pieces = text_pieces(text, 500)
    assert len(pieces) > 20 and "".join(pieces) == text
    assert all(len(p) <= 500 for p in pieces)
    assert tok.encode(text) == tok.hf_tokenizer.encode(text, add_special_tokens=False).ids
    assert tok.encode_batch([text, "", "beta"]) == [tok.encode(text), [], tok.encode("beta")]


def test_fitting_bpe_on_one_long_text_warns_only_of_runs_without_spaces(caplog):
    """Issue 45 item 9: a single-file corpus is one long text, cut at spaces as BPE splits it
    anyway: nothing to say. A run longer than a piece without a space is cut inside."""
    words = ("to be or not to be, that is the question. " * 200).strip()
    with caplog.at_level("WARNING", logger="flaxformer_lite"):
        tk.BpeTokenizer.train([words], 300)
        assert caplog.records == []
        tk.BpeTokenizer.train([words + " " + "x" * 5000], 300)
    (record,) = caplog.records
    assert record.getMessage() == (
        "fitting BPE: 1 texts hold over 4096 characters without a space, fitted as words of at "
        "most that length"
    )


def test_a_line_without_spaces_is_cut_every_max_chars_and_bpe_fits_it():
    line = "abcdefgh" * 2000
    pieces = text_pieces(line, 1000)
    assert [len(p) for p in pieces] == [1000] * 16 and "".join(pieces) == line
    tok = tk.BpeTokenizer.train([line], 300)  # quadratic in the line's length if fitted whole
    assert tok.decode(tok.encode(line)) == line
