"""LM rows from documents (data/rows.py): the batch contract, every epoch's coverage, windows
and packed documents, and rows as pure functions of their global index."""

import numpy as np
import pytest

from flaxformer_lite.data.documents import from_ids
from flaxformer_lite.data.rows import Packed, Windows, epoch_order

SOS, EOS, T = 1, 2, 16
LM_ROWS = {"windows": Windows, "documents": Packed}


def corpus(count=60, longest=40, seed=0):
    """Documents of 0 to ``longest`` random ids (some longer than T, one empty)."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(4, 300, rng.integers(1, longest + 1)) for _ in range(count)]
    docs[3] = []
    return from_ids({"text": docs}, np.arange(count), dtype=np.uint16)


DOCUMENTS = corpus()
TRAIN = np.arange(0, 60, 3)  # every third document is a training one


def sequence(documents, doc):
    """``(<sos> doc, doc <eos>)``: a document's inputs and targets, one per position."""
    ids = documents.document("text", doc).astype(np.int32).tolist()
    return [SOS, *ids], [*ids, EOS]


def segments(batch):
    """Each row's segments, left to right: ``(row, inputs, targets)``; checks the contract."""
    found = []
    for row, (inputs, targets, weights, ids, positions) in enumerate(
        zip(
            *(batch[k] for k in ("inputs", "targets", "weights", "segment_ids", "positions")),
            strict=True,
        )
    ):
        np.testing.assert_array_equal(weights > 0, ids > 0)
        assert not (inputs[ids == 0].any() or targets[ids == 0].any() or positions[ids == 0].any())
        filled = int((ids > 0).sum())
        assert (ids[:filled] > 0).all()  # padding only at the end
        np.testing.assert_array_equal(np.unique(ids[:filled]), np.arange(1, ids.max() + 1))
        for segment in range(1, ids.max() + 1):
            where = ids == segment
            np.testing.assert_array_equal(positions[where], np.arange(where.sum()))
            np.testing.assert_array_equal(inputs[where][1:], targets[where][:-1])  # the shift
            found.append((row, inputs[where].tolist(), targets[where].tolist()))
    return found


def pieces_of(documents, order):
    """Each document of ``order`` cut into pieces of ``T`` positions from its start, in order."""
    expected = []
    for doc in order:
        inputs, targets = sequence(documents, doc)
        expected += [(inputs[k : k + T], targets[k : k + T]) for k in range(0, len(inputs), T)]
    return expected


def rows_of_epoch(found, rows_in_epoch):
    """The rows of ``found`` segments that belong to one epoch, each a tuple of its segments,
    as a sorted list (a multiset: the epoch's row order is shuffled)."""
    by_row = {}
    for row, inputs, targets in found:
        if row in rows_in_epoch:
            by_row.setdefault(row, []).append((tuple(inputs), tuple(targets)))
    return sorted(tuple(segments) for segments in by_row.values())


def next_fit(pieces, pack):
    """Pieces packed into rows of ``T`` in order, next-fit (or one a row)."""
    out, row, fill = [], [], 0
    for inputs, targets in pieces:
        if row and (not pack or fill + len(inputs) > T):
            out.append(tuple(row))
            row, fill = [], 0
        row.append((tuple(inputs), tuple(targets)))
        fill += len(inputs)
    return [*out, tuple(row)]


@pytest.mark.parametrize("pack", [True, False])
def test_packed_rows_hold_every_position_of_every_training_document_once_per_epoch(pack):
    packed = Packed(DOCUMENTS, TRAIN, T, seed=5, pack=pack)
    rows = packed.rows(0, 90, SOS, EOS)
    epoch_of = np.array([packed.epoch_of(j) for j in range(90)])
    assert epoch_of[-1] >= 2  # a few whole epochs
    found = segments(rows)
    orders = []
    for epoch in range(2):
        order = epoch_order(TRAIN, 5, epoch)
        orders.append(order.tolist())
        # A document longer than a row goes on in the next piece, from position 0: none is cut;
        # the pieces are packed next-fit in the epoch's order, and the rows then shuffled.
        expected = sorted(next_fit(pieces_of(DOCUMENTS, order), pack))
        got = rows_of_epoch(found, set(np.flatnonzero(epoch_of == epoch).tolist()))
        assert got == expected
        positions = sum(len(i) for row in got for i, _ in row)
        assert positions == int((DOCUMENTS.lengths("text")[TRAIN] + 1).sum())
    assert orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1]) == TRAIN.tolist()


def test_a_document_ten_rows_long_reaches_the_model_whole_in_every_layout():
    long_doc = np.arange(4, 4 + 10 * T - 1) % 300 + 4  # 10 * T positions with <sos>/<eos>
    documents = from_ids({"text": [long_doc, [5, 6, 7]]}, np.arange(2), dtype=np.uint16)
    ids = np.arange(2)
    for rows_of in (Windows(documents, ids, T, seed=0), Packed(documents, ids, T, seed=0)):
        rows = rows_of.rows(0, 11, SOS, EOS)
        targets = rows["targets"][rows["weights"] > 0]
        counted = np.bincount(targets, minlength=400)
        expected = np.bincount(np.concatenate([long_doc, [5, 6, 7], [EOS, EOS]]), minlength=400)
        np.testing.assert_array_equal(counted, expected)


def test_unshuffled_rows_take_the_documents_in_the_order_given():
    packed = Packed(DOCUMENTS, TRAIN, T, seed=5, shuffle=False)
    found = segments(packed.rows(0, packed.rows_in_epoch(0), SOS, EOS))
    assert [(i, t) for _, i, t in found] == pieces_of(DOCUMENTS, TRAIN)


def test_windows_cut_each_epochs_stream_into_rows_and_pad_only_its_last_row():
    windows = Windows(DOCUMENTS, TRAIN, T, seed=5)
    per_epoch = windows.rows_per_epoch
    lengths = DOCUMENTS.lengths("text")[TRAIN]
    assert per_epoch == -(-int((lengths + 1).sum()) // T)
    rows = windows.rows(0, 3 * per_epoch, SOS, EOS)
    found = segments(rows)
    for epoch in range(3):
        stream = []  # (input, target, starts a document) per position
        for doc in epoch_order(TRAIN, 5, epoch):
            inputs, targets = sequence(DOCUMENTS, doc)
            stream += [(i, t, k == 0) for k, (i, t) in enumerate(zip(inputs, targets, strict=True))]
        expected = []
        for begin in range(0, len(stream), T):  # each window's segments: documents in it
            window, cut = stream[begin : begin + T], []
            for k, position in enumerate(window):
                if k == 0 or position[2]:
                    cut.append(([], []))
                cut[-1][0].append(position[0])
                cut[-1][1].append(position[1])
            expected.append(tuple((tuple(i), tuple(t)) for i, t in cut))
        in_epoch = set(range(epoch * per_epoch, (epoch + 1) * per_epoch))
        assert rows_of_epoch(found, in_epoch) == sorted(expected)
        weights = rows["weights"][epoch * per_epoch : (epoch + 1) * per_epoch]
        assert (weights.sum(1) < T).sum() == 1 and weights.sum() == len(stream)
    # A long document goes on in the next row, as a new segment from position 0.
    assert any(row_ids[0] != SOS for row_ids in rows["inputs"][1:per_epoch])


def test_an_epochs_rows_come_shuffled_not_in_the_order_they_were_cut():
    """One long document (a book): consecutive rows are not consecutive windows of it."""
    book = from_ids({"text": [np.arange(40 * T) % 250 + 4]}, np.arange(1), dtype=np.uint16)
    for rows_of in (Windows(book, np.arange(1), T, seed=0), Packed(book, np.arange(1), T, seed=0)):
        firsts = rows_of.rows(0, 41, SOS, EOS)["targets"][:, 0].tolist()  # 40 T + 1 positions
        cut_order = [(k * T) % 250 + 4 for k in range(40)] + [EOS]
        assert sorted(firsts) == sorted(cut_order) and firsts != cut_order


@pytest.mark.parametrize("lm_rows", sorted(LM_ROWS))
def test_rows_are_pure_functions_of_their_global_index(lm_rows):
    whole = LM_ROWS[lm_rows](DOCUMENTS, TRAIN, T, seed=1).rows(0, 90, SOS, EOS)
    pieces = LM_ROWS[lm_rows](DOCUMENTS, TRAIN, T, seed=1)
    parts = [pieces.rows(first, 7, SOS, EOS) for first in range(0, 84, 7)]
    for key, value in whole.items():
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), value[:84], key)
    # A fresh builder asked for late rows first (a resumed run) makes the same rows.
    late = LM_ROWS[lm_rows](DOCUMENTS, TRAIN, T, seed=1).rows(70, 20, SOS, EOS)
    for key, value in late.items():
        np.testing.assert_array_equal(value, whole[key][70:], key)
    other = LM_ROWS[lm_rows](DOCUMENTS, TRAIN, T, seed=2).rows(0, 90, SOS, EOS)
    assert (other["inputs"] != whole["inputs"]).any()


def test_rows_have_the_batch_dtypes_and_shapes():
    rows = Packed(DOCUMENTS, TRAIN, T, seed=0).rows(0, 4, SOS, EOS)
    assert {k: (v.shape, v.dtype.name) for k, v in rows.items()} == {
        **{k: ((4, T), "int32") for k in ("inputs", "targets", "segment_ids", "positions")},
        "weights": ((4, T), "float32"),
    }


def test_an_empty_document_is_one_position_and_a_corpus_of_empty_documents_works():
    empty = from_ids({"text": [[], [], []]}, np.arange(3))
    for rows_class in LM_ROWS.values():
        rows = rows_class(empty, np.arange(3), 4, seed=0).rows(0, 2, SOS, EOS)
        np.testing.assert_array_equal(rows["inputs"][0], [SOS, SOS, SOS, 0])
        np.testing.assert_array_equal(rows["targets"][0], [EOS, EOS, EOS, 0])
        np.testing.assert_array_equal(rows["segment_ids"][0], [1, 2, 3, 0])


def test_ids_of_32_bit_stores_come_through():
    big = from_ids({"text": [[70_000, 5], [100_000]]}, np.arange(2), dtype=np.uint32)
    rows = Windows(big, np.arange(2), 8, seed=0).rows(0, 1, SOS, EOS)
    assert sorted(rows["targets"][0][:5].tolist()) == sorted([70_000, 5, EOS, 100_000, EOS])
