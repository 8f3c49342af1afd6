"""The four training tasks and each one's batch: the one description that the data pipeline
makes (:mod:`flaxformer_lite.data.pipeline`), the train step reads
(:func:`flaxformer_lite.train.step.model_loss`) and ``flaxformer-lite compile`` traces with
(:func:`flaxformer_lite.train.program.abstract_batch`).

A batch is a dict of arrays, each of :class:`Array` ``(shape, dtype, meaning)`` with its shape
in the project's letters: ``B`` rows, ``T = data.seq_len`` positions of the target side, and
``S`` of a ``seq2seq`` source (also ``data.seq_len``). Padding is id 0 with weight 0 and mask
False; ``<sos>`` and ``<eos>`` are the tokenizer's ids. How the rows are made from documents:
:mod:`flaxformer_lite.data.rows` (``lm``) and :mod:`flaxformer_lite.data.features` (the others).

A task's rows are packed (several documents in a row, told apart by :data:`PACKED_KEYS`) as
:func:`is_packed` says: ``data.packing``, by default for ``lm`` only.
"""

from __future__ import annotations

import dataclasses

import numpy as np

TASKS = ("lm", "seq2seq", "mlm", "classify")


@dataclasses.dataclass(frozen=True)
class Array:
    """One array of a batch: its shape in letters (``("B", "T")``), dtype and meaning."""

    shape: tuple[str, ...]
    dtype: str
    meaning: str


_IDS, _WEIGHTS, _MASK = "int32", "float32", "bool"
ROWS = ("B", "T")

BATCHES: dict[str, dict[str, Array]] = {
    "lm": {
        "inputs": Array(ROWS, _IDS, "<sos> + tokens"),
        "targets": Array(ROWS, _IDS, "tokens + <eos>: the next token of each input"),
        "weights": Array(ROWS, _WEIGHTS, "1 at real targets, 0 at padding"),
    },
    "seq2seq": {
        "src": Array(("B", "S"), _IDS, "source tokens + <eos>"),
        "src_mask": Array(("B", "S"), _MASK, "True at real source tokens"),
        "inputs": Array(ROWS, _IDS, "<sos> + target tokens"),
        "targets": Array(ROWS, _IDS, "target tokens + <eos>"),
        "weights": Array(ROWS, _WEIGHTS, "1 at real targets, 0 at padding"),
    },
    "mlm": {
        "inputs": Array(ROWS, _IDS, "<sos> tokens <eos>, some masked (BERT's 80/10/10)"),
        "targets": Array(ROWS, _IDS, "the original tokens"),
        "weights": Array(ROWS, _WEIGHTS, "1 at the tokens to predict"),
        "mask": Array(ROWS, _MASK, "True at real tokens"),
    },
    "classify": {
        "inputs": Array(ROWS, _IDS, "<sos> tokens <eos>"),
        "mask": Array(ROWS, _MASK, "True at real tokens"),
        "labels": Array(("B",), _IDS, "the class index of each row"),
        "weights": Array(("B",), _WEIGHTS, "1 for real rows, 0 for a last eval batch's padding"),
    },
}

# What packed rows add: which document piece each position belongs to, and its position in it.
PACKED_KEYS: dict[str, Array] = {
    "segment_ids": Array(ROWS, _IDS, "1, 2, ... per document piece in a row, 0 at padding"),
    "positions": Array(ROWS, _IDS, "from 0 in every segment"),
}


def check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")


def is_packed(task: str, packing: bool | None) -> bool:
    """Whether ``task``'s training rows are packed, as ``data.packing`` says: None (the default)
    packs ``lm`` rows and gives the other tasks one document per row.

    Raises:
      ValueError: an unknown task, or ``packing=True`` for a task other than ``lm``.
    """
    check_task(task)
    if packing and task != "lm":
        raise ValueError(f"data.packing=true applies to task 'lm' only, not {task!r}")
    return task == "lm" if packing is None else packing


def batch_arrays(task: str, *, packed: bool) -> dict[str, Array]:
    """The arrays of a ``task`` batch, with :data:`PACKED_KEYS` if its rows are ``packed``."""
    check_task(task)
    return BATCHES[task] | (PACKED_KEYS if packed else {})


def batch_shapes(
    task: str, *, packed: bool, batch_size: int, seq_len: int
) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``{key: (shape, dtype)}`` of a ``task`` batch of ``batch_size`` rows of ``seq_len``."""
    sizes = {"B": batch_size, "T": seq_len, "S": seq_len}
    return {
        key: (tuple(sizes[letter] for letter in array.shape), np.dtype(array.dtype))
        for key, array in batch_arrays(task, packed=packed).items()
    }
