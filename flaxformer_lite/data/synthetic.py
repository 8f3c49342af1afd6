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

import dataclasses
import string
from typing import Any, ClassVar

import numpy as np

from flaxformer_lite.data.byte_texts import (
    Drawn,
    Part,
    backwards,
    decimal,
    literal,
    lookup,
    padded_decimal,
    render,
    table,
)
from flaxformer_lite.data.documents import (
    LABELLED_RECORDS,
    PAIR_RECORDS,
    TEXT_RECORDS,
)
from flaxformer_lite.data.generator import (
    ANSWER_SEP,
    Generator,
    check_int,
    sample_numbers,
    split_prompt,
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
        check_int("max_digits", self.max_digits, 1, 18)  # numpy draws int64
        for name in ("subtraction", "fixed_width", "reverse_answer"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def _draw(self, rng, count):
        a, b = (sample_numbers(rng, count, 10**self.max_digits - 1) for _ in range(2))
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
        check_int("max_length", self.max_length, 1)

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
        check_int("max_value", self.max_value, 0, MAX_NUMBER)

    def _draw(self, rng, count):
        numbers = sample_numbers(rng, count, self.max_value)
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
        check_int("max_clauses", self.max_clauses, 1, 8)

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
