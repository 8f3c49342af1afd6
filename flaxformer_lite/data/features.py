"""Rows of one document each, per task: the ``seq2seq``, ``mlm`` and ``classify`` rows.

Their arrays (keys, shapes, dtypes) are their :class:`~flaxformer_lite.data.tasks.Task`'s, which
calls them; ``lm`` rows are made by :mod:`flaxformer_lite.data.rows` (never cut). ``<sos>`` and
``<eos>`` are the tokenizer's ``sos_id`` and ``eos_id``; rows are ``[T]`` (``T = seq_len``),
zero-padded (ids ``<pad> = 0``, weights 0, masks False). ``mlm`` rows are ``<sos> tokens <eos>``
(``<sos>`` doubles as BERT's [CLS], ``<eos>`` as [SEP]); BERT masking picks
``max(1, round(mlm_probability * n))`` of the ``n`` regular tokens, of which 80% become
:data:`MASK_ID`, 10% a random regular token and 10% stay. The draw is a pure function of
``(seed, stream, index of the example in its stream)``, so a resumed run masks alike.

Longer documents are cut to fit ``seq_len`` (:func:`truncation` counts what is lost): on the
target side of ``seq2seq`` the sequence ``<sos> tokens <eos>`` is cut to ``seq_len + 1`` tokens
before the shift (a cut document has no ``<eos>``); ``src``, ``mlm`` and ``classify`` rows keep
their closing ``<eos>``.
"""

from __future__ import annotations

import numpy as np

from flaxformer_lite.data import rows
from flaxformer_lite.data.documents import Documents
from flaxformer_lite.data.tokenizers import NUM_SPECIAL, UNK_ID

# The shared id layout has no mask token; <unk> is free in byte and byte-level BPE vocabularies
# and rare in fitted ones, so MLM uses it rather than shifting every tokenizer's ids.
MASK_ID = UNK_ID


def seq2seq_rows(
    documents: Documents, docs: np.ndarray, *, seq_len: int, sos_id: int, eos_id: int
) -> dict[str, np.ndarray]:
    """``seq2seq`` rows ``[len(docs), T]``, row ``r`` from document ``docs[r]``."""
    sizes = np.minimum(_lengths(documents, "target", docs) + 1, seq_len)
    batch = rows.assemble(
        documents,
        len(docs),
        seq_len,
        row=np.arange(len(docs)),
        doc=docs,
        start=np.zeros_like(sizes),
        length=sizes,
        sos_id=sos_id,
        eos_id=eos_id,
        field="target",
    )
    batch = {key: batch[key] for key in ("inputs", "targets", "weights")}
    src, mask = framed(documents, "source", docs, seq_len, sos_id=None, eos_id=eos_id)
    return {"src": src, "src_mask": mask, **batch}


def classify_rows(
    documents: Documents, docs: np.ndarray, *, seq_len: int, sos_id: int, eos_id: int
) -> dict[str, np.ndarray]:
    """``classify`` rows ``[len(docs), T]`` and labels ``[len(docs)]`` of documents ``docs``."""
    tokens, mask = framed(documents, "text", docs, seq_len, sos_id=sos_id, eos_id=eos_id)
    labels = documents.labels[docs].astype(np.int32)
    weights = np.ones(len(docs), np.float32)
    return {"inputs": tokens, "mask": mask, "labels": labels, "weights": weights}


def mlm_rows(
    documents: Documents,
    docs: np.ndarray,
    indices: np.ndarray,
    *,
    seq_len: int,
    sos_id: int,
    eos_id: int,
    vocab_size: int,
    probability: float,
    seed: int,
    stream: int,
) -> dict[str, np.ndarray]:
    """``mlm`` rows ``[len(docs), T]``, row ``r`` from document ``docs[r]``, the example at
    ``indices[r]`` of stream ``stream`` (which of the splits: their draws differ), a share
    ``probability`` of its tokens masked."""
    tokens, mask = framed(documents, "text", docs, seq_len, sos_id=sos_id, eos_id=eos_id)
    inputs, weights = tokens.copy(), np.zeros(tokens.shape, np.float32)
    for r, (index, n) in enumerate(zip(indices.tolist(), mask.sum(1).tolist(), strict=True)):
        rng = np.random.default_rng([seed, stream, index])
        picked, ids = mask_tokens(tokens[r, :n], rng, probability, vocab_size)
        inputs[r, picked], weights[r, picked] = ids, 1.0
    return {"inputs": inputs, "targets": tokens, "weights": weights, "mask": mask}


def truncation(
    documents: Documents, docs: np.ndarray, kept: dict[str, int]
) -> tuple[int, int, int]:
    """``(examples cut, tokens cut, tokens)``: what rows that keep ``kept[field]`` tokens of
    each field leave out of the documents ``docs``, counting the tokens of every field."""
    cut = np.zeros(len(docs), np.int64)
    total = 0
    for field, room in kept.items():
        lengths = _lengths(documents, field, docs)
        cut += np.maximum(lengths - room, 0)
        total += int(lengths.sum())
    return int((cut > 0).sum()), int(cut.sum()), total


def framed(
    documents: Documents,
    field: str,
    docs: np.ndarray,
    seq_len: int,
    *,
    sos_id: int | None,
    eos_id: int,
) -> tuple[np.ndarray, np.ndarray]:
    """``([<sos>] tokens <eos>, mask)`` of each of ``docs``, ``[len(docs), T]`` each, the tokens
    cut so that the row fits ``T``; without ``<sos>`` if ``sos_id`` is None."""
    head = 0 if sos_id is None else 1
    starts = documents.offsets[field][docs]
    kept = np.minimum(_lengths(documents, field, docs), seq_len - 1 - head)
    columns = np.arange(seq_len)
    body = (columns >= head) & (columns < (head + kept)[:, None])
    out = np.zeros((len(docs), seq_len), np.int32)
    out[body] = documents.checked(
        field, documents.tokens[field][(starts[:, None] + columns - head)[body]]
    )
    if head:
        out[:, 0] = sos_id
    out[np.arange(len(docs)), head + kept] = eos_id
    return out, columns < (head + kept + 1)[:, None]


def mask_tokens(
    tokens: np.ndarray, rng: np.random.Generator, probability: float, vocab_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """BERT masking of the regular tokens ``tokens[1:-1]`` (the first and last are specials):
    ``(picked positions, their new ids)``."""
    candidates = np.arange(1, len(tokens) - 1)
    if not candidates.size:
        return candidates, candidates
    chosen = rng.choice(candidates, max(1, round(probability * candidates.size)), False)
    action = rng.random(chosen.size)
    random_ids = rng.integers(NUM_SPECIAL, vocab_size, chosen.size)
    replaced = np.where(action < 0.9, random_ids, tokens[chosen])
    return chosen, np.where(action < 0.8, MASK_ID, replaced)


def _lengths(documents: Documents, field: str, docs: np.ndarray) -> np.ndarray:
    """The lengths of ``docs`` alone (not all ``N``: a batch reads only its own documents)."""
    offsets = documents.offsets[field]
    return offsets[docs + 1] - offsets[docs]
