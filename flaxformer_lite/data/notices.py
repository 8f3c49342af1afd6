"""What a run says once about its data, each a line: the examples a task cut to fit a row, the
tokens its tokenizer has no id for, a mixture's weights and shares, a source too small to fill a
row (nothing is dropped or repeated unsaid)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from flaxformer_lite.data import tasks
from flaxformer_lite.data.config import BLOCK_ROWS
from flaxformer_lite.data.documents import Documents
from flaxformer_lite.data.features import truncation


def truncation_notice(
    task: tasks.Task, documents: Documents, ids: np.ndarray, seq_len: int, split: str
) -> str | None:
    """What a task that fits each example in one row cuts from the ``split`` documents ``ids``."""
    if task.pieces:
        return None
    examples, cut, total = truncation(documents, ids, task.kept(seq_len))
    if not examples:
        return None
    return (
        f"data.seq_len={seq_len} cuts {examples:,} of the {len(ids):,} {split} examples: "
        f"{cut:,} of their {total:,} tokens ({cut / max(total, 1):.1%}) are not seen"
    )


def unknown_notice(tokenizer, documents: Documents, ids: np.ndarray, split: str) -> str | None:
    """How many of the ``split`` documents' tokens are ``<unk>``: text the tokenizer has no id
    for (a character or word its vocabulary, fitted on other text, lacks). Tokenizers that have
    an id for every text (bytes, byte-level BPE) are not read."""
    unk = getattr(tokenizer, "unk_id", None)
    if unk is None or getattr(tokenizer, "covers_all_text", False) or not len(ids):
        return None
    unknown = total = 0
    for field in documents.fields:
        tokens, offsets = documents.tokens[field], documents.offsets[field]
        # The <unk> positions, read a block at a time (a store may not fit in memory twice),
        # then the documents they fall in.
        positions = np.concatenate(
            [
                start + np.flatnonzero(tokens[start : start + _BLOCK] == unk)
                for start in range(0, len(tokens), _BLOCK)
            ]
            or [np.zeros(0, np.int64)]
        )
        owners = np.searchsorted(offsets, positions, side="right") - 1
        unknown += int(np.isin(owners, ids).sum())
        total += int(documents.lengths(field)[ids].sum())
    if not unknown:
        return None
    return (
        f"{unknown:,} of the {total:,} {split} tokens ({unknown / total:.1%}) are <unk>: text the "
        f"{tokenizer.name} tokenizer has no id for (its vocabulary came from other text)"
    )


_BLOCK = 1 << 24  # tokens read at a time when counting <unk>


def mixture_notice(mixture: Mapping, counts: Iterable[tuple[str, int]]) -> str:
    """A mixture's weights (given or the default 1) and the rows of each source in a block."""
    given = ", ".join(f"{name} {entry.weight:g}" for name, entry in mixture.items())
    shares = ", ".join(f"{name} {n:,} ({n / BLOCK_ROWS:.1%})" for name, n in counts)
    return f"data.mixture (weights {given}): every {BLOCK_ROWS:,} training rows hold {shares}"


def small_source_notice(name: str, tokens: int, seq_len: int) -> str | None:
    """A mixture's source whose training tokens do not fill one row: its rows repeat them."""
    if tokens > seq_len:
        return None
    return (
        f"data.mixture.{name}: its {tokens:,} training tokens fill less than one row of "
        f"data.seq_len={seq_len}: its share of the rows repeats them"
    )
