"""Tokenized documents, concatenated: the one form every training source reaches before batching.

A corpus of ``N`` documents keeps, per field (``"text"``, or ``"source"`` and ``"target"`` for
parallel data), all token ids end to end in one flat array and the ``N + 1`` offsets where each
document starts: document ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``. Arrays are numpy,
in memory (synthetic generators) or memory-mapped from a prepared store on disk
(:mod:`flaxformer_lite.data.store`), so any document or window is a slice, read in O(1).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

# The types of records a source holds (text, source/target pairs, labelled text), named as the
# tasks that first trained on them; a task says which it accepts (data.tasks).
TEXT_RECORDS, PAIR_RECORDS, LABELLED_RECORDS = "lm", "seq2seq", "classification"
# The fields of each type's documents (labelled text keeps its labels beside its text).
FIELDS = {TEXT_RECORDS: ("text",), PAIR_RECORDS: ("source", "target")}


@dataclasses.dataclass(frozen=True)
class Documents:
    """``N`` tokenized documents.

    Attributes:
      tokens: field name -> every document's ids end to end, unsigned ints ``[n_tokens]``.
      offsets: field name -> int64 ``[N + 1]``, ``offsets[0] == 0``, non-decreasing.
      digests: uint64 ``[N]``, a hash of each document's text: :func:`split_documents` holds out
        the documents of least digest, so the split depends on content, not on order or seed.
      labels: int32 ``[N]`` class indices of a classification corpus, else None.
      vocab_size: every id is below it (a store's tokenizer's: :meth:`checked` refuses one
        that is not, as it is read); None: not checked (ids made in memory).
      files: field name -> the file its ids are read from, named by :meth:`checked`.
    """

    tokens: Mapping[str, np.ndarray]
    offsets: Mapping[str, np.ndarray]
    digests: np.ndarray
    labels: np.ndarray | None = None
    vocab_size: int | None = None
    files: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.digests)

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(self.tokens)

    def document(self, field: str, index: int) -> np.ndarray:
        """The ids of document ``index`` of ``field``, a view ``[n]``."""
        start, stop = self.offsets[field][index : index + 2]
        return self.checked(field, self.tokens[field][start:stop])

    def checked(self, field: str, ids: np.ndarray) -> np.ndarray:
        """``ids`` read from ``field``, each checked to be below :attr:`vocab_size` (a max over
        what is read: a store's sizes and checksums leave its tokens unchecked on open).

        Raises:
          ValueError: an id past the vocabulary, naming the file and the id (a corrupt store).
        """
        if self.vocab_size is not None and ids.size and (top := int(ids.max())) >= self.vocab_size:
            raise ValueError(
                f"{self.files.get(field, field)}: token id {top} is not in the vocabulary of the "
                f"store's tokenizer ({self.vocab_size} ids): a corrupt file (prepare the store "
                "again)"
            )
        return ids

    def lengths(self, field: str) -> np.ndarray:
        """int64 ``[N]``: every document's number of ids."""
        return np.diff(self.offsets[field])


def text_digests(fields: Mapping[str, Sequence[str]]) -> np.ndarray:
    """uint64 ``[n]``: each document's digest, blake2b (8 bytes, little-endian) of its field
    texts (one, or source and target joined by a tab), for ``n`` documents given by field."""
    columns = list(fields.values())
    docs = columns[0] if len(columns) == 1 else map("\t".join, zip(*columns, strict=True))
    blake2b = hashlib.blake2b
    digests = [blake2b(d.encode("utf-8", "surrogatepass"), digest_size=8).digest() for d in docs]
    return np.frombuffer(b"".join(digests), "<u8").astype(np.uint64)


def from_ids(
    fields: Mapping[str, Iterable[Sequence[int]]],
    digests: Sequence[int],
    labels: Sequence[int] | None = None,
    dtype: np.dtype | str = np.uint32,
) -> Documents:
    """In-memory :class:`Documents` from per-document id lists (one iterable per field)."""
    tokens, offsets = {}, {}
    for name, documents in fields.items():
        documents = [np.asarray(d, dtype) for d in documents]
        lengths = np.fromiter((len(d) for d in documents), np.int64, len(documents))
        offsets[name] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        tokens[name] = np.concatenate(documents) if documents else np.zeros(0, dtype)
    labels = None if labels is None else np.asarray(labels, np.int32)
    return Documents(tokens, offsets, np.asarray(digests, np.uint64), labels)


def split_documents(
    digests: np.ndarray, fraction: float, where: str
) -> tuple[np.ndarray, np.ndarray]:
    """``(train ids, validation ids)``, each ascending: the ``round(fraction * N)`` documents of
    least digest (ties by index) are held out.

    Raises:
      ValueError: naming ``where`` (the data path) if either part would be empty.
    """
    count = round(fraction * len(digests))
    if not 0 < count < len(digests):
        raise ValueError(
            f"{where}: {len(digests)} documents cannot be split by data.validation_fraction="
            f"{fraction} into non-empty training and validation sets"
        )
    order = np.argsort(digests, kind="stable")  # stable: equal digests stay in index order
    held_out = np.zeros(len(digests), bool)
    held_out[order[:count]] = True
    return np.flatnonzero(~held_out), np.flatnonzero(held_out)


def hold_out_tails(
    documents: Documents, fraction: float, where: str
) -> tuple[Documents, np.ndarray, np.ndarray]:
    """``(pieces, train ids, validation ids)``: every document cut in two, as nanoGPT splits a
    text file: its first ``int(n * (1 - fraction))`` ids train, the rest are held out. Document
    ``i``'s head is piece ``2 i`` and its tail piece ``2 i + 1``; empty pieces are left out.

    Raises:
      ValueError: naming ``where`` if no id would be held out, or none trained on.
    """
    starts, ends = documents.offsets["text"][:-1], documents.offsets["text"][1:]
    cuts = starts + ((ends - starts) * (1 - fraction)).astype(np.int64)
    offsets = np.stack([starts, cuts], axis=1).reshape(-1)
    offsets = np.concatenate([offsets, ends[-1:]]).astype(np.int64)
    lengths = np.diff(offsets)
    train, valid = np.flatnonzero(lengths[0::2]) * 2, np.flatnonzero(lengths[1::2]) * 2 + 1
    if not (lengths[0::2].any() and lengths[1::2].any()):
        raise ValueError(
            f"{where}: {int(lengths.sum())} tokens cannot be split by data.validation_fraction="
            f"{fraction} into non-empty training and validation parts"
        )
    pieces = dataclasses.replace(
        documents,
        tokens={"text": documents.tokens["text"]},
        offsets={"text": offsets},
        digests=np.repeat(documents.digests, 2),
        labels=None,
    )
    return pieces, train, valid
