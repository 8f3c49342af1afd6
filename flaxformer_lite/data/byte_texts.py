"""Many short texts as one byte array, built and hashed in NumPy: what synthetic generators draw.

:class:`ByteTexts` holds ``n`` UTF-8 texts end to end with their ``n + 1`` offsets. Texts are
*rendered* from parts side by side: each part is a byte matrix ``[n, W]`` and per-text lengths
``[n]`` (the first ``length`` bytes of a row are the part's text for that row): words looked up in
a table, literals, decimal numbers. :func:`stable_hash` gives each text a 64-bit hash that is the
same on every machine and in every process. :class:`Drawn` holds a synthetic generator's examples.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from flaxformer_lite.data.rows import ranges
from flaxformer_lite.data.tokenizers import NUM_SPECIAL, ByteTokenizer, Tokenizer

Part = tuple[np.ndarray, np.ndarray]  # (uint8 [n, W], int64 lengths [n])

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)  # any odd constant: FNV's offset basis
_MIX = (np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53))  # MurmurHash3's fmix64
_POWERS = 10 ** np.arange(19, dtype=np.int64)
_LOW_BYTES = np.array([2 ** (8 * k) - 1 for k in range(9)], np.uint64)  # the low k bytes of a word


@dataclasses.dataclass(frozen=True)
class ByteTexts:
    """``n`` texts: text ``i`` is ``data[offsets[i]:offsets[i + 1]]``, UTF-8."""

    data: np.ndarray  # uint8 [total]
    offsets: np.ndarray  # int64 [n + 1]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @classmethod
    def from_strings(cls, texts: Sequence[str]) -> ByteTexts:
        encoded = [text.encode("utf-8") for text in texts]
        lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
        data = np.frombuffer(b"".join(encoded), np.uint8)
        return cls(data, np.concatenate([[0], np.cumsum(lengths)]))

    @classmethod
    def concatenate(cls, parts: Sequence[ByteTexts]) -> ByteTexts:
        data = np.concatenate([p.data for p in parts])
        ends = np.cumsum([p.offsets[-1] for p in parts]) - [p.offsets[-1] for p in parts]
        offsets = [p.offsets[1:] + end for p, end in zip(parts, ends, strict=True)]
        return cls(data, np.concatenate([[0], *offsets]))

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def text(self, index: int) -> str:
        return self.data[self.offsets[index] : self.offsets[index + 1]].tobytes().decode("utf-8")

    def take(self, indices: np.ndarray) -> ByteTexts:
        """The texts ``indices``, in that order."""
        lengths = self.lengths[indices]
        owner, within = ranges(lengths)
        data = self.data[self.offsets[indices][owner] + within]
        return ByteTexts(data, np.concatenate([[0], np.cumsum(lengths)]))


@dataclasses.dataclass(frozen=True)
class Drawn:
    """A synthetic generator's examples: texts per record field, the input that decides each one's
    split (the first ``key_lengths`` bytes of field ``key_field``), its hash and class labels,
    if any."""

    fields: dict[str, ByteTexts]
    key_field: str
    key_lengths: np.ndarray
    labels: np.ndarray | None = None
    hashes: np.ndarray | None = None  # uint64 [n], stable_hash of the keys

    def __post_init__(self):
        if self.hashes is None:
            hashes = stable_hash(self.fields[self.key_field], self.key_lengths)
            object.__setattr__(self, "hashes", hashes)

    def __len__(self) -> int:
        return len(self.key_lengths)

    def take(self, indices: np.ndarray) -> Drawn:
        return Drawn(
            {name: texts.take(indices) for name, texts in self.fields.items()},
            self.key_field,
            self.key_lengths[indices],
            None if self.labels is None else self.labels[indices],
            self.hashes[indices],
        )

    @staticmethod
    def concatenate(parts: Sequence[Drawn]) -> Drawn:
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        return Drawn(
            {name: ByteTexts.concatenate([p.fields[name] for p in parts]) for name in first.fields},
            first.key_field,
            np.concatenate([p.key_lengths for p in parts]),
            None if first.labels is None else np.concatenate([p.labels for p in parts]),
            np.concatenate([p.hashes for p in parts]),
        )


def render(parts: Sequence[Part]) -> ByteTexts:
    """Each row's texts of ``parts``, one after the other."""
    offsets = np.concatenate([[0], np.cumsum(sum(lengths for _, lengths in parts))])
    data = np.empty(offsets[-1], np.uint8)
    starts = offsets[:-1].copy()
    for values, lengths in parts:  # each part's bytes straight to their places
        owner, within = ranges(lengths)
        data[starts[owner] + within] = values[owner, within]
        starts += lengths
    return ByteTexts(data, offsets)


def table(words: Sequence[str]) -> Part:
    """``words`` as a byte matrix ``[len(words), longest]`` and their lengths, to be indexed by
    :func:`lookup`."""
    encoded = [word.encode("utf-8") for word in words]
    width = max(map(len, encoded))
    matrix = np.frombuffer(b"".join(w.ljust(width, b"\0") for w in encoded), np.uint8)
    return matrix.reshape(len(words), width), np.array(list(map(len, encoded)), np.int64)


def lookup(words: Part, indices: np.ndarray, present: np.ndarray | bool = True) -> Part:
    """Word ``indices[i]`` of the table in row ``i``, or nothing where not ``present``."""
    values, lengths = words
    return values[indices], np.where(present, lengths[indices], 0)


def literal(text: str, count: int, present: np.ndarray | bool = True) -> Part:
    """``text`` in each of ``count`` rows (where ``present``)."""
    row = np.frombuffer(text.encode("utf-8"), np.uint8)
    values = np.broadcast_to(row, (count, len(row)))
    return values, np.where(present, len(row), np.zeros(count, np.int64))


def number_of_digits(numbers: np.ndarray) -> np.ndarray:
    """Decimal digits of each of ``0 <= numbers < 10**19`` (1 for 0)."""
    return np.maximum(np.searchsorted(_POWERS, numbers, side="right"), 1)


def decimal(numbers: np.ndarray, present: np.ndarray | bool = True) -> Part:
    """Non-negative int64 ``numbers`` in decimal, without leading zeros."""
    numbers = np.asarray(numbers, np.int64)
    digits = number_of_digits(numbers)
    width = int(digits.max(initial=1))
    exponent = np.clip(digits[:, None] - 1 - np.arange(width), 0, None)
    values = (numbers[:, None] // _POWERS[exponent]) % 10 + ord("0")
    return values.astype(np.uint8), np.where(present, digits, 0)


def padded_decimal(numbers: np.ndarray, width: int) -> Part:
    """Non-negative int64 ``numbers`` in decimal with ``width`` digits (leading zeros)."""
    exponent = width - 1 - np.arange(width)
    values = np.asarray(numbers, np.int64)[:, None] // _POWERS[exponent] % 10 + ord("0")
    return values.astype(np.uint8), np.full(len(numbers), width, np.int64)


def backwards(part: Part) -> Part:
    """Each text of ``part`` reversed."""
    values, lengths = part
    reading = np.clip(lengths[:, None] - 1 - np.arange(values.shape[1]), 0, None)
    return np.take_along_axis(values, reading, axis=1), lengths


def stable_hash(texts: ByteTexts, lengths: np.ndarray | None = None) -> np.ndarray:
    """uint64 ``[n]``: a hash of each text's bytes (of its first ``lengths[i]`` bytes if given).

    The bytes are read 8 at a time as little-endian words (the last one zero-padded; the length
    is hashed first), each word xor-ed in, multiplied and shifted, then MurmurHash3's ``fmix64``
    mixes every bit. The same on every machine and in every process.
    """
    lengths = texts.lengths if lengths is None else np.asarray(lengths, np.int64)
    words = (lengths + 7) // 8
    # [words, n]: word k of every text in row k, read as 8 bytes from where it starts.
    number = np.arange(int(words.max(initial=0)))[:, None]
    starts = np.where(number < words, texts.offsets[:-1] + 8 * number, 0)
    padded = np.concatenate([texts.data, np.zeros(8, np.uint8)])
    eight = np.lib.stride_tricks.sliding_window_view(padded, 8)
    matrix = eight[starts].view("<u8")[..., 0].astype(np.uint64)
    matrix &= _LOW_BYTES[np.clip(lengths - 8 * number, 0, 8)]  # bytes past the end: 0
    hashes = _fmix(lengths.astype(np.uint64) + _FNV_OFFSET)
    for k, word in enumerate(matrix):
        mixed = (hashes ^ word) * _MIX[0]
        mixed ^= mixed >> np.uint64(29)
        np.copyto(hashes, mixed, where=k < words)
    return _fmix(hashes)


def _fmix(hashes: np.ndarray) -> np.ndarray:
    hashes = hashes ^ (hashes >> np.uint64(33))
    hashes *= _MIX[0]
    hashes ^= hashes >> np.uint64(33)
    hashes *= _MIX[1]
    hashes ^= hashes >> np.uint64(33)
    return hashes


def tokenize(
    tokenizer: Tokenizer, texts: ByteTexts, *, target: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """``(ids end to end, offsets [n + 1])`` of ``texts``: unsigned ids, 16 bits if the
    vocabulary fits. Byte ids in one array op; other tokenizers through their batched encoder (the
    target side's if ``target``)."""
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    if isinstance(tokenizer, ByteTokenizer):
        ids = texts.data.astype(dtype)
        ids += NUM_SPECIAL
        return ids, texts.offsets
    encode_batch = tokenizer.encode_target_batch if target else tokenizer.encode_batch
    ids = encode_batch([texts.text(i) for i in range(len(texts))])
    lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype, int(lengths.sum()))
    return tokens, np.concatenate([[0], np.cumsum(lengths)])
