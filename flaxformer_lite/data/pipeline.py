"""Input pipelines: a source -> documents -> sharded, resumable numpy batches, made ahead.

    run = RunDir("runs/x")            # where a run keeps its tokenizer and prepared stores
    data = build_data(cfg.data, task=cfg.task, seed=0, batch_size=32,
                      directory=run.tokenizer, prepared=run.prepared)
    batch = next(data.train)          # this process's share of the next global batch
    state = data.train.get_state()    # JSON-able: save it with the checkpoint, set_state to resume
    for batch in data.eval_batches(): ...

Batches are dicts of numpy arrays ``[B, T]`` with ``B = batch_size // process_count`` and
``T = seq_len`` (int32 unless noted; ``weights`` float32, 0 exactly at padding; masks bool, False at
padding; padding ids are ``<pad> = 0``), each task's arrays as :mod:`flaxformer_lite.data.tasks`
describes them (``<sos>`` and ``<eos>`` are the tokenizer's ``sos_id`` and ``eos_id``: a Hugging
Face checkpoint's tokenizer has its own, and padding, marked by weights and masks, stays id 0 even
where 0 is a real token, so no pad token is needed: GPT-2 has none, and its ``<eos>`` targets keep
weight 1).

Every source first becomes tokenized :class:`~flaxformer_lite.data.documents.Documents` with a
tokenizer and a validation split; one path then batches them
(:mod:`flaxformer_lite.data.batches`). Training rows come in epochs, each a new shuffle of the
training documents by ``(seed, epoch)``: for ``lm``, documents cut into pieces of at most
``seq_len`` positions and packed next-fit (or one piece per row without ``packing``), or with
``data.lm_rows=windows`` the documents end to end cut into rows: every token of every training
document is in one row of each epoch. Other tasks: one document per row, cut to fit (the
:attr:`Data.notices` say how much). Validation is every held-out document: ``lm`` pieces in
document order, so its numbers are over every validation token whatever the training layout.
Global batch ``g`` is rows ``[g * batch_size, (g + 1) * batch_size)`` and process ``i`` makes only
its rows ``[i * B, (i + 1) * B)``. The rows never depend on the process count, so the iterator
state (it counts global batches) is the same on every process, and a run may resume on another
number of processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from flaxformer_lite.data import tokenizers
from flaxformer_lite.data.batches import (
    Layout,
    TrainBatches,
    TrainIterator,
    eval_batches,
    eval_row_count,
)
from flaxformer_lite.data.config import DataConfig
from flaxformer_lite.data.documents import (
    Documents,
    hold_out_tails,
    split_documents,
)
from flaxformer_lite.data.mixture import (
    MixtureBatches,
    check_mixture_sources,
    mixture_tokenizer,
    named_source,
)
from flaxformer_lite.data.notices import (
    mixture_notice,
    small_source_notice,
    truncation_notice,
    unknown_notice,
)
from flaxformer_lite.data.run_stores import (
    check_sources,
    decoded_records,
    records_of,
    run_store,
    validation_records,
    validation_store,
)
from flaxformer_lite.data.sources import source_of_store
from flaxformer_lite.data.tasks import Task
from flaxformer_lite.data.tokenizers import Tokenizer

# Fitted tokenizers see all training records of a file source, or this many synthetic examples.
FIT_EXAMPLES = 20_000


@dataclasses.dataclass(frozen=True)
class EvalPart:
    """One source's validation split: its global batches, its target tokens (as
    :attr:`Data.eval_tokens`), its records (as :attr:`Data.eval_examples`), and a fresh pass
    over them (as :meth:`Data.eval_batches`)."""

    batch_count: int
    tokens: int | None
    eval_examples: Sequence[dict[str, Any]]
    make_batches: Callable[[], Iterator[dict[str, np.ndarray]]] = dataclasses.field(repr=False)


@dataclasses.dataclass(frozen=True)
class Data:
    """What :func:`build_data` returns.

    Attributes:
      tokenizer: the tokenizer all batches were made with.
      train: this process's training batches (:class:`~flaxformer_lite.data.batches
        .TrainIterator`).
      eval_examples: all validation records (every process sees all), for generation scores:
        the synthetic validation ``Generator``, or dicts with ``text`` or ``source`` and ``target``.
      labels: the class names of a ``classify`` task, else None.
      eval_batch_count: the global batches of a whole pass over the validation split.
      eval_tokens: the target tokens of the validation split, for ``lm`` and ``seq2seq`` (what
        its token-weighted metrics are over), else None.
      notices: what a run should say once: the examples a task cut to fit ``seq_len``.
      make_eval_batches: what :meth:`eval_batches` calls.
      sources: a mixture's validation parts by source name (evaluated one by one; the other
        attributes are over all of them, in this order); empty for one source.
    """

    tokenizer: Tokenizer
    train: TrainIterator
    eval_examples: Sequence[dict[str, Any]]
    labels: tuple[str, ...] | None
    eval_batch_count: int
    eval_tokens: int | None
    notices: tuple[str, ...]
    make_eval_batches: Callable[[], Iterator[dict[str, np.ndarray]]] = dataclasses.field(repr=False)
    sources: Mapping[str, EvalPart] = dataclasses.field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def eval_batches(self) -> Iterator[dict[str, np.ndarray]]:
        """A fresh pass over the validation split, :attr:`eval_batch_count` global batches in
        document order (:func:`~flaxformer_lite.data.batches.eval_batches`); the last is filled
        up with padding rows (weights 0, masks False) so every batch has one shape and every
        token counts once."""
        return self.make_eval_batches()


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A source tokenized: training documents ``train[0]`` at ids ``train[1]``, validation
    documents likewise, the validation records for generation scores, the class names."""

    train: tuple[Documents, np.ndarray]
    validation: tuple[Documents, np.ndarray]
    eval_examples: Sequence[dict[str, Any]]
    labels: tuple[str, ...] | None = None


def build_data(
    cfg: DataConfig,
    *,
    task: Task,
    seed: int,
    batch_size: int,
    directory: Path,
    prepared: Path | None = None,
    process_index: int = 0,
    process_count: int = 1,
    save_tokenizer: bool | None = None,
    tokenizer: Tokenizer | None = None,
    prefetch: int = 4,
) -> Data:
    """Reads the data ``cfg`` names, prepares its tokenizer and builds the train/eval pipelines.

    Args:
      cfg: the data config.
      task: what the model trains on (``TrainConfig.task``), one of
        :data:`~flaxformer_lite.data.tasks.TASKS`.
      seed: shuffles the training stream (and, with it, the synthetic data and MLM masking).
      batch_size: the global batch size; each process gets ``batch_size // process_count`` rows.
      directory: where the tokenizer is saved. A tokenizer already saved there is loaded
        instead of fitted again, so a resumed run sees the same ids.
      prepared: where text, jsonl and parallel sources are prepared into token stores, one
        per source, on first use (a run's ``RUN/prepared``); needed for those sources only.
      process_index, process_count: which of ``process_count`` equal blocks of rows of each
        global batch this process makes (processes that feed the same devices' rows share one).
      save_tokenizer: whether this process writes the tokenizer (default: ``process_index ==
        0``); exactly one process of those sharing a file system should.
      tokenizer: use this tokenizer (e.g. a Hugging Face checkpoint's, with its own ids) instead
        of the one ``cfg.tokenizer`` names; it is saved in ``directory`` like a fitted one.
      prefetch: training batches made ahead in a background thread (0: each made by the
        ``next()`` that returns it).

    Raises:
      ValueError: the source does not fit ``task``, an unusable batch size or process, a saved
        tokenizer that is not the run's, or bad data (the message names the file).
      FileNotFoundError: a missing data or tokenizer file.
    """
    task_type = task
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    if batch_size < 1 or batch_size % process_count:
        raise ValueError(
            f"the global batch size {batch_size} must be a positive multiple of the process "
            f"count {process_count}"
        )
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    if (cfg.packing or cfg.lm_rows != "documents") and not task_type.pieces:
        raise ValueError(
            f"data.packing=true and data.lm_rows apply to task 'lm' only, not {task.name!r}"
        )
    packing = task_type.is_packed(cfg.packing)
    _check_fits(cfg, task)
    save = process_index == 0 if save_tokenizer is None else save_tokenizer
    if cfg.mixture:  # before a tokenizer is fitted on them
        check_mixture_sources(cfg.mixture_sources())
    # One tokenizer for every part: decided here, else made with the first part's data.
    tokenizer, corpora = run_tokenizer(cfg, Path(directory), tokenizer), {}
    for name, part in cfg.parts().items():
        with named_source(name) if name else contextlib.nullcontext():
            tokenizer, corpora[name] = _load(part, task, seed, prepared, tokenizer)
    if save and not _has_saved_tokenizer(Path(directory)):
        tokenizer.save(directory)
    layout = Layout(
        task=task_type,
        rows=cfg.lm_rows if packing else "single",
        seq_len=cfg.seq_len,
        batch_size=batch_size,
        process_index=process_index,
        process_count=process_count,
        sos_id=tokenizer.sos_id,
        eos_id=tokenizer.eos_id,
        vocab_size=tokenizer.vocab_size,
        mlm_probability=cfg.mlm_probability,
        seed=seed,
    )
    pipeline = dict(task=task.name, rows=layout.rows, seq_len=cfg.seq_len, seed=seed)
    pipeline.update(batch_size=batch_size, train_documents=0, train_tokens=0)
    parts, notices = {}, []
    for name, corpus in corpora.items():
        documents, ids = corpus.train
        tokens = sum(int(documents.lengths(f)[ids].sum()) for f in documents.fields)
        pipeline["train_documents"] += len(ids)
        pipeline["train_tokens"] += tokens
        if name:
            weight = cfg.mixture[name].weight
            mixture = pipeline.setdefault("mixture", {})
            mixture[name] = {"weight": weight, "documents": len(ids), "tokens": tokens}
        for split, (docs, split_ids) in (
            ("training", corpus.train),
            ("validation", corpus.validation),
        ):
            split = f"{name} {split}" if name else split
            if notice := truncation_notice(task_type, docs, split_ids, cfg.seq_len, split):
                notices.append(notice)
            if notice := unknown_notice(tokenizer, docs, split_ids, split):
                notices.append(notice)
        if name and (notice := small_source_notice(name, tokens, cfg.seq_len)):
            notices.append(notice)
        valid_documents, valid_ids = corpus.validation
        parts[name] = EvalPart(
            batch_count=-(-eval_row_count(*corpus.validation, layout) // batch_size),
            tokens=task_type.target_tokens(valid_documents, valid_ids, cfg.seq_len),
            eval_examples=corpus.eval_examples,
            make_batches=functools.partial(eval_batches, *corpus.validation, layout),
        )
    batches = [TrainBatches(*corpus.train, layout) for corpus in corpora.values()]
    if cfg.mixture:
        weights = [entry.weight for entry in cfg.mixture.values()]
        make = MixtureBatches(batches, weights, seed)
        counts = zip(cfg.mixture, make.mixture.counts.tolist(), strict=True)
        notices.insert(0, mixture_notice(cfg.mixture, counts))
    else:
        make = batches[0]
    tokens = [part.tokens for part in parts.values()]
    # A synthetic validation Generator is its own sequence of records; a mixture's are the sources'.
    examples = [r for c in corpora.values() for r in c.eval_examples] if cfg.mixture else None
    examples = corpora[""].eval_examples if examples is None else examples
    labels = next(iter(corpora.values())).labels
    return Data(
        tokenizer=tokenizer,
        train=TrainIterator(make, pipeline, prefetch),
        eval_examples=examples,
        labels=labels if "labels" in task_type.arrays else None,
        eval_batch_count=sum(part.batch_count for part in parts.values()),
        eval_tokens=None if None in tokens else sum(tokens),
        notices=tuple(notices),
        make_eval_batches=lambda: itertools.chain(*(p.make_batches() for p in parts.values())),
        sources=parts if cfg.mixture else {},
    )


def _check_fits(cfg: DataConfig, task: Task) -> None:
    for name, part in cfg.parts().items():
        records = part.reader.record_type_of(part)
        if records is not None:  # else checked against the store's manifest once it is open
            with named_source(name) if name else contextlib.nullcontext():
                task.check_records(records, part.reader.described(part))


def _load(
    cfg: DataConfig, task: Task, seed: int, prepared: Path | None, chosen: Tokenizer | None
) -> tuple[Tokenizer, Corpus]:
    """The tokenizer (``chosen``, or made with the data) and the source tokenized, with its
    validation split."""
    source = cfg.reader
    if not source.stored:
        train, valid = source.examples(cfg, "train", seed), source.examples(cfg, "validation", seed)
        # Drawn only if a tokenizer is fitted on them: the byte tokenizer reads none.
        fit = (train[i] for i in range(min(len(train), FIT_EXAMPLES)))
        tokenizer = chosen or _fitted_on_records(cfg, fit)
        corpus = Corpus(
            (train.documents(tokenizer), np.arange(len(train))),
            (valid.documents(tokenizer), np.arange(len(valid))),
            valid,
            getattr(train, "labels", None),
        )
        return tokenizer, corpus
    return _load_store(cfg, prepared, chosen, task=task)


def _load_store(
    cfg: DataConfig, prepared: Path | None, chosen: Tokenizer | None, task: Task
) -> tuple[Tokenizer, Corpus]:
    """A prepared store (``data.source=prepared``), or a text, jsonl or parallel source prepared
    into a store in ``prepared`` on first use: one read path for all.
    The validation documents are ``data.validation_path``'s, prepared alike with the training
    store's tokenizer, or held out of the training store."""
    check_sources(cfg)
    store = run_store(cfg, prepared, chosen)
    records = records_of(store)
    task.check_records(records, f"the store {store.path} ({records} documents)")
    valid_store = None
    if cfg.validation_path is not None:
        try:
            valid_store = validation_store(cfg, prepared, store)
        except (FileNotFoundError, ValueError) as error:  # named as check_sources names it
            if str(error).startswith("data.validation_path"):
                raise
            raise type(error)(f"data.validation_path: {error}") from None
    documents = store.documents
    if valid_store is not None:
        train, valid = np.arange(len(documents)), np.arange(len(valid_store.documents))
        train, valid = train[: cfg.train_size], valid[: cfg.eval_size]
        examples = validation_records(valid_store, valid)
        corpus = Corpus((documents, train), (valid_store.documents, valid), examples)
        return store.tokenizer, corpus
    where = cfg.path or str(store.path)
    if source_of_store(store.manifest["source"]).whole_files:
        documents, train, valid = hold_out_tails(documents, cfg.validation_fraction, where)
        train, valid = train[: cfg.train_size], valid[: cfg.eval_size]
        examples = decoded_records(store.tokenizer, documents, valid)
    else:
        train, valid = split_documents(documents.digests, cfg.validation_fraction, where)
        train, valid = train[: cfg.train_size], valid[: cfg.eval_size]
        examples = validation_records(store, valid)
    return store.tokenizer, Corpus((documents, train), (documents, valid), examples)


def prepare_run_store(
    cfg: DataConfig, directory: Path, prepared: Path, given: Tokenizer | None = None
) -> None:
    """Prepares in ``prepared`` the stores a run whose tokenizer lives in ``directory`` reads
    (see :func:`build_data`), if its source needs them and they are not there yet; a mixture's
    tokenizer, made here for all its stores, is saved in ``directory``.

    A multi-process run calls this on one process before the others build their data, so that a
    shared run directory's cache is written once; on a file system of its own, a process that
    finds no store prepares its own copy."""
    if not cfg.reader.stored:
        return
    if not cfg.mixture:
        _prepare_stores(cfg, prepared, run_tokenizer(cfg, directory, given))
        return
    check_mixture_sources(cfg.mixture_sources())
    tokenizer = run_tokenizer(cfg, directory, given)
    for name, part in cfg.mixture_sources().items():
        with named_source(name):
            _prepare_stores(part, prepared, tokenizer)
    if not _has_saved_tokenizer(directory):
        tokenizer.save(directory)


def _prepare_stores(cfg: DataConfig, prepared: Path, tokenizer: Tokenizer | None) -> None:
    check_sources(cfg)
    store = run_store(cfg, prepared, tokenizer)
    if cfg.validation_path is not None:
        validation_store(cfg, prepared, store)


def run_tokenizer(cfg: DataConfig, directory: Path, given: Tokenizer | None) -> Tokenizer | None:
    """Which tokenizer the run uses, decided here for every source before its data are read:
    the run's own, saved in ``directory`` (a resumed run keeps its ids), else ``given``
    (``init_from``'s, with its ids), else a mixture's (:func:`.mixture.mixture_tokenizer`).
    None: the one ``data.tokenizer`` names is made with the data: fitted on a synthetic generator's
    examples (:func:`_fitted_on_records`) or as a store is prepared, or a prepared store's own.

    Raises:
      ValueError: a saved tokenizer that is not the run's (:func:`_saved_tokenizer`).
    """
    chosen = _saved_tokenizer(cfg, directory, given) or given
    if chosen is None and cfg.mixture:
        return mixture_tokenizer(cfg)
    return chosen


def _fitted_on_records(cfg: DataConfig, records: Iterable[dict]) -> Tokenizer:
    """The tokenizer ``data.tokenizer`` names, fitted on ``records`` if it is fitted. Only the
    writing process saves it; fitting is deterministic, so the others fit the same one."""
    texts = (r[key] for r in records for key in ("text", "source", "target") if key in r)
    return tokenizers.make_tokenizer(
        cfg.tokenizer, texts=texts, vocab_size=cfg.vocab_size, path=cfg.tokenizer_path
    )


def _has_saved_tokenizer(directory: Path) -> bool:
    return (directory / tokenizers.NAME_FILE).is_file()


def _saved_tokenizer(cfg: DataConfig, directory: Path, given: Tokenizer | None) -> Tokenizer | None:
    """The tokenizer a run saved in ``directory`` (None if none), checked against the run's."""
    if not _has_saved_tokenizer(directory):
        return None
    tokenizer = tokenizers.load_tokenizer(directory)
    name = cfg.tokenizer if given is None else given.name
    if not cfg.reader.brings_tokenizer and tokenizer.name != name:
        wanted = f"data.tokenizer={name!r}" if given is None else f"a {name!r} tokenizer"
        raise ValueError(
            f"{directory}: holds a saved {tokenizer.name!r} tokenizer, but this run uses {wanted}"
        )
    if given is not None and not tokenizer.same_as(given):
        raise ValueError(
            f"{directory}: holds another checkpoint's tokenizer than the one "
            "this run starts from (init_from)"
        )
    return tokenizer
