"""Language-model rows from :class:`~flaxformer_lite.data.documents.Documents`, in NumPy.

A document of ``L`` ids has ``L + 1`` *positions* ``p = 0 .. L``: its input is ``<sos>`` at
``p = 0`` and id ``p - 1`` after that; its target is id ``p`` for ``p < L`` and ``<eos>`` at
``p = L`` (the ``inputs = <sos> doc``, ``targets = doc <eos>`` of
:mod:`flaxformer_lite.data.features`). A row of ``T`` columns holds *pieces*: runs of one
document's positions, side by side from column 0. Each piece is a segment of its row
(``segment_ids`` 1, 2, ... from the left, 0 at padding) with ``positions`` counting from 0 in it,
so attention never crosses documents. A piece that goes on with a document begun in an earlier
row starts at position 0 too, as in Grain's ``ConcatThenSplitIterDataset``: positions stay below
``T``, which every model's position table covers, and the piece sees nothing of its beginning.

Training rows come in epochs: epoch ``e`` visits the training documents in an order shuffled by
``(seed, e)``. :class:`Windows` cuts that order's positions, end to end, into rows of ``T``: no
position is lost and none is padding but the end of an epoch's last row. :class:`Packed` cuts
each document into pieces of ``T`` positions from its start (the last one shorter), as Hugging
Face's ``group_texts`` cuts text into blocks, and packs the pieces into rows next-fit in the
epoch's order (or, with ``pack=False``, one piece per row): every position of every training
document is in exactly one row of each epoch, whichever layout, and a document of at most ``T``
positions is never cut. An epoch's rows are then handed out in an order shuffled by
``(seed, epoch)`` too: the pieces of a long document (a book as one document) would otherwise
fill whole batches with one passage, where nanoGPT samples windows at random offsets. Global row
``j`` counts rows over all epochs; a row is a pure function of ``(documents, training ids, T,
seed, j)``, whatever process makes it. With ``shuffle=False`` both orders are the given ones:
evaluation reads its documents that way, in one epoch.
"""

from __future__ import annotations

import abc
import math

import numpy as np

from flaxformer_lite.data.documents import Documents

_ORDER_STREAM = 0x0D0C  # keeps the epoch orders apart from other draws made from the seed
_ROW_STREAM = 0x0D0D


def epoch_order(ids: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """``ids`` in epoch ``epoch``'s order: shuffled by ``(seed, epoch)``."""
    return np.random.default_rng([seed, epoch, _ORDER_STREAM]).permutation(ids)


def ranges(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(owner, within)``, each ``[counts.sum()]``: element ``k`` of the concatenated ranges
    ``arange(counts[0]), arange(counts[1]), ...`` is ``within[k]`` of range ``owner[k]``."""
    counts = np.asarray(counts, np.int64)
    firsts = np.cumsum(counts) - counts
    total = int(firsts[-1] + counts[-1]) if counts.size else 0
    owner = np.repeat(np.arange(counts.size), counts)
    return owner, np.arange(total) - firsts[owner]


def assemble(
    documents: Documents,
    count: int,
    seq_len: int,
    *,
    row: np.ndarray,
    doc: np.ndarray,
    start: np.ndarray,
    length: np.ndarray,
    sos_id: int,
    eos_id: int,
    field: str = "text",
) -> dict[str, np.ndarray]:
    """``count`` rows of ``[T]`` from pieces; piece ``k`` is positions ``[start[k], start[k] +
    length[k])`` of document ``doc[k]``, in row ``row[k]``. Pieces come in row order and, within
    a row, from left to right; each row's pieces fill it from column 0.

    Returns ``inputs``, ``targets``, ``segment_ids``, ``positions`` (int32) and ``weights``
    (float32) ``[count, T]``: 1 at every position a piece fills, 0 (ids 0) at the padding after.
    """
    tokens, offsets = documents.tokens[field], documents.offsets[field]
    if not tokens.size:  # only empty documents: every position is <sos> or <eos>
        tokens = np.zeros(1, np.int32)
    length = length.astype(np.int64)
    fill = np.bincount(row, weights=length, minlength=count).astype(np.int64)
    filled = np.arange(seq_len) < fill[:, None]  # [count, T]
    owner, within = ranges(length)
    base = offsets[doc] + start  # where each piece's first target id is
    index = base[owner] + within
    # The first position of a document reads <sos>, the last one <eos>: set after the gathers
    # (index may point one past the end of ``tokens`` there, so it is clipped).
    firsts = np.cumsum(length) - length
    sos = firsts[start == 0]
    eos = (firsts + length - 1)[start + length == offsets[doc + 1] - offsets[doc] + 1]
    inputs = documents.checked(field, tokens[index - 1])
    inputs[sos] = sos_id
    index[eos] = 0
    targets = documents.checked(field, tokens[index])
    targets[eos] = eos_id
    per_row = np.bincount(row, minlength=count)
    segments = np.arange(row.size) - (np.cumsum(per_row) - per_row)[row] + 1
    values = {"inputs": inputs, "targets": targets, "segment_ids": segments[owner]}
    values["positions"] = within
    arrays = {}
    for key, value in values.items():
        array = np.zeros((count, seq_len), np.int32)
        array[filled] = value
        arrays[key] = array
    arrays["weights"] = filled.astype(np.float32)
    return arrays


class _Epochs(abc.ABC):
    """Per-epoch plans of the training documents ``ids``, made when first asked for and kept for
    the last two epochs (a global batch spans few)."""

    def __init__(self, ids: np.ndarray, seed: int, shuffle: bool = True):
        self.ids, self.seed, self.shuffle = np.asarray(ids, np.int64), seed, shuffle
        self._plans: dict[int, tuple] = {}

    def order(self, epoch: int) -> np.ndarray:
        """The documents of ``epoch`` in the order its rows take them."""
        return epoch_order(self.ids, self.seed, epoch) if self.shuffle else self.ids

    def row_order(self, epoch: int, count: int) -> np.ndarray:
        """Which of ``epoch``'s ``count`` rows (in the order they were cut) comes when."""
        if not self.shuffle:
            return np.arange(count)
        return np.random.default_rng([self.seed, epoch, _ROW_STREAM]).permutation(count)

    def plan(self, epoch: int):
        if epoch not in self._plans:
            if len(self._plans) >= 2:
                del self._plans[min(self._plans)]
            self._plans[epoch] = self._make_plan(epoch)
        return self._plans[epoch]

    @abc.abstractmethod
    def _make_plan(self, epoch: int):
        """The plan of ``epoch``, whatever the subclass needs to make its rows."""


class Shuffled(_Epochs):
    """One document per row: global row ``j`` is document ``j % N`` of epoch ``j // N``'s
    order."""

    def _make_plan(self, epoch: int) -> np.ndarray:
        return self.order(epoch)

    def documents_of(self, first: int, count: int) -> np.ndarray:
        """The documents of global rows ``[first, first + count)``, int64 ``[count]``."""
        rows = np.arange(first, first + count)
        docs = np.empty(count, np.int64)
        for epoch in np.unique(rows // len(self.ids)).tolist():
            local = rows // len(self.ids) == epoch
            docs[local] = self.plan(epoch)[rows[local] % len(self.ids)]
        return docs


class _LMRows(_Epochs):
    def __init__(
        self, documents: Documents, ids: np.ndarray, seq_len: int, seed: int, shuffle: bool = True
    ):
        super().__init__(ids, seed, shuffle)
        self.documents, self.seq_len = documents, seq_len
        self.lengths = documents.lengths("text")

    def _assemble(self, pieces: list[tuple], count: int, sos_id: int, eos_id: int):
        """The ``count`` rows from their pieces: ``(row, document, start, length)`` arrays (none
        when ``count`` is 0: a process's empty share of the last eval batch)."""
        pieces = pieces or [(np.zeros(0, np.int64),) * 4]
        row, doc, start, length = (np.concatenate(p) for p in zip(*pieces, strict=True))
        return assemble(
            self.documents,
            count,
            self.seq_len,
            row=row,
            doc=doc,
            start=start,
            length=length,
            sos_id=sos_id,
            eos_id=eos_id,
        )


class Windows(_LMRows):
    """Each epoch's documents end to end, cut into rows of ``T`` positions; the epoch's last
    row is padded. Every epoch has :attr:`rows_per_epoch` rows."""

    def __init__(self, documents: Documents, ids: np.ndarray, seq_len: int, seed: int):
        super().__init__(documents, ids, seq_len, seed)
        self.stream_length = int(self.lengths[self.ids].sum()) + len(self.ids)
        self.rows_per_epoch = math.ceil(self.stream_length / seq_len)

    def _make_plan(self, epoch: int) -> tuple:
        order = self.order(epoch)
        ends = np.cumsum(self.lengths[order] + 1)
        starts = np.concatenate([[0], ends])  # where each document's positions start
        return order, starts, self.row_order(epoch, self.rows_per_epoch)

    def rows(self, first: int, count: int, sos_id: int, eos_id: int) -> dict[str, np.ndarray]:
        """Global rows ``[first, first + count)``."""
        pieces = []
        rows = np.arange(first, first + count)
        for epoch in np.unique(rows // self.rows_per_epoch).tolist():
            local = np.flatnonzero(rows // self.rows_per_epoch == epoch)
            order, starts, row_order = self.plan(epoch)
            begin = row_order[rows[local] % self.rows_per_epoch] * self.seq_len
            end = np.minimum(begin + self.seq_len, self.stream_length)
            first_doc = np.searchsorted(starts, begin, side="right") - 1
            last_doc = np.searchsorted(starts, end, side="left") - 1
            owner, within = ranges(last_doc - first_doc + 1)
            i = first_doc[owner] + within
            start = np.maximum(begin[owner] - starts[i], 0)
            stop = np.minimum(end[owner] - starts[i], starts[i + 1] - starts[i])
            pieces.append((local[owner], order[i], start, stop - start))
        return self._assemble(pieces, count, sos_id, eos_id)


class Packed(_LMRows):
    """Documents cut into pieces of at most ``T`` positions, packed next-fit into rows in each
    epoch's order (one piece per row if not ``pack``). Epochs have different numbers of rows;
    the first epochs' plans are made (once) to find where a later epoch starts."""

    def __init__(
        self,
        documents: Documents,
        ids: np.ndarray,
        seq_len: int,
        seed: int,
        *,
        pack: bool = True,
        shuffle: bool = True,
    ):
        super().__init__(documents, ids, seq_len, seed, shuffle)
        self.pack = pack
        self._first_rows = [0]  # global index of each planned epoch's first row, and one more

    def _make_plan(self, epoch: int) -> tuple:
        order = self.order(epoch)
        sizes = self.lengths[order] + 1  # positions per document
        doc, k = ranges(-(-sizes // self.seq_len))  # piece k of document doc (in the order)
        start = k * self.seq_len
        length = np.minimum(sizes[doc] - start, self.seq_len)
        if self.pack:
            ends = np.concatenate([[0], np.cumsum(length)])
            # A row that opens with piece i takes pieces [i, stop[i]): all that fit in T.
            stop = (np.searchsorted(ends, ends[:-1] + self.seq_len, side="right") - 1).tolist()
            opening, i = [], 0
            while i < len(stop):  # one step per row, not per piece
                opening.append(i)
                i = stop[i]
            opening.append(len(stop))
        else:
            opening = range(len(doc) + 1)
        opening = np.array(opening, np.int64)
        return order[doc], start, length, opening, self.row_order(epoch, len(opening) - 1)

    def rows_in_epoch(self, epoch: int) -> int:
        return len(self.plan(epoch)[4])

    def epoch_of(self, row: int) -> int:
        """The epoch that global row ``row`` belongs to."""
        while self._first_rows[-1] <= row:
            epoch = len(self._first_rows) - 1
            self._first_rows.append(self._first_rows[-1] + self.rows_in_epoch(epoch))
        return int(np.searchsorted(self._first_rows, row, side="right")) - 1

    def rows(self, first: int, count: int, sos_id: int, eos_id: int) -> dict[str, np.ndarray]:
        """Global rows ``[first, first + count)``."""
        pieces = []
        row = first
        while row < first + count:
            epoch = self.epoch_of(row)
            end = min(first + count, self._first_rows[epoch + 1])
            doc, start, length, opening, row_order = self.plan(epoch)
            k = row_order[np.arange(row, end) - self._first_rows[epoch]]
            owner, within = ranges(opening[k + 1] - opening[k])
            i = opening[k][owner] + within
            local = np.arange(row - first, end - first)[owner]
            pieces.append((local, doc[i], start[i], length[i]))
            row = end
        return self._assemble(pieces, count, sos_id, eos_id)
