"""Tokenizers: byte, character, word, BPE (Hugging Face ``tokenizers``) and SentencePiece.

Every tokenizer shares one id layout, so the data pipeline and the models never ask which one
they hold::

    0 <pad>   1 <sos>   2 <eos>   3 <unk>   4.. regular tokens

``pad_id == 0`` lets a zero-filled batch be all padding, and reserving ``<unk>`` even where a
tokenizer can never produce it (byte, byte-level BPE) keeps ``unk_id`` one constant. The one
exception is a Hugging Face checkpoint's tokenizer (:mod:`flaxformer_lite.data.hf_tokenizer`),
which keeps the checkpoint's ids: code that adds specials reads ``tokenizer.sos_id`` etc. ``encode``
adds no specials (the pipeline adds ``<sos>``/``<eos>``); ``decode`` drops all four.

``save(directory)`` writes plain files only (JSON, ``tokenizer.json``, a ``.model`` protobuf) plus
a marker ``tokenizer_kind.json``; :func:`load_tokenizer` reads back whichever was saved.
Nothing here prints, downloads or unpickles. Bad files raise ``FileNotFoundError`` or
``ValueError`` whose message starts with the offending path.
"""

from __future__ import annotations

import abc
import collections
import itertools
import json
import logging
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np

from flaxformer_lite.data.hf_tokenizer import HfTokenizer
from flaxformer_lite.data.sentencepiece_tokenizer import SENTENCEPIECE_FILE, SentencePieceTokenizer
from flaxformer_lite.data.text_pieces import BPE_PIECE_CHARS, PieceCounter
from flaxformer_lite.data.tokenizer_base import (
    EOS_ID,
    NAME_FILE,
    NUM_SPECIAL,
    PAD_ID,
    SOS_ID,
    SPECIAL_TOKENS,
    UNK_ID,
    Tokenizer,
    read_json_object,
    require_file,
)
from flaxformer_lite.registry import Registry

VOCAB_FILE = "vocab.json"
BPE_FILE = "tokenizer.json"

_WORD_RE = re.compile(r"\w+|[^\w\s]")
logger = logging.getLogger(__name__)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes: byte ``b`` is id ``b + NUM_SPECIAL``; vocabulary 260. Needs no files."""

    name = "byte"
    vocab_size = 256 + NUM_SPECIAL
    covers_all_text = True

    def encode(self, text: str) -> list[int]:
        return [b + NUM_SPECIAL for b in text.encode("utf-8")]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # One array op over all the texts' bytes end to end, then cut at their offsets.
        data = [text.encode("utf-8") for text in texts]
        ids = (np.frombuffer(b"".join(data), np.uint8).astype(np.int64) + NUM_SPECIAL).tolist()
        ends = itertools.accumulate(map(len, data))
        return [ids[end - len(d) : end] for d, end in zip(data, ends, strict=True)]

    def _decode_regular(self, ids: list[int]) -> str:
        # Sampled ids need not form valid UTF-8; broken sequences become U+FFFD.
        return bytes(i - NUM_SPECIAL for i in ids).decode("utf-8", errors="replace")


class _VocabTokenizer(Tokenizer):
    """A classic ``itos`` list (specials first) and its inverse ``stoi``; saved as vocab.json."""

    separator: ClassVar[str]  # What decode puts between tokens.

    def __init__(self, itos: Sequence[str]):
        itos = list(itos)
        if tuple(itos[:NUM_SPECIAL]) != SPECIAL_TOKENS:
            raise ValueError(f"vocabulary must start with {list(SPECIAL_TOKENS)}")
        if not all(isinstance(t, str) and t for t in itos) or len(set(itos)) != len(itos):
            raise ValueError("vocabulary entries must be distinct, non-empty strings")
        self.itos = itos
        # Specials stay out of stoi so that text can never encode to them.
        self.stoi = {t: i for i, t in enumerate(itos) if i >= NUM_SPECIAL}

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        return [self.stoi.get(t, UNK_ID) for t in self._split(text)]

    def _decode_regular(self, ids: list[int]) -> str:
        return self.separator.join(self.itos[i] for i in ids)

    def _files(self) -> dict[str, bytes]:
        return {VOCAB_FILE: json.dumps(self._state(), ensure_ascii=False, indent=0).encode()}

    @classmethod
    def _load_files(cls, directory: Path) -> _VocabTokenizer:
        path = directory / VOCAB_FILE
        try:
            return cls(**read_json_object(path))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: not a valid {cls.name} vocabulary ({e})") from None

    def _state(self) -> dict:
        return {"itos": self.itos}

    @abc.abstractmethod
    def _split(self, text: str) -> list[str]: ...


class CharTokenizer(_VocabTokenizer):
    """One id per character; characters unseen by :meth:`fit` encode to ``<unk>``."""

    name = "char"
    separator = ""
    fitted = True

    @classmethod
    def made(cls, *, texts=None, vocab_size=None, path=None) -> CharTokenizer:
        return cls.fit(texts)

    @classmethod
    def fit(cls, texts: Iterable[str]) -> CharTokenizer:
        """Vocabulary of every character in ``texts``, sorted by code point (deterministic)."""
        chars = set()
        for text in _nonempty_texts(texts, cls.name):
            chars.update(text)
        return cls([*SPECIAL_TOKENS, *sorted(chars)])

    def _split(self, text: str) -> list[str]:
        return list(text)


class WordTokenizer(_VocabTokenizer):
    """Word-level vocabulary, split by the regex ``\\w+|[^\\w\\s]``.

    Words are runs of letters, digits and ``_``; each punctuation mark is its own token; whitespace
    separates tokens and is dropped. ``decode`` joins tokens with single spaces, so it is lossy:
    ``"Hi, there!"`` comes back as ``"Hi , there !"`` (lowercased if ``lowercase``).
    """

    name = "word"
    separator = " "
    fitted = True

    @classmethod
    def made(cls, *, texts=None, vocab_size=None, path=None) -> WordTokenizer:
        """Capped at ``vocab_size`` ids, specials included, if given."""
        if vocab_size is not None and vocab_size <= NUM_SPECIAL:
            raise ValueError(f"word vocab_size must be > {NUM_SPECIAL}, got {vocab_size}")
        return cls.fit(texts, max_size=None if vocab_size is None else vocab_size - NUM_SPECIAL)

    def __init__(self, itos: Sequence[str], lowercase: bool = False):
        super().__init__(itos)
        self.lowercase = bool(lowercase)

    @classmethod
    def fit(
        cls,
        texts: Iterable[str],
        *,
        min_count: int = 1,
        max_size: int | None = None,
        lowercase: bool = False,
    ) -> WordTokenizer:
        """Vocabulary of the words of ``texts``, most frequent first.

        Args:
          texts: the training texts.
          min_count: words seen fewer times are left out (they encode to ``<unk>``).
          max_size: keep at most this many words, specials not counted; None keeps all.
          lowercase: lowercase text before splitting, in ``fit`` and in ``encode``.

        Frequency ties are broken by the word's code points, so the same texts always give the
        same ids.
        """
        counts = collections.Counter()
        for text in _nonempty_texts(texts, cls.name):
            counts.update(_WORD_RE.findall(text.lower() if lowercase else text))
        words = sorted((w for w in counts if counts[w] >= min_count), key=lambda w: (-counts[w], w))
        words = words[:max_size] if max_size is not None else words
        if not words:
            raise ValueError(f"cannot fit a word tokenizer: no word is seen {min_count}+ times")
        return cls([*SPECIAL_TOKENS, *words], lowercase=lowercase)

    def _split(self, text: str) -> list[str]:
        return _WORD_RE.findall(text.lower() if self.lowercase else text)

    def _state(self) -> dict:
        return {"itos": self.itos, "lowercase": self.lowercase}


class BpeTokenizer(Tokenizer):
    """Byte-level BPE (GPT-2 style) from Hugging Face ``tokenizers``, saved as tokenizer.json.

    Starting from all 256 bytes, no text is ever unknown and ``decode(encode(text)) == text``.
    """

    name = "bpe"
    covers_all_text = True
    fitted = True

    @classmethod
    def made(cls, *, texts=None, vocab_size=None, path=None) -> BpeTokenizer:
        if vocab_size is None:
            raise ValueError("tokenizer 'bpe' needs vocab_size")
        return cls.train(texts, vocab_size)

    def __init__(self, hf_tokenizer):
        """Wraps a ``tokenizers.Tokenizer`` whose first four ids are the specials, in order."""
        found = [hf_tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
        if found != list(range(NUM_SPECIAL)):
            raise ValueError(f"BPE specials {list(SPECIAL_TOKENS)} must have ids 0..3, got {found}")
        self.hf_tokenizer = hf_tokenizer

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BpeTokenizer:
        """Learns merges from ``texts`` (any iterable; no files) up to ``vocab_size`` ids.

        The vocabulary ends smaller when the texts run out of pairs to merge.
        """
        import tokenizers  # Imported here: byte, char and word tokenizers work without it.

        if vocab_size < NUM_SPECIAL + 256:
            raise ValueError(f"BPE vocab_size must be >= {NUM_SPECIAL + 256}, got {vocab_size}")
        tok = tokenizers.Tokenizer(tokenizers.models.BPE())
        tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tokenizers.decoders.ByteLevel()
        trainer = tokenizers.trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS),  # Listed first, so they get ids 0..3.
            initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        counter = PieceCounter()
        pieces = (piece for text in _nonempty_texts(texts, cls.name) for piece in counter(text))
        tok.train_from_iterator(pieces, trainer=trainer)
        # Pieces cut at spaces are what BPE's pre-tokenizer splits anyway (a single-file corpus
        # always has them): only a run of characters without a space is worth a warning.
        if counter.cut_inside_words:
            logger.warning(
                "fitting BPE: %d texts hold over %d characters without a space, fitted as "
                "words of at most that length",
                counter.cut_inside_words,
                BPE_PIECE_CHARS,
            )
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return self.hf_tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # tokenizers encodes a batch on all cores, without the GIL; its fast variant (0.20+)
        # leaves out the offsets into the text, which nothing here reads.
        encode = getattr(self.hf_tokenizer, "encode_batch_fast", self.hf_tokenizer.encode_batch)
        counter = PieceCounter()
        pieces = [counter(text) for text in texts]
        if counter.long_texts:
            logger.info("BPE: %d long texts encoded in pieces", counter.long_texts)
        encodings = iter(encode([p for each in pieces for p in each], add_special_tokens=False))
        return [
            [i for _, encoding in zip(each, encodings, strict=False) for i in encoding.ids]
            for each in pieces
        ]

    def _decode_regular(self, ids: list[int]) -> str:
        return self.hf_tokenizer.decode(ids)

    def _files(self) -> dict[str, bytes]:
        return {BPE_FILE: self.hf_tokenizer.to_str(pretty=True).encode()}

    @classmethod
    def _load_files(cls, directory: Path) -> BpeTokenizer:
        import tokenizers

        path = require_file(directory / BPE_FILE)
        try:
            return cls(tokenizers.Tokenizer.from_file(str(path)))
        # The Rust bindings raise a bare Exception for any malformed file.
        except Exception as e:
            raise ValueError(f"{path}: not a valid Hugging Face tokenizer file ({e})") from None


# SentencePiece's tokenizer loads the sentencepiece package only when one is made or loaded.
TOKENIZERS = Registry(
    "data.tokenizer",
    "a Tokenizer class",
    {
        cls.name: cls
        for cls in (
            ByteTokenizer,
            CharTokenizer,
            WordTokenizer,
            BpeTokenizer,
            SentencePieceTokenizer,
        )
    },
    imports=False,
)
FITTED_TOKENIZERS = tuple(name for name, cls in TOKENIZERS.items() if cls.fitted)


def make_tokenizer(
    name: str,
    *,
    texts: Iterable[str] | None = None,
    vocab_size: int | None = None,
    path: Path | str | None = None,
) -> Tokenizer:
    """Builds the tokenizer a training config asks for.

    Args:
      name: one of ``byte``, ``char``, ``word``, ``bpe``, ``sentencepiece``.
      texts: training texts; required by ``char``, ``word`` and ``bpe``, ignored otherwise.
      vocab_size: required by ``bpe`` (the target size); for ``word`` an optional cap on the
        vocabulary, specials included; ignored by the other tokenizers.
      path: the ``.model`` file, required by ``sentencepiece``.

    Raises:
      ValueError: unknown ``name``, a missing argument, or unusable texts or model file.
      FileNotFoundError: the SentencePiece model file does not exist.
    """
    if name not in TOKENIZERS:
        valid = ", ".join(TOKENIZERS)
        raise ValueError(f"unknown tokenizer {name!r}; valid tokenizers: {valid}")
    if TOKENIZERS[name].fitted and texts is None:
        raise ValueError(f"tokenizer {name!r} needs texts to fit on")
    return TOKENIZERS[name].made(texts=texts, vocab_size=vocab_size, path=path)


def load_tokenizer(directory: Path | str) -> Tokenizer:
    """Reads back a tokenizer written by ``Tokenizer.save(directory)``, whichever it is."""
    directory = Path(directory)
    marker = directory / NAME_FILE
    if not marker.is_file():
        raise FileNotFoundError(f"{marker}: missing; no tokenizer was saved in {directory}")
    name = read_json_object(marker).get("kind")
    if name == "hf":  # a Hugging Face checkpoint's tokenizer, saved by a run trained from it
        return HfTokenizer._load_files(directory)
    if not isinstance(name, str) or name not in TOKENIZERS:
        valid = ", ".join(TOKENIZERS)
        raise ValueError(f"{marker}: unknown tokenizer {name!r}; valid tokenizers: {valid}")
    return TOKENIZERS[name]._load_files(directory)


def _nonempty_texts(texts: Iterable[str], name: str) -> Iterator[str]:
    """Iterates ``texts`` lazily after checking that at least one is non-empty.

    A bare string is rejected: iterating it would silently yield single characters.
    """
    if isinstance(texts, str | bytes):
        raise TypeError("texts must be an iterable of strings, not a single string")
    texts = iter(texts)
    first = next((t for t in texts if t), None)
    if first is None:
        raise ValueError(f"cannot fit a {name} tokenizer: the texts are empty")
    return itertools.chain([first], texts)


# The shared layout (tokenizer_base) is public here too, beside the tokenizers that use it.
__all__ = [
    "BPE_FILE",
    "EOS_ID",
    "NAME_FILE",
    "NUM_SPECIAL",
    "PAD_ID",
    "SENTENCEPIECE_FILE",
    "SOS_ID",
    "SPECIAL_TOKENS",
    "TOKENIZERS",
    "UNK_ID",
    "VOCAB_FILE",
    "BpeTokenizer",
    "ByteTokenizer",
    "CharTokenizer",
    "Tokenizer",
    "WordTokenizer",
    "load_tokenizer",
    "make_tokenizer",
]
