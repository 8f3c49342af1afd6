"""Sources: the classes of the ``data.source`` setting's values, one each behind one protocol
(:class:`Source`), found by that value in :data:`SOURCES`:

    source = cfg.reader                      # cfg.source's class, with cfg's reading settings
    source.files("corpus/*.txt")             # what the run reads, for the fingerprint and checks
    source.store_at("corpus/*.txt", run.prepared)   # where its store is (the run's cache)

A source says what a run needs of it: the settings it takes (:meth:`Source.check`), the files a
path names (:meth:`Source.files`), the records it yields and their type (:meth:`Source.records`,
:attr:`Source.record_type`), and how it is prepared: read into a token store in the run's cache
(:class:`FileSource`), opened as the store it is (:class:`PreparedSource`), or made in memory
(:class:`SyntheticSource`). The machinery that prepares and reads stores
(:mod:`~flaxformer_lite.data.store`, :mod:`~flaxformer_lite.data.run_stores`) asks the source
and never its name, so a new source is one class, registered with :func:`register`, and its
tests.

The built-in sources live in this one module: each is a few lines over its base, and the readers
they call stay in :mod:`~flaxformer_lite.data.readers`. A bundled text (``builtin:NAME``) is not
a source: it is a text file found inside the package (:func:`~flaxformer_lite.data.readers
.expand_files`), read, fingerprinted and prepared as any text file, so ``data.path`` names it.
"""

from __future__ import annotations

import abc
import hashlib
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from flaxformer_lite.data import generator, readers, synthetic
from flaxformer_lite.data.documents import PAIR_RECORDS, TEXT_RECORDS
from flaxformer_lite.registry import Registry

if TYPE_CHECKING:  # the settings are read, never built, here
    from flaxformer_lite.data.config import DataConfig


class Source:
    """A source: ``data.source={name}``.

    Attributes:
      name: the ``data.source`` value that names it.
      record_type: the type of records it yields (:data:`~flaxformer_lite.data.documents
        .TEXT_RECORDS`, ``PAIR_RECORDS`` or ``LABELLED_RECORDS``); None: each store's source
        says.
      fields: the text fields of its records (``text``, or ``source`` and ``target``).
      stored: whether its data are read through a token store (else made in memory).
      made_by_run: whether a run prepares that store from files (else it is given, made).
      brings_tokenizer: whether its data come with their tokenizer (a store's).
      reads_documents: whether ``data.text_documents`` says how its files become documents.
      unrecorded: the settings a record of a run's inputs made before they existed lacks, with
        the values that record stood for.
      field, documents: the JSONL field and the text documents the settings name.
    """

    name: ClassVar[str]
    record_type: ClassVar[str | None] = TEXT_RECORDS
    fields: ClassVar[tuple[str, ...]] = ("text",)
    stored: ClassVar[bool] = True
    made_by_run: ClassVar[bool] = False
    brings_tokenizer: ClassVar[bool] = False
    reads_documents: ClassVar[bool] = False
    unrecorded: ClassVar[dict[str, Any]] = {}

    def __init__(self, field: str = "text", documents: str = readers.DEFAULT_DOCUMENTS):
        self.field, self.documents = field, documents

    def check(self, cfg: DataConfig) -> None:
        """Refuses the settings this source cannot take, in one line naming the setting."""
        if cfg.text_documents is not None and not self.reads_documents:
            readers = spelled(names_of(lambda source: source.reads_documents))
            raise ValueError(
                "data.text_documents says how text files become documents: it needs "
                f"data.source {readers}, not {self.name!r}"
            )
        if self.stored and not cfg.mixture and not cfg.path:
            raise ValueError(f"data.path is required with data.source={self.name!r}")

    def files(self, path: str) -> list[Path]:
        """The files ``path`` names that the run reads, in reading order (none: made from the
        settings, or a store, which its manifest vouches for).

        Raises:
          FileNotFoundError, ValueError: as :func:`~flaxformer_lite.data.readers.expand_files`.
        """
        return []

    def record_type_of(self, cfg: DataConfig) -> str | None:
        """The records the source of ``cfg`` yields (:attr:`record_type`, or its generator's);
        None: its store's manifest says."""
        return self.record_type

    def described(self, cfg: DataConfig) -> str:
        """The source in the words of its settings, for a message."""
        return f"data.source={self.name!r}"

    def store_at(self, path: str, prepared: Path | None) -> Path | None:
        """The store the data of ``path`` are read from (it may not be made yet); None if the
        source has none."""
        return None

    def identity(self, path: str) -> dict[str, Any]:
        """What a store's manifest records of the source it was made from, but its files."""
        # "kind" names the source: the manifest's key since the first stores, kept so they open.
        return {"kind": self.name, "path": path, "field": None, "documents": None}

    @classmethod
    def documents_of(cls, made_from: dict[str, Any]) -> str | None:
        """How the files a store's manifest names (``made_from``, its ``source``) became
        documents; None where the source has one document per record."""
        return None

    @classmethod
    def settled(cls, key: str, value: Any) -> Any:
        """What ``data.<key>=value`` stands for with this source (an unset setting: its default)."""
        return value

    @classmethod
    def same_setting(cls, key: str, before: Any, now: Any) -> bool:
        """Whether ``data.<key>`` set to ``before``, then ``now``, gives the same data from a
        source of this class."""
        return cls.settled(key, before) == cls.settled(key, now)


class FileSource(Source, abc.ABC):
    """Files read into records, prepared into a store of the run's cache on first use: one per
    source, ``<prepared>/<name>-<hash of name, path, field and documents>``."""

    made_by_run = True

    @property
    def whole_files(self) -> bool:
        """Whether each file is one document (its validation part is then the file's tail)."""
        return False

    def files(self, path: str) -> list[Path]:
        return readers.expand_files(path)

    @abc.abstractmethod
    def records(self, files: Sequence[Path], on_read: readers.OnRead | None = None) -> Iterator:
        """The records (dicts of :attr:`fields` to strings) of ``files`` (:meth:`files`), each
        chunk of bytes read handed to ``on_read``."""

    def store_at(self, path: str, prepared: Path | None) -> Path:
        if prepared is None:
            raise ValueError(f"data.source={self.name} needs a directory to prepare its store in")
        identity = self.identity(path)
        key = json.dumps([self.name, path, identity["field"], identity["documents"]])
        return prepared / f"{self.name}-{hashlib.blake2b(key.encode(), digest_size=6).hexdigest()}"


class TextSource(FileSource):
    """Text files (a path or glob, or ``builtin:NAME``), made into documents as
    ``data.text_documents`` says."""

    name = "text"
    reads_documents = True
    unrecorded = {"text_documents": "lines"}  # a document per line, before the setting

    @property
    def whole_files(self) -> bool:
        return self.documents == readers.DEFAULT_DOCUMENTS

    def records(self, files, on_read=None):
        return readers.iter_text_records(files, self.documents, on_read)

    def identity(self, path: str) -> dict[str, Any]:
        return {**super().identity(path), "documents": self.documents}

    @classmethod
    def documents_of(cls, made_from: dict[str, Any]) -> str | None:
        # Stores made before the setting existed made a document of each line.
        return made_from.get("documents", "lines")

    @classmethod
    def settled(cls, key: str, value: Any) -> Any:
        if key == "text_documents" and value is None:  # unset, a text file is one document
            return readers.DEFAULT_DOCUMENTS
        return value


class JsonlSource(FileSource):
    """JSONL files, the text in ``data.field`` of each line's object."""

    name = "jsonl"

    def records(self, files, on_read=None):
        return readers.iter_jsonl_records(files, self.field, on_read)

    def identity(self, path: str) -> dict[str, Any]:
        return {**super().identity(path), "field": self.field}


class ParallelSource(FileSource):
    """Source/target pairs: a TSV file, or ``src_file,tgt_file`` aligned by line."""

    name = "parallel"
    record_type = PAIR_RECORDS
    fields = ("source", "target")

    def files(self, path: str) -> list[Path]:
        parts = path.split(",")
        if len(parts) > 2:
            raise ValueError(f"{path}: expected a TSV file or 'src_file,tgt_file'")
        return [readers.expand_files(part.strip())[0] for part in parts]

    def records(self, files, on_read=None):
        return readers.iter_parallel_records(files, on_read)


class PreparedSource(Source):
    """A token store made ahead (``flaxformer-lite prepare``), read as it is, with its own
    tokenizer and documents."""

    name = "prepared"
    record_type = None  # checked against the store's manifest once it is open
    brings_tokenizer = True
    reads_documents = True

    def store_at(self, path: str, prepared: Path | None) -> Path:
        return Path(path)

    @classmethod
    def same_setting(cls, key: str, before: Any, now: Any) -> bool:
        if key == "tokenizer" and now is None:  # whatever was set, the store's own is used
            return True
        return super().same_setting(key, before, now)


class SyntheticSource(Source):
    """Examples made in memory by ``data.generator`` from the seed."""

    name = "synthetic"
    stored = False

    def check(self, cfg: DataConfig) -> None:
        if cfg.mixture:
            stored = spelled(names_of(lambda source: source.stored))
            raise ValueError(f"data.mixture mixes files: it needs data.source {stored}")
        if cfg.generator not in synthetic.GENERATORS:
            names = ", ".join(synthetic.GENERATORS)
            raise ValueError(f"data.generator must be one of {names}; got {cfg.generator!r}")
        try:
            synthetic.make_generator(cfg.generator, size=1, **cfg.generator_options)
        except ValueError as error:
            raise ValueError(f"data.generator_options: {error}") from None
        if cfg.validation_path is not None:
            raise ValueError(
                "data.validation_path needs a file source: synthetic generators have "
                "their own validation split"
            )
        super().check(cfg)
        for name in ("train_size", "eval_size"):
            size = getattr(cfg, name)
            if size is not None and size > generator.MAX_SIZE:
                raise ValueError(
                    f"data.{name} must be at most {generator.MAX_SIZE:,} for a synthetic "
                    f"generator (its examples are made in memory at start-up), got {size}"
                )

    def record_type_of(self, cfg: DataConfig) -> str:
        return synthetic.GENERATORS[cfg.generator].records

    def described(self, cfg: DataConfig) -> str:
        return f"data.generator={cfg.generator!r} ({self.record_type_of(cfg)} examples)"

    def examples(self, cfg: DataConfig, split: str, seed: int) -> generator.Generator:
        """The generator's ``split`` (``train`` or ``validation``) for ``seed``."""
        size = cfg.train_size if split == "train" else cfg.eval_size
        options = cfg.generator_options
        return synthetic.make_generator(cfg.generator, split=split, seed=seed, size=size, **options)


SOURCES = Registry(
    "data.source",
    "a Source subclass",
    {
        source.name: source
        for source in (SyntheticSource, TextSource, JsonlSource, ParallelSource, PreparedSource)
    },
    imports=False,
)


def register(source: type[Source]) -> type[Source]:
    """Adds ``source`` to :data:`SOURCES` under its name (a decorator)."""
    SOURCES.register(source.name, source)
    return source


def names_of(having: Callable[[type[Source]], bool] = lambda source: True) -> tuple[str, ...]:
    """The names of the sources ``having`` is true of, in registration order."""
    return tuple(name for name, source in SOURCES.items() if having(source))


def spelled(names: Sequence[str], last: str = "or") -> str:
    """``text, jsonl or parallel``: ``names`` as a sentence says them."""
    return f"{', '.join(names[:-1])} {last} {names[-1]}" if len(names) > 1 else "".join(names)


def source_of(cfg: DataConfig) -> Source:
    """The source ``data.source`` names, with ``cfg``'s reading settings."""
    return source_named(cfg.source, field=cfg.field, documents=cfg.documents)


def source_named(
    name: str, field: str = "text", documents: str = readers.DEFAULT_DOCUMENTS
) -> Source:
    """The source named ``name`` (a setting's value, or a store manifest's ``source.kind``).

    Raises:
      ValueError: no such source.
    """
    if name not in SOURCES:
        raise ValueError(f"unknown source {name!r}; valid sources: {', '.join(SOURCES)}")
    readers.check_text_documents(documents)
    return SOURCES[name](field, documents)


def source_of_store(made_from: dict[str, Any]) -> Source:
    """The source that made a store, with the reading settings its manifest's ``source``
    (``made_from``) records.

    Raises:
      ValueError: a source this version does not know.
    """
    source = type(source_named(made_from["kind"]))
    return source(
        made_from.get("field") or "text",
        source.documents_of(made_from) or readers.DEFAULT_DOCUMENTS,
    )
