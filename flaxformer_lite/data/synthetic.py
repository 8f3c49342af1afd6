"""Procedurally generated tasks: training and evaluation data that needs nothing but this package.

A task is a lazily generated, random-access sequence of plain-text examples. ``task[i]`` (the same
as ``task.example(i)``) is a pure function of ``(seed, split, i)``: a resumed run sees exactly the
examples it would have seen, call order does not matter, and ``grain.MapDataset.source(task)``
wraps a task as it is. Records hold text, never token ids, so any tokenizer fits. Record keys by
``Task.kind``:

- ``"lm"`` (``arithmetic``, ``reverse``): ``{"text": "123+45=168"}``, a prompt ending at the first
  ``=`` followed by the answer (:func:`split_prompt`). A generator is prompted with ``"123+45="``
  and scored on what it writes after it.
- ``"seq2seq"`` (``number_words``): ``{"source": "three hundred forty-two", "target": "342"}``.
- ``"classification"`` (``sentiment``): ``{"text": "the food was not good", "label": 0}``, ``label``
  an ``int`` index into ``task.labels``.

``task.score(predictions, examples)`` returns ``{"exact_match": ...}`` or ``{"accuracy": ...}``.

Splits: example ``i`` draws from ``numpy.random.default_rng([seed, split_id, i])``, so the splits
are separate streams. Streams alone still collide in small domains (one-digit sums), so every
candidate is also assigned to one split by a stable hash of its input (prompt, source or sentence;
never of the seed or options), about :data:`VALIDATION_FRACTION` of inputs to validation. A draw
that lands in the other split's part is redrawn from the same generator. Validation inputs thus
never occur in train, whatever the seeds. Within one split a small domain repeats examples.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import operator
import string
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

SPLITS = ("train", "validation")
VALIDATION_FRACTION = 0.1
DEFAULT_SIZES = {"train": 1_000_000, "validation": 1_000}
ANSWER_SEP = "="
MAX_NUMBER = 10**9 - 1  # number_to_words knows "thousand" and "million"

# A validation draw succeeds with probability ~0.1, so this many misses in a row means the
# options leave (almost) nothing for this split rather than bad luck.
_MAX_DRAWS = 1_000


def split_of(key: str) -> str:
    """The split that owns an example input ``key`` (a prompt, source or sentence).

    blake2b rather than ``hash()``, which Python salts per process.
    """
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return "validation" if int.from_bytes(digest) < VALIDATION_FRACTION * 2**64 else "train"


def split_prompt(text: str) -> tuple[str, str]:
    """Splits an ``"lm"`` record's text into ``(prompt, answer)``; the prompt keeps the ``=``."""
    prompt, sep, answer = text.partition(ANSWER_SEP)
    if not sep:
        raise ValueError(f"no {ANSWER_SEP!r} separating prompt and answer in {text!r}")
    return prompt + sep, answer


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_ONES = _words(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
)
_TENS = ("", "") + _words("twenty thirty forty fifty sixty seventy eighty ninety")  # by tens digit


def _below_thousand(n: int) -> list[str]:
    words = []
    hundreds, rest = divmod(n, 100)
    if hundreds:
        words += [_ONES[hundreds], "hundred"]
    if rest >= 20:
        tens, ones = divmod(rest, 10)
        words.append(_TENS[tens] + (f"-{_ONES[ones]}" if ones else ""))
    elif rest:
        words.append(_ONES[rest])
    return words


def number_to_words(n: int) -> str:
    """American English words for ``0 <= n <= MAX_NUMBER``.

    342 -> "three hundred forty-two": no "and" after "hundred", hyphenated tens, and empty
    groups skipped (1_000_005 -> "one million five").
    """
    _check_int("n", n, 0, MAX_NUMBER)
    if n == 0:
        return "zero"
    words = []
    for scale, name in ((10**6, ["million"]), (10**3, ["thousand"]), (1, [])):
        group, n = divmod(n, scale)
        if group:
            words += _below_thousand(group) + name
    return " ".join(words)


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    in_range = isinstance(value, int | np.integer) and not isinstance(value, bool)
    in_range = in_range and low <= value and (high is None or value <= high)
    if not in_range:
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")


def _pick(rng: np.random.Generator, items: Sequence[str]) -> str:
    return items[int(rng.integers(len(items)))]


def _sample_number(rng: np.random.Generator, max_value: int) -> int:
    """A number in ``[0, max_value]`` whose digit count is uniform, so short ones are not rare."""
    digits = int(rng.integers(1, len(str(max_value)) + 1))
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return int(rng.integers(low, min(10**digits - 1, max_value) + 1))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task(abc.ABC):
    """Base of all tasks: a deterministic, lazily generated sequence of ``size`` examples.

    Attributes:
      split: ``"train"`` or ``"validation"``.
      seed: non-negative int; with ``split`` and the index it fixes every example.
      size: number of examples; ``None`` means ``DEFAULT_SIZES[split]``.
    """

    name: ClassVar[str]
    kind: ClassVar[str]
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
        _check_int("size", self.size, 1)
        self._check_options()
        self.example(0)  # options that leave this split empty fail here, not mid-training

    @abc.abstractmethod
    def _check_options(self) -> None:
        """Validates the subclass's own fields (raises ValueError naming the field)."""

    @abc.abstractmethod
    def _draw(self, rng: np.random.Generator) -> tuple[dict[str, Any], str]:
        """One candidate ``(record, key)``; ``key`` is the input that decides the split."""

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.example(index)

    def example(self, index: int) -> dict[str, Any]:
        """Example ``index`` in ``[0, size)``; a pure function of ``(seed, split, index)``."""
        index = operator.index(index)
        if not 0 <= index < self.size:
            raise IndexError(f"{self.name} index {index} out of range [0, {self.size})")
        rng = np.random.default_rng([self.seed, SPLITS.index(self.split), index])
        for _ in range(_MAX_DRAWS):
            record, key = self._draw(rng)
            if split_of(key) == self.split:
                return record
        raise ValueError(f"{self}: (almost) no {self.split} examples here; widen the domain")

    def score(self, predictions: Sequence[Any], examples: Sequence[dict]) -> dict[str, float]:
        """Fraction of predictions that match their examples, as ``{task.metric: value}``.

        Args:
          predictions: for ``"lm"`` the generated answer (text after the prompt), for ``"seq2seq"``
            the generated target, both compared after stripping surrounding whitespace; for
            ``"classification"`` the predicted label index.
          examples: the records the predictions belong to, in the same order.
        """
        if len(predictions) != len(examples) or not examples:
            counts = f"{len(predictions)} and {len(examples)}"
            raise ValueError(f"need as many predictions as examples (at least one), got {counts}")
        hits = sum(self._is_correct(p, e) for p, e in zip(predictions, examples, strict=True))
        return {self.metric: hits / len(examples)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class _LMTask(Task):
    kind: ClassVar[str] = "lm"

    def _is_correct(self, prediction: str, example: dict[str, Any]) -> bool:
        return prediction.strip() == split_prompt(example["text"])[1]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithmeticTask(_LMTask):
    """Multi-digit addition (and subtraction), ``{"text": "123+45=168"}``.

    Each operand has a uniform number of digits in ``[1, max_digits]``. Subtraction puts the
    larger operand first, so answers are never negative.
    """

    name: ClassVar[str] = "arithmetic"
    max_digits: int = 3
    subtraction: bool = True

    def _check_options(self) -> None:
        _check_int("max_digits", self.max_digits, 1, 18)  # numpy draws int64
        if not isinstance(self.subtraction, bool):
            raise ValueError(f"subtraction must be a bool, got {self.subtraction!r}")

    def _draw(self, rng):
        a, b = (_sample_number(rng, 10**self.max_digits - 1) for _ in range(2))
        if self.subtraction and rng.random() < 0.5:
            a, b = max(a, b), min(a, b)
            prompt, answer = f"{a}-{b}{ANSWER_SEP}", a - b
        else:
            prompt, answer = f"{a}+{b}{ANSWER_SEP}", a + b
        return {"text": f"{prompt}{answer}"}, prompt


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReverseTask(_LMTask):
    """Reverse a lowercase string, ``{"text": "abc=cba"}``: a sanity check for tiny models."""

    name: ClassVar[str] = "reverse"
    max_length: int = 8

    def _check_options(self) -> None:
        _check_int("max_length", self.max_length, 1)

    def _draw(self, rng):
        length = int(rng.integers(1, self.max_length + 1))
        word = "".join(_pick(rng, string.ascii_lowercase) for _ in range(length))
        return {"text": f"{word}{ANSWER_SEP}{word[::-1]}"}, f"{word}{ANSWER_SEP}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class NumberWordsTask(Task):
    """Number words to digits, a synthetic translation: ``{"source": "forty-two", "target": "42"}``.

    Numbers lie in ``[0, max_value]`` with a uniform digit count, so teens and small numbers are
    as common as six-digit ones.
    """

    name: ClassVar[str] = "number_words"
    kind: ClassVar[str] = "seq2seq"
    max_value: int = 999_999

    def _check_options(self) -> None:
        _check_int("max_value", self.max_value, 0, MAX_NUMBER)

    def _draw(self, rng):
        n = _sample_number(rng, self.max_value)
        source = number_to_words(n)
        return {"source": source, "target": str(n)}, source

    def _is_correct(self, prediction: str, example: dict[str, Any]) -> bool:
        return prediction.strip() == example["target"]


LABELS = ("negative", "neutral", "positive")
POSITIVE_WORDS = _words(
    "good great excellent wonderful pleasant delightful superb lovely fantastic enjoyable"
)
NEGATIVE_WORDS = _words(
    "bad terrible awful horrible poor dreadful boring disappointing unpleasant mediocre"
)
NEUTRAL_WORDS = _words("red blue green square round wooden metal tall wide plastic")
NEGATIONS = ("not", "never")
_NOUNS = _words("food movie service room book song hotel game show car table door")
_INTENSIFIERS = ("very", "really", "quite")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SentimentTask(Task):
    """Three-way sentiment of template reviews, ``{"text": ..., "label": index into LABELS}``.

    A text is 1 to ``max_clauses`` clauses "the <noun> was|is [not|never] [very] <adjective>"
    joined by "and". One clause carries the class: a positive or negative adjective, negated half
    the time, which flips it ("not good" is negative, "never awful" positive), or for the neutral
    class a neutral adjective (negated or not, still neutral). The other clauses are neutral,
    also negated half the time. So neither a negation nor any adjective alone gives the label
    away: a model has to tie each negation to its own adjective. Labels are drawn uniformly, so
    classes are balanced in expectation.
    """

    name: ClassVar[str] = "sentiment"
    kind: ClassVar[str] = "classification"
    metric: ClassVar[str] = "accuracy"
    labels: ClassVar[tuple[str, ...]] = LABELS
    max_clauses: int = 3

    def _check_options(self) -> None:
        _check_int("max_clauses", self.max_clauses, 1, 8)

    def _draw(self, rng):
        label = int(rng.integers(len(LABELS)))
        negated = bool(rng.integers(2))
        if LABELS[label] == "neutral":
            adjectives = NEUTRAL_WORDS
        elif (LABELS[label] == "positive") != negated:  # negation flips the adjective's polarity
            adjectives = POSITIVE_WORDS
        else:
            adjectives = NEGATIVE_WORDS
        clauses = [_clause(rng, adjectives, negated)]
        clauses += [
            _clause(rng, NEUTRAL_WORDS, bool(rng.integers(2)))
            for _ in range(int(rng.integers(self.max_clauses)))
        ]
        rng.shuffle(clauses)
        text = " and ".join(clauses)
        return {"text": text, "label": label}, text

    def _is_correct(self, prediction: int, example: dict[str, Any]) -> bool:
        return int(prediction) == example["label"]


def _clause(rng: np.random.Generator, adjectives: Sequence[str], negated: bool) -> str:
    words = ["the", _pick(rng, _NOUNS), _pick(rng, ("was", "is"))]
    if negated:
        words.append(_pick(rng, NEGATIONS))
    if rng.random() < 0.5:
        words.append(_pick(rng, _INTENSIFIERS))
    return " ".join([*words, _pick(rng, adjectives)])


TASKS: dict[str, type[Task]] = {
    task.name: task for task in (ArithmeticTask, ReverseTask, NumberWordsTask, SentimentTask)
}


def make_task(
    name: str, *, split: str = "train", seed: int = 0, size: int | None = None, **options
) -> Task:
    """Builds task ``name`` from :data:`TASKS` with task-specific ``options``.

    Example: ``make_task("arithmetic", split="validation", seed=1, max_digits=5)``.

    Raises:
      ValueError: for an unknown task or option (the message lists the valid ones) or a bad value.
    """
    if name not in TASKS:
        raise ValueError(f"unknown synthetic task {name!r}; valid tasks: {', '.join(TASKS)}")
    cls = TASKS[name]
    valid = [f.name for f in dataclasses.fields(cls) if f.name not in ("split", "seed", "size")]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} for task {name!r}; "
            f"valid options: {', '.join(valid) or 'none'}"
        )
    return cls(split=split, seed=seed, size=size, **options)
