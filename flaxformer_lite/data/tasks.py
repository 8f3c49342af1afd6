"""The four training tasks, each a :class:`Task` that owns what differs by task: its batch, the
records it trains on, how its rows are made, its loss's model call, what its metrics count,
whether its model writes text, and its tokenizer's export template. The rest of the package asks
the task (:func:`task_named`) rather than its name; which task a model trains on is
:func:`flaxformer_lite.train.config.task_of`'s to say.

A batch is a dict of arrays, each of :class:`Array` ``(shape, dtype, meaning)`` with its shape
in the project's letters: ``B`` rows, ``T = data.seq_len`` positions of the target side, and
``S`` of a ``seq2seq`` source (also ``data.seq_len``). Padding is id 0 with weight 0 and mask
False; ``<sos>`` and ``<eos>`` are the tokenizer's ids. It is the one description that the data
pipeline makes (:mod:`flaxformer_lite.data.pipeline`), the train step reads
(:func:`flaxformer_lite.train.step.model_loss`) and ``flaxformer-lite compile`` traces with
(:func:`flaxformer_lite.train.program.abstract_batch`). How the rows are made from documents:
:mod:`flaxformer_lite.data.rows` (``lm``) and :mod:`flaxformer_lite.data.features` (the others).

A task whose documents are cut into :attr:`Task.pieces` (``lm``) packs them, several in a row
told apart by :data:`PACKED_KEYS`, as :meth:`Task.is_packed` says: ``data.packing``, by default
on; the other tasks' rows hold one document each, cut to fit.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from flaxformer_lite.data import features
from flaxformer_lite.data.documents import LABELLED_RECORDS, PAIR_RECORDS, TEXT_RECORDS, Documents
from flaxformer_lite.registry import Registry

if TYPE_CHECKING:
    from flaxformer_lite.data.batches import Layout


@dataclasses.dataclass(frozen=True)
class Array:
    """One array of a batch: its shape in letters (``("B", "T")``), dtype and meaning."""

    shape: tuple[str, ...]
    dtype: str
    meaning: str


_IDS, _WEIGHTS, _MASK = "int32", "float32", "bool"
ROWS = ("B", "T")
_TEXT = "text (data.source text or jsonl, or a synthetic lm generator)"

# What packed rows add: which document piece each position belongs to, and its position in it.
PACKED_KEYS: dict[str, Array] = {
    "segment_ids": Array(ROWS, _IDS, "1, 2, ... per document piece in a row, 0 at padding"),
    "positions": Array(ROWS, _IDS, "from 0 in every segment"),
}


class Task(abc.ABC):
    """What differs by task; one instance of each subclass is in :data:`TASKS`.

    Attributes:
      name: what ``train.config.task_of`` calls it, and the data pipeline's state records.
      arrays: its batch (:data:`PACKED_KEYS` aside).
      records: the record types (:mod:`flaxformer_lite.data.documents`) it trains on, and
        ``needs`` says so in words.
      pieces: its documents are cut into pieces of at most ``T`` positions (packed, or one per
        row), every token in some row; else each row is one document, cut to fit.
      per_token: one prediction per target token (``train.loss_chunk`` applies), not one per row.
      unit: what the weights of its evaluation count.
      perplexity: its loss is of next tokens, so ``exp(eval_loss)`` is a perplexity.
      decodes: its model writes text, which a decoded evaluation scores.
      continues: its model writes by continuing its input in one sequence (a decoder LM), not a
        target of its own.
      hf_inputs: the ``model_input_names`` of its exported tokenizer.
      mask_token: its inputs hold the tokenizer's mask token.
    """

    name: ClassVar[str]
    arrays: ClassVar[dict[str, Array]]
    records: ClassVar[tuple[str, ...]] = (TEXT_RECORDS, LABELLED_RECORDS)
    needs: ClassVar[str] = _TEXT
    pieces: ClassVar[bool] = False
    per_token: ClassVar[bool] = True
    unit: ClassVar[str] = "tokens"
    perplexity: ClassVar[bool] = False
    decodes: ClassVar[bool] = False
    continues: ClassVar[bool] = False
    hf_inputs: ClassVar[tuple[str, ...]] = ("input_ids", "attention_mask")
    mask_token: ClassVar[bool] = False

    def is_packed(self, packing: bool | None) -> bool:
        """Whether its training rows are packed, as ``data.packing`` says: None (the default)
        packs the tasks of :attr:`pieces` and gives the others one document per row.

        Raises:
          ValueError: ``packing=True`` for a task whose rows hold whole documents.
        """
        if packing and not self.pieces:
            raise ValueError(f"data.packing=true applies to task 'lm' only, not {self.name!r}")
        return self.pieces if packing is None else packing

    def batch_arrays(self, *, packed: bool) -> dict[str, Array]:
        """The arrays of its batch, with :data:`PACKED_KEYS` if its rows are ``packed``."""
        return self.arrays | (PACKED_KEYS if packed else {})

    def batch_shapes(
        self, *, packed: bool, batch_size: int, seq_len: int
    ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """``{key: (shape, dtype)}`` of its batch of ``batch_size`` rows of ``seq_len``."""
        sizes = {"B": batch_size, "T": seq_len, "S": seq_len}
        return {
            key: (tuple(sizes[letter] for letter in array.shape), np.dtype(array.dtype))
            for key, array in self.batch_arrays(packed=packed).items()
        }

    def check_records(self, records: str, given: str) -> None:
        """Raises ValueError if it cannot train on ``records``, the record type of ``given``."""
        if records not in self.records:
            raise ValueError(f"task {self.name!r} cannot train on {given}: it needs {self.needs}")

    @abc.abstractmethod
    def predict(self, model, batch: dict, *, features: bool):
        """The model's logits for ``batch`` (``[B, T, V]``; ``[B, C]`` for ``classify``), or with
        ``features`` (:attr:`per_token` tasks) its last features ``[B, T, D]``, the head left
        out."""

    def targets(self, batch: dict):
        """``(targets, weights)`` of ``batch``, what :meth:`predict` is scored against."""
        return batch["targets"], batch["weights"]

    def document_rows(
        self, layout: Layout, documents: Documents, docs: np.ndarray, indices, stream: int
    ) -> dict[str, np.ndarray]:
        """Rows ``[len(docs), T]``, row ``r`` of document ``docs[r]``, the example ``indices[r]``
        of ``stream``; tasks that are not :attr:`pieces` only."""
        raise TypeError(
            f"task {self.name!r} cuts its documents into pieces: data.rows makes its rows"
        )

    def kept(self, seq_len: int) -> dict[str, int]:
        """The tokens of each field that one of its rows keeps (not :attr:`pieces` tasks)."""
        return {"text": seq_len - 2}  # <sos> tokens <eos>

    def target_tokens(self, documents: Documents, ids: np.ndarray, seq_len: int) -> int | None:
        """The weighted targets of a pass over ``ids`` if they are tokens of ``documents``, else
        None (masked tokens and examples are counted as the batches are)."""
        return None

    def template(self, sos, eos) -> list:
        """What its rows add around a text ``"$A"``: ``sos`` and ``eos`` as given, in order."""
        return [sos, "$A", eos]


class LM(Task):
    name = "lm"
    arrays = {
        "inputs": Array(ROWS, _IDS, "<sos> + tokens"),
        "targets": Array(ROWS, _IDS, "tokens + <eos>: the next token of each input"),
        "weights": Array(ROWS, _WEIGHTS, "1 at real targets, 0 at padding"),
    }
    pieces = perplexity = decodes = continues = True

    def predict(self, model, batch, *, features):
        positions, segment_ids = batch.get("positions"), batch.get("segment_ids")
        return model(
            batch["inputs"], positions=positions, segment_ids=segment_ids, features=features
        )

    def target_tokens(self, documents, ids, seq_len):
        return int((documents.lengths("text")[ids] + 1).sum())  # every token, and <eos>

    def template(self, sos, eos):
        return [sos, "$A"]


class Seq2Seq(Task):
    name = "seq2seq"
    arrays = {
        "src": Array(("B", "S"), _IDS, "source tokens + <eos>"),
        "src_mask": Array(("B", "S"), _MASK, "True at real source tokens"),
        "inputs": Array(ROWS, _IDS, "<sos> + target tokens"),
        "targets": Array(ROWS, _IDS, "target tokens + <eos>"),
        "weights": Array(ROWS, _WEIGHTS, "1 at real targets, 0 at padding"),
    }
    records = (PAIR_RECORDS,)
    needs = "source/target pairs (data.source parallel, or number_words)"
    perplexity = decodes = True

    def predict(self, model, batch, *, features):
        src, mask = batch["src"], batch["src_mask"]
        return model(src, batch["inputs"], padding_mask=mask, features=features)

    def document_rows(self, layout, documents, docs, indices, stream):
        ids = dict(seq_len=layout.seq_len, sos_id=layout.sos_id, eos_id=layout.eos_id)
        return features.seq2seq_rows(documents, docs, **ids)

    def kept(self, seq_len):
        return {"source": seq_len - 1, "target": seq_len}  # <eos> after the source; the shift

    def target_tokens(self, documents, ids, seq_len):
        return int(np.minimum(documents.lengths("target")[ids] + 1, seq_len).sum())

    def template(self, sos, eos):
        return ["$A", eos]  # a source: the target's <sos> is the decoder's


class MLM(Task):
    name = "mlm"
    arrays = {
        "inputs": Array(ROWS, _IDS, "<sos> tokens <eos>, some masked (BERT's 80/10/10)"),
        "targets": Array(ROWS, _IDS, "the original tokens"),
        "weights": Array(ROWS, _WEIGHTS, "1 at the tokens to predict"),
        "mask": Array(ROWS, _MASK, "True at real tokens"),
    }
    unit = "masked tokens"
    # GPT-2 would add its token table's rows for token_type_ids; only BERT reads them.
    hf_inputs = ("input_ids", "token_type_ids", "attention_mask")
    mask_token = True

    def predict(self, model, batch, *, features):
        return (model.encode if features else model)(batch["inputs"], padding_mask=batch["mask"])

    def document_rows(self, layout, documents, docs, indices, stream):
        return features.mlm_rows(
            documents,
            docs,
            indices,
            seq_len=layout.seq_len,
            sos_id=layout.sos_id,
            eos_id=layout.eos_id,
            vocab_size=layout.vocab_size,
            probability=layout.mlm_probability,
            seed=layout.seed,
            stream=stream,
        )


class Classify(Task):
    name = "classify"
    arrays = {
        "inputs": Array(ROWS, _IDS, "<sos> tokens <eos>"),
        "mask": Array(ROWS, _MASK, "True at real tokens"),
        "labels": Array(("B",), _IDS, "the class index of each row"),
        "weights": Array(("B",), _WEIGHTS, "1 for real rows, 0 for a last eval batch's padding"),
    }
    records = (LABELLED_RECORDS,)
    needs = "labelled text (data.generator sentiment)"
    per_token = False
    unit = "examples"
    hf_inputs = MLM.hf_inputs

    def predict(self, model, batch, *, features):
        return model.classify(batch["inputs"], padding_mask=batch["mask"])

    def targets(self, batch):
        return batch["labels"], batch.get("weights")  # none: every row counts

    def document_rows(self, layout, documents, docs, indices, stream):
        ids = dict(seq_len=layout.seq_len, sos_id=layout.sos_id, eos_id=layout.eos_id)
        return features.classify_rows(documents, docs, **ids)


TASKS = Registry(
    "task",
    "a Task",
    {task.name: task for task in (LM(), Seq2Seq(), MLM(), Classify())},
    imports=False,
)


def task_named(name: str) -> Task:
    """The task ``name``, one of :data:`TASKS`.

    Raises:
      ValueError: an unknown name, with the known ones.
    """
    TASKS.check(name)
    return TASKS[name]
