"""Grain input pipelines: records -> tokens -> sharded, resumable numpy batches.

    data = build_data(cfg, task="lm", seed=0, batch_size=32, directory=run_dir / "tokenizer")
    batch = next(data.train)          # this process's share of the next global batch
    state = data.train.get_state()    # JSON-able: save it with the checkpoint, set_state to resume
    for batch in data.eval_batches(): ...

Batches are dicts of numpy arrays ``[B, T]`` with ``B = batch_size // process_count`` and
``T = seq_len`` (int32 unless noted; ``weights`` float32, 0 exactly at padding; masks bool, False at
padding; padding ids are ``<pad> = 0``), the formats ``train.step.model_loss`` reads (``<sos>`` and
``<eos>`` are the tokenizer's ``sos_id`` and ``eos_id``: a Hugging Face checkpoint's tokenizer has
its own, and padding, marked by weights and masks, stays id 0 even where 0 is a real token, so no
pad token is needed: GPT-2 has none, and its ``<eos>`` targets keep weight 1). Each task's
arrays are listed in :mod:`flaxformer_lite.data.features`.

Training data is one endless stream, the records shuffled by ``seed`` and reshuffled every epoch
(``MapDataset.shuffle(seed).repeat()``); each global batch takes the next ``batch_size`` examples
(or packed rows), and process ``i`` keeps rows ``[i * B, (i + 1) * B)``. The stream never depends
on the process count, so the iterator state (it counts global batches) is the same on every
process, and a run may resume on another number of processes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grain
import numpy as np
from grain.experimental import FirstFitPackIterDataset

from flaxformer_lite.data import sources, synthetic, tokenizers
from flaxformer_lite.data.features import featurize, pad
from flaxformer_lite.data.tokenizers import NUM_SPECIAL, Tokenizer

SOURCES = ("synthetic", "text", "jsonl", "parallel")
TOKENIZERS = ("byte", "char", "word", "bpe", "sentencepiece")
TASKS = ("lm", "seq2seq", "mlm", "classify")  # as train.step.TASKS (data may not import train)
# Fitted tokenizers see all training records of a file source, or this many synthetic examples.
FIT_EXAMPLES = 20_000
_READ_OPTIONS = grain.ReadOptions(num_threads=4, prefetch_buffer_size=16)
_TRAIN_STREAM, _EVAL_STREAM = 0, 1  # separate MLM masking draws for the two splits

_TEXT = "text (data.source text or jsonl, or a synthetic lm task)"
# The kinds of records each model task trains on, and how to say so.
_NEEDS = {
    "lm": (("lm", "classification"), _TEXT),
    "mlm": (("lm", "classification"), _TEXT),
    "seq2seq": (("seq2seq",), "source/target pairs (data.source parallel, or number_words)"),
    "classify": (("classification",), "labelled text (the synthetic sentiment task)"),
}


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the data comes from and how it becomes batches.

    Attributes:
      source: ``synthetic`` (the built-in ``task``), ``text`` (``path`` a glob of text files, one
        example per non-blank line), ``jsonl`` (``path`` a glob of JSONL files, the text in
        ``field``) or ``parallel`` (``path`` a TSV file or ``"src_file,tgt_file"``).
      task: synthetic task name (``synthetic.TASKS``), used when ``source`` is ``synthetic``.
      path: the files of a non-synthetic source.
      field: the JSONL field that holds the text.
      tokenizer: ``byte``; ``char``, ``word`` or ``bpe`` fitted on the training texts; or
        ``sentencepiece`` loaded from ``tokenizer_path``.
      tokenizer_path: a SentencePiece ``.model`` file.
      vocab_size: the BPE target size (required, >= 260), or a cap on a word vocabulary.
      seq_len: tokens per row of every ``[B, seq_len]`` array; longer examples are truncated.
      packing: first-fit pack several examples into each training row (``lm`` only); None (the
        default) packs for ``lm`` and pads for the other tasks.
      validation_fraction: share of a file source's records held out for validation (synthetic
        tasks have their own validation split).
      mlm_probability: share of an ``mlm`` example's tokens to predict.
      train_size: at most this many training examples (None: all; synthetic: 1,000,000).
      eval_size: at most this many validation examples (None: all; synthetic: 1,000).
    """

    source: str = "synthetic"
    task: str = "arithmetic"
    path: str | None = None
    field: str = "text"
    tokenizer: str = "byte"
    tokenizer_path: str | None = None
    vocab_size: int | None = None
    seq_len: int = 64
    packing: bool | None = None
    validation_fraction: float = 0.1
    mlm_probability: float = 0.15
    train_size: int | None = None
    eval_size: int | None = None

    def __post_init__(self):
        _check_choice("source", self.source, SOURCES)
        _check_choice("tokenizer", self.tokenizer, TOKENIZERS)
        if self.source == "synthetic":
            _check_choice("task", self.task, tuple(synthetic.TASKS))
        elif not self.path:
            raise ValueError(f"data.path is required with data.source={self.source!r}")
        if self.tokenizer == "sentencepiece" and not self.tokenizer_path:
            raise ValueError("data.tokenizer='sentencepiece' needs data.tokenizer_path")
        if self.tokenizer == "bpe" and self.vocab_size is None:
            raise ValueError("data.tokenizer='bpe' needs data.vocab_size")
        _check_int("seq_len", self.seq_len, 4)
        min_vocab = NUM_SPECIAL + (256 if self.tokenizer == "bpe" else 1)
        for name, low in (("vocab_size", min_vocab), ("train_size", 1), ("eval_size", 1)):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low)
        if self.packing is not None and not isinstance(self.packing, bool):
            raise ValueError(f"data.packing must be a bool or None, got {self.packing!r}")
        if not 0 < self.validation_fraction < 1:
            raise ValueError(
                f"data.validation_fraction must be in (0, 1), got {self.validation_fraction!r}"
            )
        if not 0 < self.mlm_probability <= 1:
            raise ValueError(f"data.mlm_probability must be in (0, 1], got {self.mlm_probability}")


class TrainIterator:
    """This process's training batches, endless, resumable from a JSON-able state.

    ``get_state()`` is ``{"pipeline": {...}, "grain": <Grain iterator state>}``. Grain's states
    here are dicts of ints; they pass through a JSON round trip (a copy, and proof that they
    serialize), and the ``pipeline`` entry describes what the stream was built from, so
    ``set_state`` refuses a state from a different pipeline instead of resuming wrongly. The state
    counts global batches: it is the same on every process.
    """

    def __init__(self, dataset: grain.IterDataset, pipeline: dict[str, Any]):
        self._pipeline = pipeline
        self._iterator = iter(dataset)

    def __iter__(self) -> TrainIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._iterator)

    def get_state(self) -> dict[str, Any]:
        return json.loads(
            json.dumps({"pipeline": self._pipeline, "grain": self._iterator.get_state()})
        )

    def set_state(self, state: dict[str, Any]) -> None:
        saved = state.get("pipeline") if isinstance(state, dict) else None
        if saved != self._pipeline or "grain" not in state:
            raise ValueError(
                f"the data iterator state was saved by another pipeline ({saved}); "
                f"this one is {self._pipeline}"
            )
        self._iterator.set_state(state["grain"])


@dataclasses.dataclass(frozen=True)
class Data:
    """What :func:`build_data` returns.

    Attributes:
      tokenizer: the tokenizer all batches were made with.
      train: this process's training batches (:class:`TrainIterator`).
      eval_examples: all validation records (every process sees all), for generation scores.
      labels: the class names of a ``classify`` task, else None.
      eval_dataset: the Grain dataset behind :meth:`eval_batches`.
    """

    tokenizer: Tokenizer
    train: TrainIterator
    eval_examples: Sequence[dict[str, Any]]
    labels: tuple[str, ...] | None
    eval_dataset: grain.MapDataset = dataclasses.field(repr=False)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def eval_batches(self) -> Iterator[dict[str, np.ndarray]]:
        """A fresh pass over the validation split: ``ceil(N / batch_size)`` global batches in
        record order, never packed; the last is filled up with padding rows (weights 0, masks
        False) so every batch has one shape and every example counts once."""
        return iter(self.eval_dataset.to_iter_dataset(_READ_OPTIONS))


def build_data(
    cfg: DataConfig,
    *,
    task: str,
    seed: int,
    batch_size: int,
    directory: Path,
    process_index: int = 0,
    process_count: int = 1,
    save_tokenizer: bool | None = None,
    tokenizer: Tokenizer | None = None,
) -> Data:
    """Reads the data ``cfg`` names, prepares its tokenizer and builds the train/eval pipelines.

    Args:
      cfg: the data config.
      task: ``lm``, ``seq2seq``, ``mlm`` or ``classify`` (``train.step.task_of``).
      seed: shuffles the training stream (and, with it, the synthetic data and MLM masking).
      batch_size: the global batch size; each process gets ``batch_size // process_count`` rows.
      directory: where the tokenizer is saved. A tokenizer already saved there is loaded
        instead of fitted again, so a resumed run sees the same ids. Nothing else is written.
      process_index, process_count: which of ``process_count`` equal blocks of rows of each
        global batch this process loads (processes that feed the same devices' rows share one).
      save_tokenizer: whether this process writes the tokenizer (default: ``process_index ==
        0``); exactly one process of those sharing a file system should.
      tokenizer: use this tokenizer (e.g. a Hugging Face checkpoint's, with its own ids) instead
        of the one ``cfg.tokenizer`` names; it is saved in ``directory`` like a fitted one.

    Raises:
      ValueError: the source does not fit ``task``, an unusable batch size or process, a saved
        tokenizer of another kind, or bad data (the message names the file).
      FileNotFoundError: a missing data or tokenizer file.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    if batch_size < 1 or batch_size % process_count:
        raise ValueError(
            f"the global batch size {batch_size} must be a positive multiple of the process "
            f"count {process_count}"
        )
    if cfg.packing and task != "lm":
        raise ValueError(f"data.packing=true applies to task 'lm' only, not {task!r}")
    packing = task == "lm" if cfg.packing is None else cfg.packing
    _check_fits(cfg, task)
    train_records, eval_records, labels = _load_records(cfg, seed)
    save = process_index == 0 if save_tokenizer is None else save_tokenizer
    tokenizer = _tokenizer(cfg, train_records, Path(directory), save=save, given=tokenizer)

    shard, local_size = (process_index, process_count), batch_size // process_count
    featurize_example = functools.partial(
        featurize,
        task=task,
        tokenizer=tokenizer,
        seq_len=cfg.seq_len,
        mlm_probability=cfg.mlm_probability,
        seed=seed,
    )
    stream = (
        grain.MapDataset.source(train_records)
        .shuffle(seed=seed)
        .repeat()
        .map_with_index(functools.partial(featurize_example, stream=_TRAIN_STREAM))
    )
    if packing:
        rows = slice(process_index * local_size, (process_index + 1) * local_size)
        train = _packed(stream, cfg.seq_len, batch_size, rows)
    else:
        train = stream.map(functools.partial(pad, seq_len=cfg.seq_len))
        train = train.batch(local_size)[process_index::process_count]
        train = train.to_iter_dataset(_READ_OPTIONS)
    pipeline = dict(task=task, packing=packing, seq_len=cfg.seq_len, seed=seed)
    pipeline.update(batch_size=batch_size, train_examples=len(train_records))
    eval_featurize = functools.partial(featurize_example, stream=_EVAL_STREAM)
    return Data(
        tokenizer=tokenizer,
        train=TrainIterator(train, pipeline),
        eval_examples=eval_records,
        labels=labels if task == "classify" else None,
        eval_dataset=_eval_dataset(eval_records, eval_featurize, cfg.seq_len, batch_size, shard),
    )


def _check_fits(cfg: DataConfig, task: str) -> None:
    if cfg.source == "synthetic":
        kind = synthetic.TASKS[cfg.task].kind
        given = f"data.task={cfg.task!r} ({kind} examples)"
    else:
        kind = "seq2seq" if cfg.source == "parallel" else "lm"
        given = f"data.source={cfg.source!r}"
    kinds, needs = _NEEDS[task]
    if kind not in kinds:
        raise ValueError(f"task {task!r} cannot train on {given}: it needs {needs}")


def _load_records(cfg: DataConfig, seed: int):
    """``(train records, validation records, class names or None)``."""
    if cfg.source == "synthetic":
        train = synthetic.make_task(cfg.task, split="train", seed=seed, size=cfg.train_size)
        valid = synthetic.make_task(cfg.task, split="validation", seed=seed, size=cfg.eval_size)
        return train, valid, getattr(train, "labels", None)
    if cfg.source == "text":
        records = sources.text_records(cfg.path)
    elif cfg.source == "jsonl":
        records = sources.jsonl_records(cfg.path, cfg.field)
    else:
        records = sources.parallel_records(cfg.path)
    train, valid = sources.split_records(records, cfg.validation_fraction, cfg.path)
    return train[: cfg.train_size], valid[: cfg.eval_size], None


def _tokenizer(
    cfg: DataConfig, records: Sequence[dict], directory: Path, save: bool, given: Tokenizer | None
) -> Tokenizer:
    """The tokenizer saved in ``directory``, or ``given``, or a new one (fitted if need be), saved
    there if ``save``. Only process 0 saves, so processes sharing a file system never write the
    same files at once; fitting is deterministic, so the others fit the same tokenizer."""
    kind = cfg.tokenizer if given is None else given.kind
    if (directory / tokenizers.KIND_FILE).is_file():
        tokenizer = tokenizers.load_tokenizer(directory)
        if tokenizer.kind != kind:
            wanted = f"data.tokenizer={kind!r}" if given is None else f"a {kind!r} tokenizer"
            raise ValueError(
                f"{directory}: holds a saved {tokenizer.kind!r} tokenizer, but "
                f"this run uses {wanted}"
            )
        if given is not None and not tokenizer.same_as(given):
            raise ValueError(
                f"{directory}: holds another checkpoint's tokenizer than the one "
                "this run starts from (init_from)"
            )
        return tokenizer
    if given is not None:
        if save:
            given.save(directory)
        return given
    if not isinstance(records, list):  # a synthetic task: its first FIT_EXAMPLES examples
        records = [records[i] for i in range(min(len(records), FIT_EXAMPLES))]
    texts = (r[key] for r in records for key in ("text", "source", "target") if key in r)
    tokenizer = tokenizers.make_tokenizer(
        cfg.tokenizer, texts=texts, vocab_size=cfg.vocab_size, path=cfg.tokenizer_path
    )
    if save:
        tokenizer.save(directory)
    return tokenizer


def _packed(
    stream: grain.MapDataset, seq_len: int, batch_size: int, rows: slice
) -> grain.IterDataset:
    """Grain's first-fit packing with one bin per row of the global batch.

    Examples fill the first of ``batch_size`` rows with room, in stream order; the first
    example that fits no row closes the batch and opens the next one. Every process packs the
    whole stream (so all agree on the rows) and keeps its own rows.
    """
    packed = FirstFitPackIterDataset(
        stream.to_iter_dataset(_READ_OPTIONS),
        length_struct=dict.fromkeys(("inputs", "targets", "weights"), seq_len),
        num_packing_bins=batch_size,
        shuffle_bins=False,
        meta_features=("targets", "weights"),  # packed like inputs, without ids of their own
    )
    return packed.batch(batch_size).map(
        lambda batch: {
            "inputs": batch["inputs"][rows],
            "targets": batch["targets"][rows],
            "weights": batch["weights"][rows],
            "segment_ids": batch["inputs_segment_ids"][rows],
            "positions": batch["inputs_positions"][rows],
        }
    )


def _eval_dataset(
    records: Sequence[dict], featurize: Callable, seq_len: int, batch_size: int, shard: tuple
) -> grain.MapDataset:
    """The validation records in order, padded with empty examples to whole global batches."""
    count = len(records)
    empty = {k: np.zeros_like(v) for k, v in pad(featurize(0, records[0]), seq_len).items()}

    def example(index: int) -> dict[str, np.ndarray]:
        return pad(featurize(index, records[index]), seq_len) if index < count else empty

    total = -(-count // batch_size) * batch_size
    process_index, process_count = shard
    local = grain.MapDataset.range(total).map(example).batch(batch_size // process_count)
    return local[process_index::process_count]


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"data.{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"data.{name} must be an int >= {low}, got {value!r}")
