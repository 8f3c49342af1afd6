"""The corpus, tokenizer names and trained models shared by the tokenizer tests."""

import sentencepiece

from flaxformer_lite.data import tokenizers as tk

CORPUS = [
    "the quick brown fox jumps over the lazy dog.",
    "pack my box with five dozen liquor jugs!",
    "sphinx of black quartz, judge my vow.",
    "the five boxing wizards jump quickly",
    "héllo wörld: naïve café, façade, jalapeño",
    "日本語のテキストも少し",
] * 20
NAMES = ("byte", "char", "word", "bpe", "sentencepiece")


def train_sentencepiece(directory, **ids):
    """A SentencePiece model of CORPUS in ``directory`` (``ids``: its special ids)."""
    prefix = directory / "spm"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_prefix=str(prefix),
        vocab_size=60,
        hard_vocab_limit=False,  # The corpus is too small to guarantee exactly 60 pieces.
        minloglevel=2,
        **ids,
    )
    return prefix.with_suffix(".model")


def train_bpe():
    return tk.BpeTokenizer.train(CORPUS, vocab_size=300)


def builder(spm_model, bpe):
    """Builds any tokenizer by name from CORPUS (``bpe``: the one trained already)."""

    def build(name):
        if name == "bpe":
            return bpe
        return tk.make_tokenizer(name, texts=CORPUS, vocab_size=300, path=spm_model)

    return build
