"""One example's arrays, per task: what a record becomes before the pipeline pads, packs and
batches it (:mod:`flaxformer_lite.data.pipeline`).

Every array is int32 unless noted; ``<sos>`` and ``<eos>`` are the tokenizer's ``sos_id`` and
``eos_id``. Padded to ``[T]`` (``T = seq_len``), the batches hold, per task:

- ``lm``: ``inputs = <sos> + tokens``, ``targets = tokens + <eos>``, ``weights``. With ``packing``
  also ``segment_ids`` (1, 2, ... per example in a row, 0 at padding) and ``positions`` (from 0 in
  every segment).
- ``seq2seq``: ``src = source tokens + <eos>`` and ``src_mask``; ``inputs = <sos> + target``,
  ``targets = target + <eos>``, ``weights``.
- ``mlm``: ``<sos> tokens <eos>`` (``<sos>`` doubles as BERT's [CLS], ``<eos>`` as [SEP]); BERT
  masking picks ``max(1, round(mlm_probability * n))`` of the ``n`` regular tokens, of which 80%
  become :data:`MASK_ID`, 10% a random regular token and 10% stay; ``inputs`` (masked),
  ``targets`` (the original tokens), ``weights`` (1 at the picked tokens), ``mask``. The draw is a
  pure function of ``(seed, position in the example stream)``, so a resumed run masks alike.
- ``classify``: ``inputs`` (``<sos> tokens <eos>``), ``mask``, ``labels`` ``[B]`` and ``weights``
  float32 ``[B]`` (1 for real rows, 0 for the padding rows of the last eval batch).

Longer examples are truncated to ``seq_len``: for ``lm`` and the target side of ``seq2seq`` the
sequence ``<sos> tokens <eos>`` is cut to ``seq_len + 1`` tokens before the shift (a cut example
has no ``<eos>``); ``src``, ``mlm`` and ``classify`` rows keep their closing ``<eos>``.
"""

from __future__ import annotations

import numpy as np

from flaxformer_lite.data.tokenizers import NUM_SPECIAL, UNK_ID, Tokenizer

# The shared id layout has no mask token; <unk> is free in byte and byte-level BPE vocabularies
# and rare in fitted ones, so MLM uses it rather than shifting every tokenizer's ids.
MASK_ID = UNK_ID


def featurize(
    index: int,
    record: dict,
    *,
    task: str,
    tokenizer: Tokenizer,
    seq_len: int,
    mlm_probability: float,
    seed: int,
    stream: int,
) -> dict[str, np.ndarray]:
    """One example's unpadded arrays; ``index`` is its position in its stream (``stream``: which
    of the splits, so that their MLM draws differ)."""
    if task == "lm":
        return shifted(tokenizer.encode(record["text"]), seq_len, tokenizer)
    if task == "seq2seq":
        src = [*tokenizer.encode(record["source"])[: seq_len - 1], tokenizer.eos_id]
        return {
            "src": np.array(src, np.int32),
            "src_mask": np.ones(len(src), bool),
            **shifted(tokenizer.encode_target(record["target"]), seq_len, tokenizer),
        }
    text_ids = tokenizer.encode(record["text"])[: seq_len - 2]
    tokens = np.array([tokenizer.sos_id, *text_ids, tokenizer.eos_id])
    tokens = tokens.astype(np.int32)
    if task == "classify":
        label, weight = np.int32(record["label"]), np.float32(1)
        return dict(inputs=tokens, mask=np.ones(len(tokens), bool), labels=label, weights=weight)
    rng = np.random.default_rng([seed, stream, index])
    return mask_tokens(tokens, rng, mlm_probability, tokenizer.vocab_size)


def shifted(ids: list[int], seq_len: int, tokenizer: Tokenizer) -> dict[str, np.ndarray]:
    """``<sos> ids <eos>`` cut to ``seq_len + 1`` tokens, shifted into inputs and targets."""
    sequence = [tokenizer.sos_id, *ids[:seq_len], tokenizer.eos_id][: seq_len + 1]
    sequence = np.array(sequence, np.int32)
    weights = np.ones(len(sequence) - 1, np.float32)
    return {"inputs": sequence[:-1], "targets": sequence[1:], "weights": weights}


def mask_tokens(
    tokens: np.ndarray, rng: np.random.Generator, probability: float, vocab_size: int
) -> dict[str, np.ndarray]:
    """BERT masking of the regular tokens ``tokens[1:-1]`` (the first and last are specials)."""
    inputs, weights = tokens.copy(), np.zeros(len(tokens), np.float32)
    candidates = np.arange(1, len(tokens) - 1)
    if candidates.size:
        chosen = rng.choice(candidates, max(1, round(probability * candidates.size)), False)
        action = rng.random(chosen.size)
        random_ids = rng.integers(NUM_SPECIAL, vocab_size, chosen.size)
        replaced = np.where(action < 0.9, random_ids, tokens[chosen])
        inputs[chosen] = np.where(action < 0.8, MASK_ID, replaced)
        weights[chosen] = 1.0
    return dict(inputs=inputs, targets=tokens, weights=weights, mask=np.ones(len(tokens), bool))


def pad(example: dict[str, np.ndarray], seq_len: int) -> dict[str, np.ndarray]:
    """Zero-pads every 1-D array to ``[seq_len]`` (ids ``<pad>``, weights 0, masks False)."""
    return {
        key: np.pad(value, (0, seq_len - len(value))) if value.ndim == 1 else value
        for key, value in example.items()
    }
