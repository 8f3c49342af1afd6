"""Weighted mixtures of sources (``data.mixture``): which source each training row comes from,
the batches made so, and the texts a tokenizer fitted on a mixture sees.

The rows are drawn in blocks of :data:`~flaxformer_lite.data.config.BLOCK_ROWS`, as levanter's
``MixtureDataset`` draws them: each block holds a whole number of rows of each source, its
weight's share (largest remainders), in an order shuffled by ``(seed, block)``. Global row ``j``'s
source and its row in that source's own stream (``block * count + its rank among the block's rows
of that source``) are a pure function of ``(seed, j)``: any process makes any row without the
others, and the iterator's state stays the number of batches handed out. A source's rows of a
range of global rows are a range of its own rows, so each source's row maker
(:class:`~flaxformer_lite.data.batches.TrainBatches`) goes on through its epochs as a run of it
alone would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from flaxformer_lite.data import tokenizers
from flaxformer_lite.data.batches import TrainBatches
from flaxformer_lite.data.config import BLOCK_ROWS, DataConfig, weight_shares
from flaxformer_lite.data.run_stores import check_sources
from flaxformer_lite.data.store import open_store
from flaxformer_lite.data.store_writer import BATCH_SIZE, SourcePasses, training_texts
from flaxformer_lite.data.tokenizers import Tokenizer

_MIX_STREAM = 0x0D0E  # keeps the blocks' orders apart from other draws made from the seed


def block_counts(weights: Sequence[float]) -> np.ndarray:
    """int64 ``[S]``: each source's rows in a block of :data:`BLOCK_ROWS`, by weight; the rows
    left by rounding down go to the largest remainders (ties to the first source)."""
    shares = weight_shares(weights) * BLOCK_ROWS
    counts = np.floor(shares).astype(np.int64)
    left = BLOCK_ROWS - int(counts.sum())
    counts[np.argsort(-(shares - counts), kind="stable")[:left]] += 1
    return counts


class Mixture:
    """The source of every global row, and its row in that source's stream."""

    def __init__(self, weights: Sequence[float], seed: int):
        self.counts, self.seed = block_counts(weights), seed
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """``(source, rank)`` of the block's rows: rank ``r`` is the source's ``r``-th row in it."""
        if block not in self._blocks:
            if len(self._blocks) >= 2:  # a batch spans few blocks
                del self._blocks[min(self._blocks)]
            order = np.random.default_rng([self.seed, block, _MIX_STREAM]).permutation(BLOCK_ROWS)
            source = np.repeat(np.arange(len(self.counts)), self.counts)[order]
            rank = np.empty(BLOCK_ROWS, np.int64)
            for index, count in enumerate(self.counts.tolist()):
                rank[source == index] = np.arange(count)
            self._blocks[block] = source, rank
        return self._blocks[block]

    def draw(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """``(source, row)``, int64 ``[count]``, of global rows ``[first, first + count)``."""
        rows = np.arange(first, first + count)
        blocks = rows // BLOCK_ROWS
        source, row = np.empty(count, np.int64), np.empty(count, np.int64)
        for block in np.unique(blocks).tolist():
            local = blocks == block
            block_source, rank = self._block(block)
            at = rows[local] % BLOCK_ROWS
            source[local] = block_source[at]
            row[local] = block * self.counts[source[local]] + rank[at]
        return source, row


class MixtureBatches:
    """This process's rows of global batch ``g`` of a mixture: ``batches(g)``, a pure function of
    ``g``; each source's rows made by its own :class:`TrainBatches` (one layout for all)."""

    def __init__(self, parts: Sequence[TrainBatches], weights: Sequence[float], seed: int):
        self.parts, self.mixture = parts, Mixture(weights, seed)
        self.layout = parts[0].layout

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        layout = self.layout
        first = step * layout.batch_size + layout.process_index * layout.local_size
        source, row = self.mixture.draw(first, layout.local_size)
        batch: dict[str, np.ndarray] = {}
        for index in np.unique(source).tolist():
            mine = np.flatnonzero(source == index)
            rows = self.parts[index].rows(int(row[mine[0]]), len(mine))  # a range: see above
            for key, value in rows.items():
                if key not in batch:
                    batch[key] = np.zeros((layout.local_size, *value.shape[1:]), value.dtype)
                batch[key][mine] = value
        return batch


def weighted_texts(
    streams: Sequence[Callable[[], Iterable[str]]], sizes: Sequence[float], weights
) -> Iterator[str]:
    """Texts of every source for a tokenizer to fit on, each source's share by weight: of
    ``sum(sizes)`` UTF-8 bytes in all (one pass's worth), a source under its share read again
    from its start, one over it cut. ``streams[i]()`` gives source ``i``'s texts afresh."""
    total, weight_sum = sum(sizes), sum(weights)
    for stream, weight in zip(streams, weights, strict=True):
        target, seen = total * weight / weight_sum, 0
        while seen < target:
            before = seen
            for text in stream():
                yield text
                seen += len(text.encode("utf-8", "surrogatepass"))
                if seen >= target:
                    break
            if seen == before:  # nothing to read again
                break


def fitted_tokenizer(cfg: DataConfig) -> Tokenizer:
    """``data.tokenizer`` (char, word or bpe) fitted on the training parts of the mixture's
    sources, each seen by its weight (:func:`weighted_texts`)."""
    streams, sizes = [], []
    for part in cfg.mixture_sources().values():
        files = part.reader.files(part.path)
        passes = SourcePasses(part.reader, files, BATCH_SIZE, None)
        fraction = None if part.validation_path else cfg.validation_fraction
        streams.append(lambda p=passes, f=fraction, w=part.path: training_texts(p, f, w))
        sizes.append(sum(f.stat().st_size for f in files) * (1 - (fraction or 0)))
    weights = [entry.weight for entry in cfg.mixture.values()]
    texts = weighted_texts(streams, sizes, weights)
    return tokenizers.make_tokenizer(cfg.tokenizer, texts=texts, vocab_size=cfg.vocab_size)


def check_mixture_sources(parts: dict[str, DataConfig]) -> None:
    """Each source's files (:func:`check_sources`), and no source's validation data that
    another trains on."""
    named = {}
    for name, part in parts.items():
        with named_source(name):
            named[name] = check_sources(part)
    for name, files in named.items():
        for other, other_files in named.items():
            shared = sorted(files.get("validation_path", set()) & other_files["path"])
            if other != name and shared:
                raise ValueError(
                    f"data.mixture.{name}.validation_path={parts[name].validation_path}: "
                    f"{shared[0]} is training data of data.mixture.{other} too: the evaluation "
                    "would be on text the model trained on"
                )


@contextlib.contextmanager
def named_source(name: str) -> Iterator[None]:
    """Names the mixture's source ``name`` in a data error raised inside."""
    try:
        yield
    except (FileNotFoundError, ValueError) as error:
        message = str(error)
        for key in ("data.path", "data.validation_path"):  # the source's own settings
            if message.startswith(key):
                raise type(error)(f"data.mixture.{name}.{message[5:]}") from None
        raise type(error)(f"data.mixture.{name}: {message}") from None


def mixture_tokenizer(cfg: DataConfig) -> Tokenizer:
    """A new mixture's tokenizer: its first store's (each store is checked against it), one
    fitted on the sources by weight, or the one ``data.tokenizer`` names."""
    source = cfg.reader
    if source.brings_tokenizer:
        return open_store(source.store_at(next(iter(cfg.mixture.values())).path, None)).tokenizer
    if cfg.tokenizer in tokenizers.FITTED_TOKENIZERS:
        return fitted_tokenizer(cfg)
    return tokenizers.make_tokenizer(cfg.tokenizer, path=cfg.tokenizer_path)
