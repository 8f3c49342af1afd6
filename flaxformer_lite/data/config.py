"""The ``data`` section of a run's config: where the data come from and how they become
batches (:func:`flaxformer_lite.data.pipeline.build_data` reads it)."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from flaxformer_lite.data import readers
from flaxformer_lite.data.sources import SOURCES, Source, names_of, source_of, spelled
from flaxformer_lite.data.tokenizers import NUM_SPECIAL, TOKENIZERS
from flaxformer_lite.settings import setting

LM_ROWS = ("documents", "windows")
# Rows of a mixture's block (data/mixture.py): each source has a whole number of them, so the
# smallest share a weight can give is one row in this many.
BLOCK_ROWS = 1024
METRIC_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # a name that is part of a metric key


@dataclasses.dataclass(frozen=True)
class MixtureSource:
    """One named source of a weighted mixture (``data.mixture.<name>``): files of its own
    source (default ``data.source``), their share of the training rows, their own validation
    data."""

    path: str = setting(
        "", help="the source's files, as data.path names them (a glob, a TSV file, a store)"
    )
    source: str | None = setting(
        None,
        help=f"its kind: {spelled(names_of(lambda source: source.made_by_run))} (beside one "
        "another), prepared (beside stores); null: data.source",
    )
    field: str | None = setting(None, help="a jsonl source's text field; null: data.field")
    text_documents: str | None = setting(
        None, help="a text source's documents (file, paragraphs, lines); null: data.text_documents"
    )
    weight: float = setting(1.0, help="the source's share of training rows, relative to the others")
    validation_path: str | None = setting(
        None,
        help="the source's validation data, used whole; null: hold out data.validation_fraction",
    )

    def __post_init__(self):
        if not self.path:
            raise ValueError("path is required: the source's files")
        weight = self.weight
        number = isinstance(weight, float | int) and not isinstance(weight, bool)
        if not (number and math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight must be a positive number, got {self.weight!r}")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the data comes from and how it becomes batches; each field's help is beside it.
    A ``generator``'s options are the fields of its class in :mod:`~flaxformer_lite.data.synthetic`.
    """

    source: str = setting(
        "synthetic",
        help=f"{spelled(names_of())} (synthetic: made by data.generator; prepared: a store)",
    )
    generator: str = setting(
        "arithmetic",
        help="the synthetic data: arithmetic, reverse, number_words or sentiment (old name: "
        "data.task)",
    )
    generator_options: dict[str, int | bool] = setting(
        factory=dict, help="the generator's options, e.g. {max_digits: 4}; {}: its defaults"
    )
    path: str | None = setting(
        None,
        help="a glob of text (or builtin:tinyshakespeare) or jsonl files, a TSV file or "
        "src_file,tgt_file (parallel), or a prepared store",
    )
    field: str = setting("text", help="the JSONL field that holds the text")
    text_documents: str | None = setting(
        None,
        help="a text file's documents: file (whole, line breaks kept), paragraphs (runs of "
        "non-blank lines) or lines; null: file, or a prepared store's own",
    )
    validation_path: str | None = setting(
        None,
        help="validation data of data.path's source, used whole; null: hold out "
        "data.validation_fraction",
    )
    mixture: dict[str, MixtureSource] = setting(
        factory=dict,
        help="named sources with weights, in place of data.path: {name: {path: ..., weight: 3, "
        "validation_path: ..., source: jsonl}}; each batch's rows drawn by weight, each source "
        "evaluated on its own (eval_loss/<name>); {}: data.path alone",
    )
    tokenizer: str | None = setting(
        None,
        help="byte; char, word or bpe fitted on the data; or sentencepiece; null: byte, or a "
        "prepared store's own (set, it must be the store's)",
    )
    tokenizer_path: str | None = setting(None, help="a SentencePiece .model file")
    vocab_size: int | None = setting(
        None, help="the BPE vocabulary size (required for bpe, >= 260), or a cap on word's"
    )
    seq_len: int = setting(
        64,
        help="tokens per row of every [B, seq_len] batch; a longer lm document goes on in the next "
        "row, a longer example of another task is cut (the run says how much)",
    )
    packing: bool | None = setting(
        None, help="pack several documents into each row (LM); null: pack LM, pad others"
    )
    lm_rows: str = setting(
        "documents",
        help="lm rows: documents (in pieces of at most seq_len, packed next-fit) or windows (all "
        "documents end to end, cut into rows)",
    )
    validation_fraction: float = setting(
        0.1,
        help="share held out for validation: of the documents, or each whole file's tail "
        "(synthetic data have their own split)",
    )
    mlm_probability: float = setting(0.15, help="share of an MLM example's tokens to predict")
    train_size: int | None = setting(
        None, help="at most this many training examples; null: all (synthetic: 1,000,000)"
    )
    eval_size: int | None = setting(
        None, help="at most this many validation examples; null: all (synthetic: 1,000)"
    )
    _derived: ClassVar[frozenset[str]] = frozenset()  # the settings left unset, then resolved

    def __post_init__(self):
        _check_choice("source", self.source, tuple(SOURCES))
        _check_choice("lm_rows", self.lm_rows, LM_ROWS)
        if self.text_documents is not None:
            _check_choice("text_documents", self.text_documents, readers.TEXT_DOCUMENTS)
        source = self.reader
        # Unset means byte but for a source that brings its own (a store): resolved here, so the
        # configs and records of other sources say byte, as they did before the setting could be
        # unset. That it was unset is kept (not a field) for to_dict.
        if self.tokenizer is None:
            object.__setattr__(self, "_derived", frozenset({"tokenizer"}))
        if self.tokenizer is None and not source.brings_tokenizer:
            object.__setattr__(self, "tokenizer", "byte")
        if self.tokenizer is not None:
            _check_choice("tokenizer", self.tokenizer, TOKENIZERS)
        made = not source.brings_tokenizer  # else its tokenizer is made already
        if made and self.tokenizer == "sentencepiece" and not self.tokenizer_path:
            raise ValueError("data.tokenizer='sentencepiece' needs data.tokenizer_path")
        if made and self.tokenizer == "bpe" and self.vocab_size is None:
            raise ValueError("data.tokenizer='bpe' needs data.vocab_size")
        _check_int("seq_len", self.seq_len, 4)
        min_vocab = NUM_SPECIAL + (256 if self.tokenizer == "bpe" else 1)
        for name, low in (("vocab_size", min_vocab), ("train_size", 1), ("eval_size", 1)):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low)
        source.check(self)
        if self.mixture:
            self._check_mixture()
        if self.packing is not None and not isinstance(self.packing, bool):
            raise ValueError(f"data.packing must be a bool or None, got {self.packing!r}")
        if self.lm_rows == "windows" and self.packing is False:
            raise ValueError(
                "data.lm_rows='windows' packs documents into rows: it needs data.packing true "
                "or null"
            )
        if not 0 < self.validation_fraction < 1:
            raise ValueError(
                f"data.validation_fraction must be in (0, 1), got {self.validation_fraction!r}"
            )
        if not 0 < self.mlm_probability <= 1:
            raise ValueError(f"data.mlm_probability must be in (0, 1], got {self.mlm_probability}")

    def _check_mixture(self) -> None:
        if self.path is not None or self.validation_path is not None:
            raise ValueError(
                "data.mixture names the training data: leave data.path and data.validation_path "
                "unset (each source has its own path and validation_path)"
            )
        weights = [entry.weight for entry in self.mixture.values()]
        shares = dict(zip(self.mixture, weight_shares(weights), strict=True))
        records = {}
        for name, entry in self.mixture.items():
            kind = entry.source or self.source
            _check_choice(f"mixture.{name}.source", kind, names_of(lambda source: source.stored))
            # One tokenizer reads every part: a store's own, or one made for the files.
            if SOURCES[kind].brings_tokenizer != self.reader.brings_tokenizer:
                files = names_of(lambda source: source.made_by_run)
                raise ValueError(
                    f"data.mixture.{name}.source={kind}: the parts of a mixture share one "
                    "tokenizer, so stores (prepared, which bring theirs) mix with stores under "
                    f"data.source=prepared, and {spelled(files, 'and')} sources with one another"
                )
            records[name] = SOURCES[kind].record_type
            if not METRIC_NAME.fullmatch(name):
                raise ValueError(
                    f"data.mixture.{name}: a source's name is letters, digits, '_', '-' and '.' "
                    "(it names its metrics, eval_loss/<name>)"
                )
            if shares[name] < 1 / BLOCK_ROWS:
                raise ValueError(
                    f"data.mixture.{name}.weight={entry.weight}: a share of "
                    f"{shares[name]:.2g} of the rows is under the least one, 1/{BLOCK_ROWS}"
                )
        for name, part in self._parts().items():  # each part's own settings, checked now
            try:
                part()
            except ValueError as error:
                raise ValueError(f"data.mixture.{name}: {error}") from None
        kinds = {record for record in records.values() if record is not None}
        if len(kinds) > 1:
            described = ", ".join(f"{name} {record}" for name, record in records.items())
            raise ValueError(
                f"data.mixture: its parts' examples differ ({described} records): a mixture's "
                "parts make one kind of example"
            )

    @functools.cached_property
    def reader(self) -> Source:
        """The source ``source`` names, with these reading settings: resolved once, asked
        (``stored``, ``brings_tokenizer``, ``files``, ...) wherever the run needs it."""
        return source_of(self)

    @property
    def documents(self) -> str:
        """How a text file becomes documents: ``text_documents``, or a whole file by default."""
        return self.text_documents or readers.DEFAULT_DOCUMENTS

    def paths(self) -> dict[str, tuple[DataConfig, str]]:
        """The settings that name files or stores, by key: the path each names and the settings
        of the source that reads it (:meth:`parts`): ``data.path`` and
        ``data.validation_path``, or every mixture source's."""
        named = {}
        for name, part in self.parts().items():
            prefix = f"data.mixture.{name}." if name else "data."
            for key in ("path", "validation_path"):
                if getattr(part, key) is not None:
                    named[prefix + key] = part, getattr(part, key)
        return named

    def parts(self) -> dict[str, DataConfig]:
        """The run's sources by name, each as the settings of a run of it alone: a mixture's
        (:meth:`mixture_sources`), or one source as a mixture of one, named ``""``."""
        return self.mixture_sources() if self.mixture else {"": self}

    def mixture_sources(self) -> dict[str, DataConfig]:
        """Each mixture source's settings by name: these settings with the source's kind, path
        and validation path, as a run of that source alone would have them."""
        return {name: part() for name, part in self._parts().items()}

    def _parts(self) -> dict[str, Callable[[], DataConfig]]:
        """What makes each mixture source's settings (:meth:`mixture_sources`), unmade."""
        parts = {}
        for name, entry in self.mixture.items():
            kind = entry.source or self.source
            reads_documents = kind in SOURCES and SOURCES[kind].reads_documents
            # The section's documents are a text source's; a part's own are checked as its.
            documents = entry.text_documents or (self.text_documents if reads_documents else None)
            parts[name] = functools.partial(
                dataclasses.replace,
                self,
                source=kind,
                field=entry.field or self.field,
                text_documents=documents,
                path=entry.path,
                validation_path=entry.validation_path,
                mixture={},
            )
        return parts

    def to_dict(self, *, derived: bool = True) -> dict[str, Any]:
        """Plain values. ``derived=False`` gives None for a setting left unset (``tokenizer``):
        values laid over that dict (a partial ``data`` section, ``data.source=prepared``)
        resolve it anew."""
        values = dataclasses.asdict(self)
        if not derived:
            values.update(dict.fromkeys(self._derived))
        return values


def settled_parts(values: dict[str, Any]) -> dict[str, Any]:
    """A data section as plain values with each mixture source's unset kind, field and
    documents read as the section's, as :meth:`DataConfig.mixture_sources` reads them: two
    sections that say the same parts in other words compare equal (an older record, without
    those keys, too)."""
    mixture = {}
    for name, entry in (values.get("mixture") or {}).items():
        kind = entry.get("source") or values.get("source")
        reads_documents = kind in SOURCES and SOURCES[kind].reads_documents
        documents = entry.get("text_documents") or values.get("text_documents")
        mixture[name] = {
            **entry,
            "source": kind,
            "field": entry.get("field") or values.get("field"),
            "text_documents": documents if reads_documents else None,
        }
    return {**values, "mixture": mixture} if mixture else values


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"data.{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"data.{name} must be an int >= {low}, got {value!r}")


def weight_shares(weights) -> np.ndarray:
    """float64 ``[S]``: each weight's share of their sum; where the sum overflows (weights near
    the float's largest), the shares of the weights divided by the largest."""
    weights = np.asarray(weights, np.float64)
    with np.errstate(over="ignore"):
        total = np.sum(weights)
    if not np.isfinite(total):
        weights = weights / weights.max()
        total = np.sum(weights)
    return weights / total
