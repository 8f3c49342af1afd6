"""The base of the synthetic generators (:mod:`.synthetic`): a deterministic sequence of
examples drawn by chunks, each split's own by a stable hash of its input (:func:`split_of`), and
the caches of drawn chunks and of tokenized documents that a run's evaluations reuse.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import operator
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from flaxformer_lite.data.byte_texts import (
    ByteTexts,
    Drawn,
    stable_hash,
    tokenize,
)
from flaxformer_lite.data.documents import (
    Documents,
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


def check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    in_range = isinstance(value, int | np.integer) and not isinstance(value, bool)
    in_range = in_range and low <= value and (high is None or value <= high)
    if not in_range:
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")


def sample_numbers(rng: np.random.Generator, count: int, max_value: int) -> np.ndarray:
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
        check_int("seed", self.seed, 0)
        if self.size is None:
            object.__setattr__(self, "size", DEFAULT_SIZES[self.split])
        check_int("size", self.size, 1, MAX_SIZE)
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
