"""Batches from documents (data/batches.py, data/features.py): each process's rows of the same
global batches, one-document rows per task, eval batches, and the prefetching iterator's state,
errors and shutdown."""

import dataclasses
import gc
import json
import threading
import time

import numpy as np
import pytest

from flaxformer_lite.data.batches import (
    Layout,
    TrainBatches,
    TrainIterator,
    eval_batches,
    eval_row_count,
)
from flaxformer_lite.data.documents import from_ids
from flaxformer_lite.data.features import MASK_ID
from flaxformer_lite.data.tasks import task_named

SOS, EOS, T, B = 1, 2, 12, 8
RNG = np.random.default_rng(0)
TEXTS = [RNG.integers(4, 50, RNG.integers(1, 20)) for _ in range(40)]
SOURCES = [RNG.integers(4, 50, RNG.integers(1, 20)) for _ in range(40)]
DOCUMENTS = from_ids(
    {"text": TEXTS, "source": SOURCES, "target": TEXTS},
    np.arange(40),
    labels=RNG.integers(0, 3, 40),
    dtype=np.uint16,
)
TRAIN, VALID = np.arange(0, 40, 2), np.arange(1, 40, 4)  # 20 and 10 documents
ROWS = {"lm": ("documents", "windows", "single"), "seq2seq": ("single",)}
ROWS |= {"mlm": ("single",), "classify": ("single",)}
CASES = [(task, rows) for task, kinds in ROWS.items() for rows in kinds]


def layout(task="lm", rows="documents", index=0, count=1, **kwargs):
    values = dict(task=task_named(task), rows=rows, seq_len=T, batch_size=B, process_index=index)
    values |= dict(process_count=count, sos_id=SOS, eos_id=EOS, vocab_size=50)
    values |= dict(mlm_probability=0.3, seed=3)
    return Layout(**(values | kwargs))


@pytest.mark.parametrize("task, rows", CASES)
@pytest.mark.parametrize("count", [2, 4])
def test_process_k_of_n_makes_rows_k_of_the_same_global_batch(task, rows, count):
    whole = TrainBatches(DOCUMENTS, TRAIN, layout(task, rows))
    parts = [TrainBatches(DOCUMENTS, TRAIN, layout(task, rows, k, count)) for k in range(count)]
    for step in (0, 1, 7, 30):  # 30: several epochs in
        batch = whole(step)
        pieces = [part(step) for part in parts]
        assert pieces[0]["inputs"].shape[0] == B // count
        for key, value in batch.items():
            np.testing.assert_array_equal(np.concatenate([p[key] for p in pieces]), value, key)


def test_one_document_rows_per_task():
    docs = np.array([0, 5, 6])
    seq2seq = layout("seq2seq").document_rows(DOCUMENTS, docs, np.arange(3), 0)
    for row, doc in enumerate(docs):
        source = SOURCES[doc][: T - 1].tolist() + [EOS]  # cut, keeping its <eos>
        n = len(source)
        assert seq2seq["src"][row, :n].tolist() == source and not seq2seq["src"][row, n:].any()
        np.testing.assert_array_equal(seq2seq["src_mask"][row], np.arange(T) < n)
        target = [SOS, *TEXTS[doc].tolist(), EOS][: T + 1]  # cut before the shift
        m = len(target) - 1
        assert seq2seq["inputs"][row, :m].tolist() == target[:-1]
        assert seq2seq["targets"][row, :m].tolist() == target[1:]
        np.testing.assert_array_equal(seq2seq["weights"][row], np.arange(T) < m)
    classify = layout("classify").document_rows(DOCUMENTS, docs, np.arange(3), 0)
    np.testing.assert_array_equal(classify["labels"], DOCUMENTS.labels[docs])
    assert classify["weights"].tolist() == [1, 1, 1]
    for row, doc in enumerate(docs):
        framed = [SOS, *TEXTS[doc][: T - 2].tolist(), EOS]
        assert classify["inputs"][row, : len(framed)].tolist() == framed
        np.testing.assert_array_equal(classify["mask"][row], np.arange(T) < len(framed))


def test_mlm_masks_are_pure_functions_of_seed_stream_and_example_index():
    mlm = layout("mlm")
    docs = np.arange(20)
    first = mlm.document_rows(DOCUMENTS, docs, np.arange(20), 0)
    again = mlm.document_rows(DOCUMENTS, docs[5:], np.arange(5, 20), 0)
    for key, value in again.items():
        np.testing.assert_array_equal(value, first[key][5:], key)
    picked = first["weights"] > 0
    np.testing.assert_array_equal(first["inputs"][~picked], first["targets"][~picked])
    assert (first["inputs"][picked] == MASK_ID).mean() > 0.5
    eval_stream = mlm.document_rows(DOCUMENTS, docs, np.arange(20), 1)
    assert (eval_stream["weights"] != first["weights"]).any()


@pytest.mark.parametrize("task", sorted(set(ROWS) - {"lm"}))
def test_eval_batches_hold_the_validation_documents_in_order_then_padding(task):
    whole = list(eval_batches(DOCUMENTS, VALID, layout(task)))
    assert eval_row_count(DOCUMENTS, VALID, layout(task)) == 10
    assert len(whole) == 2  # 10 documents in batches of 8
    rows = layout(task).document_rows(DOCUMENTS, VALID, np.arange(10), 1)
    for key, value in rows.items():
        np.testing.assert_array_equal(np.concatenate([b[key] for b in whole])[:10], value, key)
        assert not whole[1][key][2:].any()  # padding rows: weights 0, masks False, ids 0
    parts = [list(eval_batches(DOCUMENTS, VALID, layout(task, index=k, count=4))) for k in range(4)]
    for step, batch in enumerate(whole):
        for key, value in batch.items():
            np.testing.assert_array_equal(np.concatenate([p[step][key] for p in parts]), value)


def lm_pieces(docs):
    """Each of ``docs``'s ``<sos> tokens`` / ``tokens <eos>`` cut into pieces of ``T`` from its
    start, in order: what every lm layout evaluates."""
    pieces = []
    for doc in docs:
        inputs, targets = [SOS, *TEXTS[doc].tolist()], [*TEXTS[doc].tolist(), EOS]
        pieces += [(inputs[k : k + T], targets[k : k + T]) for k in range(0, len(inputs), T)]
    return pieces


def segments_of(batch):
    """The segments of a batch's rows, in order, as ``(inputs, targets)`` lists (a row without
    ``segment_ids`` is one segment); checks that weights mark them, that positions restart at 0
    in each and that padding holds only zeros."""
    found = []
    for row, weights in enumerate(batch["weights"]):
        if "segment_ids" in batch:
            ids = batch["segment_ids"][row]
        else:
            ids = (weights > 0).astype(np.int32)
        np.testing.assert_array_equal(weights > 0, ids > 0)
        assert not batch["inputs"][row][ids == 0].any()
        assert not batch["targets"][row][ids == 0].any()
        for segment in range(1, ids.max() + 1):
            where = np.flatnonzero(ids == segment)
            np.testing.assert_array_equal(where, where[0] + np.arange(len(where)))  # contiguous
            if "positions" in batch:
                np.testing.assert_array_equal(batch["positions"][row][where], np.arange(len(where)))
            inputs, targets = batch["inputs"][row][where], batch["targets"][row][where]
            found.append((inputs.tolist(), targets.tolist()))
    return found


@pytest.mark.parametrize("rows", ROWS["lm"])
def test_lm_eval_batches_hold_every_position_of_every_document_once_in_order(rows):
    """Whatever the training layout, validation is the documents in order, each cut into
    pieces of ``T`` positions from its start (a piece is its own segment from position 0):
    every position of every document in exactly one row, then padding."""
    lay = layout("lm", rows)
    whole = list(eval_batches(DOCUMENTS, VALID, lay))
    count = eval_row_count(DOCUMENTS, VALID, lay)
    assert len(whole) == -(-count // B)
    expected = lm_pieces(VALID)
    assert any(len(TEXTS[doc]) + 1 > T for doc in VALID)  # some documents take two pieces
    found = [piece for batch in whole for piece in segments_of(batch)]
    assert found == expected
    assert sum(len(t) for _, t in found) == int((DOCUMENTS.lengths("text")[VALID] + 1).sum())
    rows_used = np.concatenate([b["weights"].any(axis=1) for b in whole])
    assert rows_used.tolist() == [True] * count + [False] * (len(rows_used) - count)
    if rows == "single":  # one piece per row, and no keys a packed row needs
        assert set(whole[0]) == {"inputs", "targets", "weights"} and count == len(expected)
    else:
        assert set(whole[0]) == {"inputs", "targets", "weights", "segment_ids", "positions"}
        assert count < len(expected)  # packed: several pieces to a row
    # Four processes: each makes its rows of each global batch, an empty share included.
    parts = [list(eval_batches(DOCUMENTS, VALID, layout("lm", rows, k, 4))) for k in range(4)]
    assert 0 < count % B <= B - B // 4  # the last batch leaves the last process no rows
    for step, batch in enumerate(whole):
        for key, value in batch.items():
            np.testing.assert_array_equal(np.concatenate([p[step][key] for p in parts]), value)


def counting(make):
    """``make`` that also records which steps it made."""
    made = []

    def counted(step):
        made.append(step)
        return make(step)

    return counted, made


def test_the_state_counts_batches_handed_out_and_resumes_with_the_next_one():
    batches = TrainBatches(DOCUMENTS, TRAIN, layout("lm", "windows"))
    expected = [batches(step) for step in range(8)]
    make, made = counting(batches)
    iterator = TrainIterator(make, {"name": "windows"}, prefetch=3)
    for step in range(3):
        np.testing.assert_array_equal(next(iterator)["inputs"], expected[step]["inputs"])
    deadline = time.monotonic() + 10
    while max(made) < 5 and time.monotonic() < deadline:  # the thread runs ahead
        time.sleep(0.01)
    assert max(made) >= 5
    state = json.loads(json.dumps(iterator.get_state()))
    assert state == {"pipeline": {"name": "windows"}, "step": 3}
    resumed = TrainIterator(batches, {"name": "windows"}, prefetch=3)
    resumed.set_state(state)
    for step in range(3, 8):
        np.testing.assert_array_equal(next(resumed)["inputs"], expected[step]["inputs"])
    iterator.set_state({"pipeline": {"name": "windows"}, "step": 1})  # back, while prefetched
    np.testing.assert_array_equal(next(iterator)["targets"], expected[1]["targets"])
    unprefetched = TrainIterator(batches, {"name": "windows"}, prefetch=0)
    unprefetched.set_state(state)
    np.testing.assert_array_equal(next(unprefetched)["inputs"], expected[3]["inputs"])
    for it in (iterator, resumed):
        it.close()


@pytest.mark.parametrize(
    "state",
    [
        {"pipeline": {"name": "documents"}, "step": 3},
        {"pipeline": {"name": "windows"}, "grain": {"index": 3}},
        {"pipeline": {"name": "windows"}, "step": "3"},
        None,
    ],
)
def test_a_state_of_another_pipeline_is_refused(state):
    iterator = TrainIterator(lambda step: {"step": step}, {"name": "windows"})
    with pytest.raises(ValueError, match="another pipeline"):
        iterator.set_state(state)


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "flaxformer-lite-prefetch"]


def test_errors_in_the_thread_surface_on_next_in_order_and_close_stops_it():
    before = len(prefetch_threads())

    failed = []

    def make(step):
        if step == 4 and not failed:  # once: made again, batch 4 is fine
            failed.append(step)
            raise RuntimeError("no batch 4")
        return {"step": step}

    iterator = TrainIterator(make, {}, prefetch=8)
    assert [next(iterator)["step"] for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="no batch 4"):
        next(iterator)
    assert iterator.get_state()["step"] == 4  # nothing handed out for the failed batch
    assert next(iterator) == {"step": 4}
    iterator.set_state({"pipeline": {}, "step": 0})
    assert next(iterator) == {"step": 0}
    assert len(prefetch_threads()) == before + 1  # blocked on the full queue
    iterator.close()
    assert len(prefetch_threads()) == before
    with pytest.raises(ValueError, match="closed"):
        next(iterator)


def test_an_iterator_dropped_without_close_ends_its_thread():
    """Its thread holds it weakly: once collected, the thread, waiting on a full queue, ends."""
    before = set(prefetch_threads())
    iterator = TrainIterator(lambda step: {"step": step}, {}, prefetch=2)
    next(iterator)
    [thread] = set(prefetch_threads()) - before
    deadline = time.monotonic() + 60
    while iterator._worker._queue.qsize() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # the queue full: the thread waits for room
    del iterator
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_slow_consumer_never_waits_for_a_faster_pipeline():
    iterator = TrainIterator(lambda step: (time.sleep(0.002), {"step": step})[1], {}, prefetch=4)
    next(iterator)
    deadline = time.monotonic() + 60  # the consumer's "step": the thread fills the queue
    while iterator._worker._queue.qsize() < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert iterator._worker._queue.qsize() == 4  # the next four batches wait, made
    assert [next(iterator)["step"] for _ in range(4)] == [1, 2, 3, 4]
    iterator.close()


@pytest.mark.parametrize("prefetch", [0, 3])
def test_placed_batches_are_placed_where_they_are_made_and_counted_as_before(prefetch):
    placed_on = []

    def place(batch):
        placed_on.append(threading.current_thread().name)
        return {"placed": batch["step"]}

    iterator = TrainIterator(lambda step: {"step": step}, {}, prefetch=prefetch)
    assert next(iterator) == {"step": 0}
    iterator.place_with(place)  # batches made ahead unplaced are made again, placed
    assert [next(iterator) for _ in range(3)] == [{"placed": s} for s in (1, 2, 3)]
    assert iterator.get_state()["step"] == 4
    iterator.set_state({"pipeline": {}, "step": 0})
    assert next(iterator) == {"placed": 0}
    iterator.close()
    made_by = "flaxformer-lite-prefetch" if prefetch else threading.current_thread().name
    assert set(placed_on) == {made_by}


def test_layout_local_size():
    assert dataclasses.replace(layout(), process_count=4).local_size == 2
