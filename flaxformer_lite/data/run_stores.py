"""The token stores a run reads: a source of files prepared into the run's cache on first use
(one store per source, where its class says: :meth:`~flaxformer_lite.data.sources.Source
.store_at`), or a prepared store opened (``data.source=prepared``); either one checked
against the run's tokenizer and its data settings.
:func:`~flaxformer_lite.data.pipeline.build_data` reads them; ``flaxformer-lite prepare`` makes
them ahead (:func:`prepare_source`, :func:`prepare_validation`).
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import numpy as np

from flaxformer_lite.data import readers
from flaxformer_lite.data.config import DataConfig
from flaxformer_lite.data.documents import Documents, text_digests
from flaxformer_lite.data.sources import source_of_store
from flaxformer_lite.data.store import (
    Store,
    check_tokenizer,
    open_store,
    prepare_store,
    text_documents,
)
from flaxformer_lite.data.tokenizers import TOKENIZERS, Tokenizer


def check_sources(cfg: DataConfig) -> dict[str, set[Path]]:
    """Refuses a missing source, a file with nothing but blanks, or validation data that the
    training data hold too, before anything is written; the message names the setting and the
    file. Returns the files (a store: its directory) each setting names, resolved."""
    source, named = cfg.reader, {}
    for key in ("path", "validation_path"):
        path = getattr(cfg, key)
        if path is None:
            continue
        try:
            if not source.made_by_run:  # a given store: opening it checks it
                named[key] = {open_store(source.store_at(path, None)).path.resolve()}
            else:
                files = source.files(path)
                for file in files:
                    readers.check_not_blank(file)
                named[key] = {file.resolve() for file in files}
        except (FileNotFoundError, ValueError) as error:
            raise type(error)(f"data.{key}: {error}") from None
    shared = sorted(named.get("path", set()) & named.get("validation_path", set()))
    if shared:
        more = f" and {len(shared) - 1} more" if len(shared) > 1 else ""
        raise ValueError(
            f"data.validation_path={cfg.validation_path}: {shared[0]}{more} is training data "
            f"too (data.path={cfg.path}): the evaluation would be on text the model trained "
            "on; name separate files, or leave data.validation_path unset to hold out "
            "data.validation_fraction"
        )
    return named


def run_store(cfg: DataConfig, prepared: Path | None, tokenizer: Tokenizer | None) -> Store:
    """``data.path``'s store, or the source's in the run's cache (made with ``tokenizer`` if the
    run has one: a resumed run's saved copy, or ``init_from``'s), checked against ``tokenizer``
    and against ``data.text_documents`` and ``data.tokenizer`` where they are set."""
    source = cfg.reader
    if source.made_by_run:
        return prepare_source(cfg, source.store_at(cfg.path, prepared), tokenizer)
    store = open_store(source.store_at(cfg.path, prepared))
    if tokenizer is not None:
        check_tokenizer(store, tokenizer)
    made = text_documents(store.manifest)
    if cfg.text_documents is not None and made != cfg.text_documents:
        raise ValueError(
            f"{store.path}: prepared from {_store_source(store)} data, not with "
            f"data.text_documents={cfg.text_documents!r}"
        )
    name = store.tokenizer.name
    if cfg.tokenizer is not None and cfg.tokenizer != name:
        named = f" or set it to {name!r}" if name in TOKENIZERS else ""  # not a checkpoint's
        raise ValueError(
            f"{store.path}: the store's tokenizer is {name!r}; data.tokenizer says "
            f"{cfg.tokenizer!r}: drop the setting (data.tokenizer=null){named}"
        )
    return store


def validation_store(cfg: DataConfig, prepared: Path | None, train: Store) -> Store:
    """``data.validation_path``'s store: prepared in the run's cache, or opened."""
    source = cfg.reader
    if source.made_by_run:
        return prepare_validation(cfg, source.store_at(cfg.validation_path, prepared), train)
    store = open_store(source.store_at(cfg.validation_path, prepared))
    _check_same_source(cfg, store, train)
    check_tokenizer(store, train.tokenizer)
    return store


def prepare_validation(cfg: DataConfig, out_dir: Path, train: Store, progress=None) -> Store:
    """``data.validation_path``'s files prepared into a store at ``out_dir`` as ``data.path``'s
    were into ``train`` (the same source and documents), with ``train``'s tokenizer."""
    valid_cfg = dataclasses.replace(cfg, path=cfg.validation_path)
    return prepare_source(valid_cfg, out_dir, train.tokenizer, progress)


def _check_same_source(cfg: DataConfig, store: Store, train: Store) -> None:
    path = cfg.validation_path
    made, wanted = _store_source(store), _store_source(train)
    if made != wanted:
        raise ValueError(
            f"data.validation_path={path}: holds {made} data, but the training data "
            f"(data.path={cfg.path}) are {wanted}"
        )


def _store_source(store: Store) -> str:
    """What a store holds, in words: its source and, for text, its documents."""
    source = store.manifest["source"]
    documents = text_documents(store.manifest)
    return f"{source['kind']} ({documents} documents)" if documents else repr(source["kind"])


def prepare_source(
    cfg: DataConfig, out_dir: Path, tokenizer: Tokenizer | None = None, progress=None
) -> Store:
    """The text, jsonl or parallel source ``cfg`` names, prepared into a store at ``out_dir``
    (:func:`~flaxformer_lite.data.store.prepare_store`, with ``tokenizer`` or the one ``cfg``
    names, fitted on all of it when ``data.validation_path`` names the validation data); the
    store already there when it was made from the same inputs."""
    return prepare_store(
        out_dir,
        source=cfg.reader,
        path=cfg.path,
        tokenizer=tokenizer,
        tokenizer_name=cfg.tokenizer,
        vocab_size=cfg.vocab_size,
        tokenizer_path=cfg.tokenizer_path,
        validation_fraction=None if cfg.validation_path else cfg.validation_fraction,
        progress=progress,
    )


def records_of(store: Store) -> str:
    """The type of records of a store: those its source yields."""
    return source_of_store(store.manifest["source"]).record_type


def validation_records(store, ids: np.ndarray) -> list[dict[str, str]]:
    """The records (text, or source and target) of the validation documents ``ids``, for
    generation scores: read again from the source files when they still hold these documents
    (their digests match the store's), else decoded from the store."""
    made_from = store.manifest["source"]
    wanted = set(ids.tolist())
    try:
        files = [Path(file["path"]) for file in made_from["files"]]
        records = source_of_store(made_from).records(files)
        records = itertools.islice(records, int(ids.max()) + 1)  # the rest is not needed
        by_index = {i: r for i, r in enumerate(records) if i in wanted}
    except (FileNotFoundError, ValueError):
        by_index = {}
    if len(by_index) == len(wanted):
        found = [by_index[i] for i in ids.tolist()]
        columns = {f: [r[f] for r in found] for f in store.documents.fields}
        if np.array_equal(text_digests(columns), store.documents.digests[ids]):
            return found
    return decoded_records(store.tokenizer, store.documents, ids)


def decoded_records(tokenizer: Tokenizer, documents: Documents, ids: np.ndarray) -> list[dict]:
    """The records of documents ``ids``, decoded from their ids."""
    fields = documents.fields
    return [{f: tokenizer.decode(documents.document(f, i)) for f in fields} for i in ids.tolist()]
