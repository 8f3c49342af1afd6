"""The passes of a prepare over a source's files: hashing, fitting a tokenizer, encoding into a
store's flat files (:mod:`flaxformer_lite.data.store` names the layout and owns the manifest).

Each pass streams the files batch by batch (:mod:`flaxformer_lite.data.readers`), so memory holds
a few batches, never the corpus. The files are the ones resolved once at the start, never a glob
expanded again: a file that appears during a prepare is not read without being recorded.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from flaxformer_lite.data import readers, tokenizers
from flaxformer_lite.data.documents import split_documents, text_digests
from flaxformer_lite.data.sources import FileSource
from flaxformer_lite.data.tokenizers import Tokenizer

DIGESTS = "digests.u64"
# Texts per encode_batch call: the batched encoders synchronise their threads once per call, so
# batches are large; a cap on their characters keeps batches of long documents small too.
BATCH_SIZE = 1 << 16
BATCH_CHARS = 1 << 19
READ_BYTES = 1 << 20

Progress = Callable[..., Any]
"""A tqdm-like factory: ``progress(total=n_bytes, desc=name)`` gives a bar with ``update(n)``
and ``close()``; one bar per pass over the source files."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 ids for vocabularies of up to 2**16 ids, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class FileHashes:
    """The sha256 of each file, fed the chunks a pass reads (a :data:`readers.OnRead`)."""

    def __init__(self, files: list[Path]):
        self._digests = {path: hashlib.sha256() for path in files}
        self._sizes = dict.fromkeys(files, 0)

    def __call__(self, path: Path, data: bytes) -> None:
        self._digests[path].update(data)
        self._sizes[path] += len(data)

    def infos(self) -> list[dict[str, Any]]:
        """Path, size and sha256 of each file, in reading order."""
        return [
            {"path": str(path), "size": self._sizes[path], "sha256": digest.hexdigest()}
            for path, digest in self._digests.items()
        ]


def hash_files(files: list[Path], progress: Progress | None) -> list[dict[str, Any]]:
    """Path, size and sha256 of each file (a pass that only hashes)."""
    hashes = FileHashes(files)
    with bar(progress, sum(p.stat().st_size for p in files), "hashing") as update:
        for path in files:
            with path.open("rb") as file:
                while data := file.read(READ_BYTES):
                    hashes(path, data)
                    update(len(data))
    return hashes.infos()


@dataclasses.dataclass(frozen=True)
class SourcePasses:
    """Passes over a source's records, batch by batch, each with a progress bar of its bytes."""

    source: FileSource  # with its reading settings
    files: list[Path]  # as source.files resolved them
    batch_size: int
    progress: Progress | None

    @property
    def fields(self) -> tuple[str, ...]:
        return self.source.fields

    def batches(
        self, desc: str, on_read: readers.OnRead | None = None
    ) -> Iterator[dict[str, list[str]]]:
        """Field name -> texts of the next ``batch_size`` records (fewer if they hold more than
        :data:`BATCH_CHARS` characters), to the end of the source; ``on_read`` sees every chunk
        of bytes read."""
        with bar(self.progress, sum(p.stat().st_size for p in self.files), desc) as update:

            def read(path: Path, data: bytes) -> None:
                update(len(data))
                if on_read is not None:
                    on_read(path, data)

            records = self.source.records(self.files, read)
            batch, chars = [], 0
            for record in records:
                batch.append(record)
                chars += sum(map(len, record.values()))
                if len(batch) == self.batch_size or chars >= BATCH_CHARS:
                    yield {name: [r[name] for r in batch] for name in self.fields}
                    batch, chars = [], 0
            if batch:
                yield {name: [r[name] for r in batch] for name in self.fields}


def fit_tokenizer(
    passes: SourcePasses,
    name: str,
    vocab_size: int | None,
    validation_fraction: float | None,
    where: str,
    on_read: readers.OnRead | None = None,
) -> Tokenizer:
    """A tokenizer fitted on :func:`training_texts` (the source is also fed to ``on_read``)."""
    texts = training_texts(passes, validation_fraction, where, on_read)
    return tokenizers.make_tokenizer(name, texts=texts, vocab_size=vocab_size)


def training_texts(
    passes: SourcePasses,
    validation_fraction: float | None,
    where: str,
    on_read: readers.OnRead | None = None,
) -> Iterator[str]:
    """The texts of the training part of the source, what a tokenizer is fitted on: all of it
    if ``validation_fraction`` is None (the validation data come from elsewhere); the head of
    each whole-file document (:func:`~flaxformer_lite.data.documents.hold_out_tails`, here by
    characters); else one pass hashes every document to split them (:func:`split_documents`,
    naming ``where``) and the next yields the texts of those not held out."""
    if validation_fraction is None or passes.source.whole_files:
        keep = 1.0 if validation_fraction is None else 1 - validation_fraction
        docs = (doc for texts in passes.batches("fitting", on_read) for doc in _documents(texts))
        yield from (text[: int(len(text) * keep)] for doc in docs for text in doc)
        return
    batches = passes.batches("splitting", on_read)
    digests = np.concatenate([text_digests(texts) for texts in batches])
    train, _ = split_documents(digests, validation_fraction, where)
    in_train = np.zeros(len(digests), bool)
    in_train[train] = True
    docs = (doc for texts in passes.batches("fitting") for doc in _documents(texts))
    yield from (text for doc, keep in zip(docs, in_train, strict=True) if keep for text in doc)


def _documents(texts: dict[str, list[str]]) -> Iterator[tuple[str, ...]]:
    """Each document's field texts, from a batch of them by field."""
    return zip(*texts.values(), strict=True)


def write_documents(
    directory: Path,
    passes: SourcePasses,
    tokenizer: Tokenizer,
    on_read: readers.OnRead | None = None,
) -> tuple[int, dict[str, int]]:
    """Encodes the source into ``directory``'s ``{field}.tokens``, ``{field}.offsets`` and
    :data:`DIGESTS`; returns the number of documents and each field's tokens."""
    dtype = token_dtype(tokenizer.vocab_size)
    tokens, documents = dict.fromkeys(passes.fields, 0), 0  # written so far

    def write(ids: dict[str, list[list[int]]]) -> None:
        for name, field_ids in ids.items():
            ends = np.cumsum(np.fromiter(map(len, field_ids), np.int64, len(field_ids)))
            outputs[f"{name}.offsets"].write(memoryview(tokens[name] + ends))
            flat = itertools.chain.from_iterable(field_ids)
            outputs[f"{name}.tokens"].write(memoryview(np.fromiter(flat, dtype, int(ends[-1]))))
            tokens[name] += int(ends[-1])

    # One batch is encoded (without the GIL, on all cores) while the next is read and hashed
    # and the one before is written: at most three batches in memory, nothing per document.
    with contextlib.ExitStack() as stack:
        names = [DIGESTS, *(f"{n}.{part}" for n in passes.fields for part in ("tokens", "offsets"))]
        outputs = {name: stack.enter_context((directory / name).open("wb")) for name in names}
        for name in passes.fields:
            outputs[f"{name}.offsets"].write(memoryview(np.zeros(1, np.int64)))
        pool = stack.enter_context(concurrent.futures.ThreadPoolExecutor(1))
        pending = None
        for texts in passes.batches("encoding", on_read):
            encoding = pool.submit(_encode, tokenizer, texts)
            outputs[DIGESTS].write(memoryview(text_digests(texts)))
            documents += len(next(iter(texts.values())))
            if pending is not None:
                write(pending.result())
            pending = encoding
        if pending is not None:
            write(pending.result())
    return documents, tokens


def _encode(tokenizer: Tokenizer, texts: dict[str, list[str]]) -> dict[str, list[list[int]]]:
    """Each field's ids; a target side by its own model where the tokenizer has one."""
    return {
        name: (tokenizer.encode_target_batch if name == "target" else tokenizer.encode_batch)(t)
        for name, t in texts.items()
    }


def fsync_tree(directory: Path) -> None:
    """Flushes every file under ``directory`` and the directories themselves to disk, so that a
    crash after the manifest is written cannot leave a manifest over missing data."""
    for path in sorted(directory.rglob("*"), reverse=True):
        if path.is_file():
            with path.open("rb") as file:
                os.fsync(file.fileno())
    for path in [*(p for p in directory.rglob("*") if p.is_dir()), directory]:
        fsync_directory(path)


def fsync_directory(path: Path) -> None:
    """Flushes a directory's entries (new names, renames) to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def bar(progress: Progress | None, total: int, desc: str) -> Iterator[Callable[[int], Any]]:
    """A progress bar's ``update`` (a no-op without ``progress``); the bar is closed after."""
    progress_bar = None if progress is None else progress(total=total, desc=desc)
    try:
        yield (lambda n: None) if progress_bar is None else progress_bar.update
    finally:
        if progress_bar is not None:
            progress_bar.close()
