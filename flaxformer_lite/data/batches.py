"""Batches from documents: this process's rows of each global batch, made ahead in a thread.

Global batch ``g`` is global rows ``[g * batch_size, (g + 1) * batch_size)`` of the training rows
(:mod:`flaxformer_lite.data.rows`); process ``k`` of ``n`` makes only its rows ``[k * b, (k + 1)
* b)`` of it, ``b = batch_size // n``. Rows are pure functions of the row index, so the global
batches are the same for any ``n`` and a process's work is its own rows, however many there
are. :class:`TrainIterator` hands batches out in order; its state is the number of global
batches handed out.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np

from flaxformer_lite.data import rows
from flaxformer_lite.data.documents import Documents
from flaxformer_lite.data.tasks import PACKED_KEYS, Task

ROWS = ("documents", "windows", "single")  # packed documents, windows, one document per row
TRAIN_STREAM, EVAL_STREAM = 0, 1  # separate MLM masking draws for the two splits


@dataclasses.dataclass(frozen=True)
class Layout:
    """What every batch of a run shares.

    Attributes:
      task: what the rows are of.
      rows: ``documents`` (packed), ``windows`` (both for tasks of ``pieces``: ``lm``) or
        ``single``.
      seq_len: ``T``.
      batch_size: the global batch size ``B``.
      process_index, process_count: which of ``process_count`` equal blocks of each global
        batch's rows this process makes.
      sos_id, eos_id, vocab_size: the tokenizer's.
      mlm_probability: share of an ``mlm`` example's tokens to predict.
      seed: orders the epochs and draws the MLM masks.
    """

    task: Task
    rows: str
    seq_len: int
    batch_size: int
    process_index: int
    process_count: int
    sos_id: int
    eos_id: int
    vocab_size: int
    mlm_probability: float
    seed: int

    @property
    def local_size(self) -> int:
        return self.batch_size // self.process_count

    def document_rows(self, documents: Documents, docs: np.ndarray, indices, stream: int):
        return self.task.document_rows(self, documents, docs, indices, stream)


def lm_rows(documents: Documents, ids: np.ndarray, layout: Layout, shuffle: bool = True):
    """The row maker of a layout of pieces (``lm``): windows, packed pieces or one piece per
    row."""
    if layout.rows == "windows":
        return rows.Windows(documents, ids, layout.seq_len, layout.seed)
    pack = layout.rows == "documents"
    return rows.Packed(documents, ids, layout.seq_len, layout.seed, pack=pack, shuffle=shuffle)


class TrainBatches:
    """This process's rows of global batch ``g``: ``batches(g)``, a pure function of ``g``."""

    def __init__(self, documents: Documents, ids: np.ndarray, layout: Layout):
        self.documents, self.layout = documents, layout
        if layout.task.pieces:
            self._rows = lm_rows(documents, ids, layout)
        else:
            self._rows = rows.Shuffled(ids, layout.seed)

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        layout = self.layout
        first = step * layout.batch_size + layout.process_index * layout.local_size
        return self.rows(first, layout.local_size)

    def rows(self, first: int, count: int) -> dict[str, np.ndarray]:
        """Training rows ``[first, first + count)`` of these documents' stream."""
        layout = self.layout
        if layout.task.pieces:
            batch = self._rows.rows(first, count, layout.sos_id, layout.eos_id)
            return batch if layout.rows != "single" else _unpacked(batch)
        docs = self._rows.documents_of(first, count)
        indices = np.arange(first, first + count)
        return layout.document_rows(self.documents, docs, indices, TRAIN_STREAM)


def eval_batches(documents: Documents, ids: np.ndarray, layout: Layout) -> Iterator[dict]:
    """The documents ``ids`` in order, in global batches; the last is filled up with padding
    rows (weights 0, masks False), so every batch has one shape. Yields this process's rows.

    ``lm`` documents (a task of ``pieces``) are cut into pieces of ``T`` positions from their starts
    and packed, as the ``documents`` layout trains (a piece is its own segment from position 0, so
    its loss does not depend on what else its row holds): every token of every document counts once,
    and the numbers do not depend on the training layout. Other tasks: one document per row."""
    if layout.task.pieces:
        packed = _eval_pieces(documents, ids, layout)
        count = packed.rows_in_epoch(0)
        for step in range(-(-count // layout.batch_size)):
            first = step * layout.batch_size + layout.process_index * layout.local_size
            mine = max(min(layout.local_size, count - first), 0)
            batch = packed.rows(first, mine, layout.sos_id, layout.eos_id)
            yield _padded(batch if layout.rows != "single" else _unpacked(batch), layout)
        return
    for step in range(-(-len(ids) // layout.batch_size)):
        first = step * layout.batch_size + layout.process_index * layout.local_size
        indices = np.arange(first, min(first + layout.local_size, len(ids)))
        docs = np.asarray(ids, np.int64)[indices]
        yield _padded(layout.document_rows(documents, docs, indices, EVAL_STREAM), layout)


def eval_row_count(documents: Documents, ids: np.ndarray, layout: Layout) -> int:
    """The global rows of :func:`eval_batches` before padding."""
    return _eval_pieces(documents, ids, layout).rows_in_epoch(0) if layout.task.pieces else len(ids)


def _eval_pieces(documents: Documents, ids: np.ndarray, layout: Layout) -> rows.Packed:
    # A "single" layout's rows carry no segment_ids: one piece per row, never several.
    pack = layout.rows != "single"
    return rows.Packed(documents, ids, layout.seq_len, layout.seed, pack=pack, shuffle=False)


def _unpacked(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An unpacked layout's keys: one segment per row, positions from 0 need no arrays."""
    return {key: value for key, value in batch.items() if key not in PACKED_KEYS}


def _padded(batch: dict[str, np.ndarray], layout: Layout) -> dict[str, np.ndarray]:
    """``batch`` filled up to this process's ``B`` rows with padding rows (all zeros)."""
    padding = layout.local_size - len(batch["weights"])
    return {k: np.pad(v, [(0, padding)] + [(0, 0)] * (v.ndim - 1)) for k, v in batch.items()}


# How often a prefetch thread waiting for room in its queue looks whether it is to stop.
_WAKE = 0.5


class _Prefetch:
    """A daemon thread that makes the batches of steps ``first``, ``first + 1``, ... into a
    queue of ``size``; an exception it meets is queued in place of the batch. It holds its
    iterator's ``make`` weakly: an iterator dropped without ``close`` is collected, and the
    thread ends within :data:`_WAKE` seconds (the batches it made, on the devices, freed)."""

    def __init__(self, make, first: int, size: int):
        self._queue: queue.Queue = queue.Queue(maxsize=size)
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            args=(weakref.WeakMethod(make), first),
            name="flaxformer-lite-prefetch",
            daemon=True,
        )
        self._thread.start()

    def _run(self, made: weakref.WeakMethod, step: int) -> None:
        while not self._stopping.is_set() and (make := made()) is not None:
            try:
                item = (make(step), None)
            except BaseException as error:  # handed to the consumer, which raises it
                item = (None, error)
            del make  # while the queue is full, the iterator may be collected
            if not self._put(item) or item[1] is not None:
                return
            step += 1

    def _put(self, item) -> bool:
        """Queues ``item`` once there is room; False if asked to stop meanwhile."""
        while not self._stopping.is_set():
            try:
                self._queue.put(item, timeout=_WAKE)
                return True
            except queue.Full:
                continue
        return False

    def get(self) -> dict[str, np.ndarray]:
        batch, error = self._queue.get()
        if error is not None:
            self.stop()
            raise error
        return batch

    def request_stop(self) -> None:
        """Asks the thread to stop after the batch it is making."""
        self._stopping.set()

    def stop(self) -> None:
        self.request_stop()
        while True:  # room for a put under way, so the thread sees the flag
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join()


class TrainIterator:
    """This process's training batches, endless, resumable from a JSON-able state.

    ``get_state()`` is ``{"pipeline": {...}, "step": global batches handed out}``: the same on
    every process, so a run may resume on another number of processes. The ``pipeline`` entry
    describes what the stream is made from, so ``set_state`` refuses a state from another
    pipeline instead of resuming wrongly. ``make(step)`` makes a batch; up to ``prefetch`` are
    made ahead in a background thread (a bounded queue, so ``next()`` does not wait while
    ``make`` keeps up). The state counts the batches handed out, not those made, and an error
    raised while making a batch is raised by the ``next()`` that would have returned it.
    :meth:`close` stops the thread. :meth:`place_with` has the batches placed (on the devices)
    where they are made.
    """

    def __init__(self, make, pipeline: dict[str, Any], prefetch: int = 4):
        self._worker: _Prefetch | None = None
        self._make, self._prefetch = make, prefetch
        self._place = None
        self._pipeline = json.loads(json.dumps(pipeline))  # a copy, and proof it serializes
        self._step = 0
        self._closed = False

    def __iter__(self) -> TrainIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._closed:
            raise ValueError("the data iterator was closed")
        if not self._prefetch:
            batch = self._made(self._step)
        else:
            if self._worker is None:
                self._worker = _Prefetch(self._made, self._step, self._prefetch)
            try:
                batch = self._worker.get()
            except BaseException:  # the worker's error, or an interrupt while waiting
                self._stop()  # a later next() starts a new thread at this batch
                raise
        self._step += 1
        return batch

    def place_with(self, place) -> None:
        """From the next batch on, hands out ``place(batch)`` (e.g. a batch's arrays on the
        devices) instead of ``batch``; made ahead like the batch, so a training loop does not
        wait for the transfer between its steps."""
        self._stop()  # batches made ahead unplaced are made again
        self._place = place

    def _made(self, step: int):
        batch = self._make(step)
        return batch if self._place is None else self._place(batch)

    def get_state(self) -> dict[str, Any]:
        return {"pipeline": dict(self._pipeline), "step": self._step}

    def set_state(self, state: dict[str, Any]) -> None:
        saved = state.get("pipeline") if isinstance(state, dict) else None
        step = state.get("step") if isinstance(state, dict) else None
        if saved != self._pipeline or isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(
                f"the data iterator state was saved by another pipeline ({saved}); "
                f"this one is {self._pipeline}"
            )
        if step < 0:
            raise ValueError(f"the data iterator state has a negative step {step}")
        self._stop()
        self._step = step

    def close(self) -> None:
        """Stops the prefetch thread; the iterator is not to be used after."""
        self._stop()
        self._closed = True

    def _stop(self) -> None:
        if self._worker is not None:
            self._worker.stop()
            self._worker = None

    def __del__(self):
        # Only the flag, which the thread reads within _WAKE seconds: at interpreter exit the
        # queue module may already be torn down, and the daemon thread ends with the interpreter.
        if self._worker is not None:
            self._worker.request_stop()
