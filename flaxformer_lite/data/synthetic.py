"""Procedural generators: training and evaluation data that needs nothing but this package.

A generator (``data.generator``) is a random-access sequence of plain-text examples, generated in
NumPy many at a time. ``gen[i]`` (the same as ``gen.example(i)``) is a pure function of ``(seed,
split, i)``: example ``i`` is number ``i % CHUNK`` of chunk ``i // CHUNK``, and a chunk is drawn
from its own ``numpy.random.default_rng([seed, split_id, chunk])``, so a resumed run sees exactly
the examples it would have seen and call order does not matter. Records hold text, never token
ids, so any tokenizer fits; ``gen.documents(tokenizer)`` tokenizes all of them at once
(:class:`~flaxformer_lite.data.documents.Documents`).
Record keys by ``Generator.records``, the type of records a generator makes (the record types of
:mod:`flaxformer_lite.data.documents`):

- ``TEXT_RECORDS`` (``arithmetic``, ``reverse``): ``{"text": "123+045=8610"}``, a prompt ending
  at the first ``=`` followed by the answer (:func:`split_prompt`). A model is prompted with
  ``"123+045="`` and scored on what it writes after it.
- ``PAIR_RECORDS`` (``number_words``): ``{"source": "three hundred forty-two", "target": "342"}``.
- ``LABELLED_RECORDS`` (``sentiment``): ``{"text": "the food was not good", "label": 0}``,
  ``label`` an ``int`` index into ``gen.labels``.

``gen.score(predictions, examples)`` returns ``{"exact_match": ...}`` or ``{"accuracy": ...}``.

Splits: the splits draw from separate generators. Those still collide in small domains (one-digit
sums), so every candidate is also assigned to one split by a stable hash of its input (prompt,
source or sentence; never of the seed or options): :func:`split_of`, about
:data:`VALIDATION_FRACTION` of inputs to validation. A chunk draws candidates until it holds
``CHUNK`` of its own split's. Validation inputs thus never occur in train, whatever the seeds.
Within one split a small domain repeats examples.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import operator
import string
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from flaxformer_lite.data.byte_texts import (
    ByteTexts,
    Drawn,
    Part,
    backwards,
    decimal,
    literal,
    lookup,
    padded_decimal,
    render,
    stable_hash,
    table,
    tokenize,
)
from flaxformer_lite.data.documents import (
    LABELLED_RECORDS,
    PAIR_RECORDS,
    TEXT_RECORDS,
    Documents,
)
from flaxformer_lite.data.number_words import (  # number_to_words: part of this module's API
    MAX_NUMBER,
    below_thousand,
    number_to_words,  # noqa: F401
)
from flaxformer_lite.data.sentiment_words import (
    ADJECTIVES,
    CLAUSE_WORDS,
    INTENSIFIERS,
    LABELS,
    NEGATIONS,
    NOUNS,
)
from flaxformer_lite.data.tokenizers import Tokenizer

SPLITS = ("train", "validation")
VALIDATION_FRACTION = 0.1
DEFAULT_SIZES = {"train": 1_000_000, "validation": 1_000}
# A split's examples are all made in memory before the first step: a larger one would take
# minutes and gigabytes with nothing to show.
MAX_SIZE = 10_000_000
ANSWER_SEP = "="
CHUNK = 4096  # examples drawn at a time

_VALIDATION_BELOW = np.uint64(int(VALIDATION_FRACTION * 2**64))
# A split that takes fewer than one draw in this many is (almost) empty: the options leave
# nothing for it rather than bad luck. A chunk gives up at once if the first _EMPTY_AFTER
# draws hold none of its split's inputs.
_MAX_DRAWS = 1_000
_EMPTY_AFTER = 65_536
_MAX_ROUND = 2**18  # candidates drawn at once
_CACHED_CHUNKS = 16
_CHUNKS: collections.OrderedDict[tuple, Drawn] = collections.OrderedDict()  # the last used
_KEPT_DOCUMENTS = 2  # a run's two splits
# (generator, tokenizer, documents) of the last built, the newest last.
_DOCUMENTS: list[tuple[Generator, Tokenizer, Documents]] = []


def split_of(key: str) -> str:
    """The split that owns an example input ``key`` (a prompt, source or sentence).

    A hash of the UTF-8 bytes (:func:`~flaxformer_lite.data.byte_texts.stable_hash`) rather
    than ``hash()``, which Python salts per process; the same hash, vectorised, sorts every
    drawn candidate.
    """
    hashes = stable_hash(ByteTexts.from_strings([key]))
    return "validation" if hashes[0] < _VALIDATION_BELOW else "train"


def split_prompt(text: str) -> tuple[str, str]:
    """Splits a text record's text into ``(prompt, answer)``; the prompt keeps the ``=``."""
    prompt, sep, answer = text.partition(ANSWER_SEP)
    if not sep:
        raise ValueError(f"no {ANSWER_SEP!r} separating prompt and answer in {text!r}")
    return prompt + sep, answer


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    in_range = isinstance(value, int | np.integer) and not isinstance(value, bool)
    in_range = in_range and low <= value and (high is None or value <= high)
    if not in_range:
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")


def _sample_numbers(rng: np.random.Generator, count: int, max_value: int) -> np.ndarray:
    """``count`` numbers in ``[0, max_value]`` whose digit count is uniform, so short ones are
    not rare."""
    digits = rng.integers(1, len(str(max_value)) + 1, count)
    low = np.where(digits == 1, 0, 10 ** (digits - 1))
    return rng.integers(low, np.minimum(10**digits - 1, max_value) + 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Generator(abc.ABC):
    """Base of all generators: a deterministic sequence of ``size`` examples, drawn by chunks.

    Attributes:
      split: ``"train"`` or ``"validation"``.
      seed: non-negative int; with ``split`` and the index it fixes every example.
      size: number of examples; ``None`` means ``DEFAULT_SIZES[split]``.
    """

    name: ClassVar[str]
    records: ClassVar[str]
    metric: ClassVar[str] = "exact_match"

    split: str = "train"
    seed: int = 0
    size: int | None = None

    def __post_init__(self):
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        _check_int("seed", self.seed, 0)
        if self.size is None:
            object.__setattr__(self, "size", DEFAULT_SIZES[self.split])
        _check_int("size", self.size, 1, MAX_SIZE)
        self._check_options()
        self.example(0)  # options that leave this split empty fail here, not mid-training

    @abc.abstractmethod
    def _check_options(self) -> None:
        """Validates the subclass's own fields (raises ValueError naming the field)."""

    @abc.abstractmethod
    def _draw(self, rng: np.random.Generator, count: int) -> Drawn:
        """``count`` candidate examples."""

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.example(index)

    def example(self, index: int) -> dict[str, Any]:
        """Example ``index`` in ``[0, size)``; a pure function of ``(seed, split, index)``."""
        index = operator.index(index)
        if not 0 <= index < self.size:
            raise IndexError(f"{self.name} index {index} out of range [0, {self.size})")
        chunk = self._cached_chunk(index // CHUNK)
        record = {name: texts.text(index % CHUNK) for name, texts in chunk.fields.items()}
        if chunk.labels is not None:
            record["label"] = int(chunk.labels[index % CHUNK])
        return record

    def documents(self, tokenizer: Tokenizer) -> Documents:
        """All ``size`` examples tokenized, in order; ``digests`` are the inputs' hashes.

        Read-only arrays, kept for the next equal generator and tokenizer: drawing a million
        examples takes seconds, and another run in this process (a sweep's, a notebook's, a
        test session's) often asks for the same ones.
        """
        for generator, kept_tokenizer, documents in _DOCUMENTS:
            if generator == self and kept_tokenizer.same_as(tokenizer):
                return documents
        documents = self._tokenized(tokenizer)
        arrays = [*documents.tokens.values(), *documents.offsets.values(), documents.digests]
        for array in [*arrays, *([] if documents.labels is None else [documents.labels])]:
            array.setflags(write=False)
        _DOCUMENTS.append((self, tokenizer, documents))
        del _DOCUMENTS[:-_KEPT_DOCUMENTS]
        return documents

    def _tokenized(self, tokenizer: Tokenizer) -> Documents:
        chunks = [self.chunk(c) for c in range(-(-self.size // CHUNK))]
        chunks[-1] = chunks[-1].take(np.arange(self.size - CHUNK * (len(chunks) - 1)))
        drawn = Drawn.concatenate(chunks)
        tokens, offsets = {}, {}
        for name, texts in drawn.fields.items():
            tokens[name], offsets[name] = tokenize(tokenizer, texts, target=name == "target")
        labels = None if drawn.labels is None else drawn.labels.astype(np.int32)
        return Documents(tokens, offsets, drawn.hashes, labels)

    def chunk(self, number: int) -> Drawn:
        """Examples ``[number * CHUNK, (number + 1) * CHUNK)`` (whatever ``size`` is)."""
        rng = np.random.default_rng([self.seed, SPLITS.index(self.split), number])
        validation = self.split == "validation"
        share = VALIDATION_FRACTION if validation else 1 - VALIDATION_FRACTION
        kept, count, drawn = [], 0, 0
        while count < CHUNK:
            if drawn >= _MAX_DRAWS * CHUNK or (not count and drawn >= _EMPTY_AFTER):
                raise ValueError(
                    f"{self}: (almost) no {self.split} examples here; widen the domain"
                )
            share = count / drawn if drawn else share
            if share:
                size = int((CHUNK - count) / max(share, 1 / _MAX_DRAWS) * 1.1) + 64
                size = min(size, _MAX_ROUND)
            else:  # none of this split's inputs yet: draw up to where the chunk gives up
                size = _EMPTY_AFTER - drawn
            candidates = self._draw(rng, size)
            mine = np.flatnonzero((candidates.hashes < _VALIDATION_BELOW) == validation)
            kept.append(candidates.take(mine[: CHUNK - count]))
            count, drawn = count + len(kept[-1]), drawn + size
        return Drawn.concatenate(kept)

    def _cached_chunk(self, number: int) -> Drawn:
        # Shared by equal generators (whatever their size), so that building one again is cheap.
        fields = [f.name for f in dataclasses.fields(self) if f.name != "size"]
        key = (self.name, number, *(getattr(self, name) for name in fields))
        if key not in _CHUNKS:
            if len(_CHUNKS) >= _CACHED_CHUNKS:
                _CHUNKS.popitem(last=False)
            _CHUNKS[key] = self.chunk(number)
        _CHUNKS.move_to_end(key)
        return _CHUNKS[key]

    def score(self, predictions: Sequence[Any], examples: Sequence[dict]) -> dict[str, float]:
        """Fraction of predictions that match their examples, as ``{generator.metric: value}``.

        Args:
          predictions: for text records the generated answer (text after the prompt), for pairs
            the generated target, both compared after stripping surrounding whitespace; for
            labelled text the predicted label index.
          examples: the records the predictions belong to, in the same order.
        """
        if len(predictions) != len(examples) or not examples:
            counts = f"{len(predictions)} and {len(examples)}"
            raise ValueError(f"need as many predictions as examples (at least one), got {counts}")
        hits = sum(self._is_correct(p, e) for p, e in zip(predictions, examples, strict=True))
        return {self.metric: hits / len(examples)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class _LMGenerator(Generator):
    records: ClassVar[str] = TEXT_RECORDS

    def _is_correct(self, prediction: str, example: dict[str, Any]) -> bool:
        return prediction.strip() == split_prompt(example["text"])[1]


def _lm_drawn(parts: list[Part], prompt_parts: int) -> Drawn:
    """An ``lm`` candidate text; its first ``prompt_parts`` parts are the prompt (the key)."""
    key_lengths = sum(lengths for _, lengths in parts[:prompt_parts])
    return Drawn({"text": render(parts)}, "text", key_lengths)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithmeticGenerator(_LMGenerator):
    """Multi-digit addition (and subtraction), ``{"text": "123+045=8610"}`` (123 + 45 = 168).

    Each operand has a uniform number of digits in ``[1, max_digits]``; subtraction puts the
    larger operand first. As in minGPT's adder, a small decoder learns it in minutes because
    ``fixed_width`` pads operands to ``max_digits`` and the answer to ``max_digits + 1`` digits
    (a place's digits sit at the same positions in every example) and ``reverse_answer`` writes
    the answer least significant digit first, as carries are computed. Both off: ``"123+45=168"``.
    """

    name: ClassVar[str] = "arithmetic"
    max_digits: int = 3
    subtraction: bool = True
    fixed_width: bool = True
    reverse_answer: bool = True

    def _check_options(self) -> None:
        _check_int("max_digits", self.max_digits, 1, 18)  # numpy draws int64
        for name in ("subtraction", "fixed_width", "reverse_answer"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def _draw(self, rng, count):
        a, b = (_sample_numbers(rng, count, 10**self.max_digits - 1) for _ in range(2))
        minus = rng.random(count) < 0.5 if self.subtraction else np.zeros(count, bool)
        a, b = np.where(minus, np.maximum(a, b), a), np.where(minus, np.minimum(a, b), b)
        sign = np.where(minus, ord("-"), ord("+")).astype(np.uint8)[:, None]
        answer = np.where(minus, a - b, a + b)
        if self.fixed_width:
            a, b = padded_decimal(a, self.max_digits), padded_decimal(b, self.max_digits)
            answer = padded_decimal(answer, self.max_digits + 1)
        else:
            a, b, answer = decimal(a), decimal(b), decimal(answer)
        if self.reverse_answer:
            answer = backwards(answer)
        parts = [a, (sign, np.ones(count, np.int64)), b]
        return _lm_drawn([*parts, literal(ANSWER_SEP, count), answer], 4)


_LETTERS = np.frombuffer(string.ascii_lowercase.encode(), np.uint8)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReverseGenerator(_LMGenerator):
    """Reverse a lowercase string, ``{"text": "abc=cba"}``: a sanity check for tiny models."""

    name: ClassVar[str] = "reverse"
    max_length: int = 8

    def _check_options(self) -> None:
        _check_int("max_length", self.max_length, 1)

    def _draw(self, rng, count):
        lengths = rng.integers(1, self.max_length + 1, count)
        word = _LETTERS[rng.integers(0, len(_LETTERS), (count, self.max_length))]
        parts = [(word, lengths), literal(ANSWER_SEP, count), backwards((word, lengths))]
        return _lm_drawn(parts, 2)


_BELOW_THOUSAND = table(["-"] + [" ".join(below_thousand(n)) for n in range(1, 1000)])


@dataclasses.dataclass(frozen=True, kw_only=True)
class NumberWordsGenerator(Generator):
    """Number words to digits, a synthetic translation: ``{"source": "forty-two", "target": "42"}``.

    Numbers lie in ``[0, max_value]`` with a uniform digit count, so teens and small numbers are
    as common as six-digit ones.
    """

    name: ClassVar[str] = "number_words"
    records: ClassVar[str] = PAIR_RECORDS
    max_value: int = 999_999

    def _check_options(self) -> None:
        _check_int("max_value", self.max_value, 0, MAX_NUMBER)

    def _draw(self, rng, count):
        numbers = _sample_numbers(rng, count, self.max_value)
        millions, thousands, ones = numbers // 10**6, numbers // 1000 % 1000, numbers % 1000
        parts = [
            lookup(_BELOW_THOUSAND, millions, millions > 0),
            literal(" million", count, millions > 0),
            literal(" ", count, (millions > 0) & (thousands > 0)),
            lookup(_BELOW_THOUSAND, thousands, thousands > 0),
            literal(" thousand", count, thousands > 0),
            literal(" ", count, (millions + thousands > 0) & (ones > 0)),
            lookup(_BELOW_THOUSAND, ones, ones > 0),
            literal("zero", count, numbers == 0),
        ]
        source = render(parts)
        target = render([decimal(numbers)])
        return Drawn({"source": source, "target": target}, "source", source.lengths)

    def _is_correct(self, prediction: str, example: dict[str, Any]) -> bool:
        return prediction.strip() == example["target"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SentimentGenerator(Generator):
    """Three-way sentiment of template reviews, ``{"text": ..., "label": index into LABELS}``.

    A text is 1 to ``max_clauses`` clauses "the <noun> was|is [not|never] [very] <adjective>"
    joined by "and". One clause carries the class: a positive or negative adjective, negated half
    the time, which flips it ("not good" is negative, "never awful" positive), or for the neutral
    class a neutral adjective (negated or not, still neutral). The other clauses are neutral,
    also negated half the time. So neither a negation nor any adjective alone gives the label
    away: a model has to tie each negation to its own adjective. Labels are drawn uniformly, so
    classes are balanced in expectation; the class clause stands anywhere among the others.
    """

    name: ClassVar[str] = "sentiment"
    records: ClassVar[str] = LABELLED_RECORDS
    metric: ClassVar[str] = "accuracy"
    labels: ClassVar[tuple[str, ...]] = LABELS
    max_clauses: int = 3

    def _check_options(self) -> None:
        _check_int("max_clauses", self.max_clauses, 1, 8)

    def _draw(self, rng, count):
        label = rng.integers(len(LABELS), size=count)
        negated = rng.integers(2, size=(count, self.max_clauses)).astype(bool)
        # The class clause's adjective: neutral for the neutral class, else of the polarity
        # that its negation flips into the label's (indices into ADJECTIVES, 10 per label).
        polarity = np.where(negated[:, 0], 2 - label, label)
        adjective = rng.integers(10, size=(count, self.max_clauses)) + 10  # neutral
        adjective[:, 0] += 10 * (polarity - 1)
        clauses = rng.integers(self.max_clauses, size=count) + 1
        # Clause slot s shows clause (s - place) % clauses: the class clause (0) at ``place``.
        place = rng.integers(0, clauses)
        nouns = rng.integers(len(NOUNS), size=(count, self.max_clauses))
        verbs = rng.integers(2, size=(count, self.max_clauses))
        negations = rng.integers(len(NEGATIONS), size=(count, self.max_clauses))
        strong = rng.random((count, self.max_clauses)) < 0.5
        intensifiers = rng.integers(len(INTENSIFIERS), size=(count, self.max_clauses))
        rows = np.arange(count)
        parts = []
        for slot in range(self.max_clauses):
            shown = slot < clauses
            c = (slot - place) % clauses
            parts += [
                literal(" and ", count, shown & (slot > 0)),
                lookup(CLAUSE_WORDS["noun"], nouns[rows, c], shown),
                lookup(CLAUSE_WORDS["verb"], verbs[rows, c], shown),
                lookup(CLAUSE_WORDS["negation"], negations[rows, c], shown & negated[rows, c]),
                lookup(
                    CLAUSE_WORDS["intensifier"],
                    intensifiers[rows, c],
                    shown & strong[rows, c],
                ),
                literal(" ", count, shown),
                lookup(ADJECTIVES, adjective[rows, c], shown),
            ]
        text = render(parts)
        return Drawn({"text": text}, "text", text.lengths, label)

    def _is_correct(self, prediction: int, example: dict[str, Any]) -> bool:
        return int(prediction) == example["label"]


GENERATORS: dict[str, type[Generator]] = {
    generator.name: generator
    for generator in (
        ArithmeticGenerator,
        ReverseGenerator,
        NumberWordsGenerator,
        SentimentGenerator,
    )
}


def make_generator(
    name: str, *, split: str = "train", seed: int = 0, size: int | None = None, **options
) -> Generator:
    """Builds generator ``name`` from :data:`GENERATORS` with its own ``options``.

    Example: ``make_generator("arithmetic", split="validation", seed=1, max_digits=5)``.

    Raises:
      ValueError: for an unknown generator or option (the message lists the valid ones) or a bad
        value.
    """
    if name not in GENERATORS:
        raise ValueError(
            f"unknown synthetic generator {name!r}; valid generators: {', '.join(GENERATORS)}"
        )
    cls = GENERATORS[name]
    valid = [f.name for f in dataclasses.fields(cls) if f.name not in ("split", "seed", "size")]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for generator {name!r}; "
            f"valid options: {', '.join(valid) or 'none'}"
        )
    return cls(split=split, seed=seed, size=size, **options)
