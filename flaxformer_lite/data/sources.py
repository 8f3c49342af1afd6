"""Readers of local training data: text files, JSONL fields and parallel (translation) text.

Records are dicts of strings, in the shapes the synthetic tasks use: ``{"text": ...}`` for text
and JSONL files, ``{"source": ..., "target": ...}`` for parallel text. Each kind has a streaming
reader, ``iter_text_records``, ``iter_jsonl_records`` and ``iter_parallel_records`` (or
:func:`iter_records` by name), which reads the files in bounded chunks and yields one record at a
time, so a corpus larger than memory can be tokenized (:mod:`flaxformer_lite.data.store`). The
readers take the files :func:`source_files` resolved from a path or glob (sorted path order, so
the same files always give the same records): a caller that records the files it read (a store's
manifest) reads exactly those, even if the glob matches more files later.

One record per non-blank line (a line holding only whitespace is skipped; other lines are kept
as they are, minus the line break). Line-per-record is the layout of lm1b and of most parallel
corpora; documents longer than the pipeline's ``seq_len`` would be truncated anyway.

Problems raise naming the file (and line) and the reason: ``FileNotFoundError`` for a missing path
or a glob that matches no file, ``ValueError`` for an empty file, bytes that are not UTF-8, a
malformed JSONL line or a missing field, and parallel files of different lengths. The readers
raise when they reach the problem (an empty file or misaligned parallel files: at the end of the
file).
"""

from __future__ import annotations

import glob
import itertools
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

_GLOB_CHARS = frozenset("*?[")
# Bytes read at a time: what a streaming reader holds, with the longest line.
CHUNK_BYTES = 1 << 20
SOURCES = ("text", "jsonl", "parallel")

OnRead = Callable[[Path, bytes], None]
"""Called with each chunk of raw bytes as it is read from a file (e.g. to hash it)."""


def expand_files(pattern: str) -> list[Path]:
    """The files a path or glob (``**`` recurses) names, sorted; directories are left out.

    Raises:
      FileNotFoundError: a plain path that is not a file, or a glob that matches no file.
    """
    if not _GLOB_CHARS & set(pattern):
        path = Path(pattern)
        if not path.is_file():
            reason = "is a directory, not a file" if path.is_dir() else "file not found"
            raise FileNotFoundError(f"{path}: {reason}")
        return [path]
    paths = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not paths:
        raise FileNotFoundError(f"{pattern}: no file matches this pattern")
    return paths


def source_files(source: str, path: str) -> list[Path]:
    """The files the ``source`` reader (``text``, ``jsonl`` or ``parallel``) reads for ``path``,
    in reading order.

    Raises:
      ValueError: an unknown ``source`` or a malformed parallel ``path``.
      FileNotFoundError: as :func:`expand_files`.
    """
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}; valid sources: {', '.join(SOURCES)}")
    return _parallel_files(path) if source == "parallel" else expand_files(path)


def iter_lines(path: Path, on_read: OnRead | None = None) -> Iterator[str]:
    """The lines of a UTF-8 file without their line breaks (``\\n`` or ``\\r\\n``), read in
    chunks of :data:`CHUNK_BYTES`.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: the file is not valid UTF-8 (the message gives the line and byte offset of the
        first bad byte), or, at its end, it was empty (or only whitespace).
    """
    path = Path(path)
    try:
        file = path.open("rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: file not found") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from None
    with file:
        offset, number, blank = 0, 0, True  # offset and line number of the next complete part
        pending: list[bytes] = []  # the start of a line whose break is not read yet
        while True:
            try:
                data = file.read(CHUNK_BYTES)
            except OSError as e:
                raise ValueError(f"{path}: cannot read ({e.strerror})") from None
            if data and on_read is not None:
                on_read(path, data)
            cut = data.rfind(b"\n") + 1
            if data and not cut:
                pending.append(data)
                continue
            part = b"".join([*pending, data[:cut]]) if data else b"".join(pending)
            pending = [data[cut:]] if data else []
            if not part:
                break
            text = _decode(part, path, offset, number)
            blank = blank and not text.strip()
            lines = text.split("\n")
            if data:  # the part ends with a line break, which ends its last line
                lines.pop()
            if "\r" in text:
                lines = [line.removesuffix("\r") for line in lines]
            offset, number = offset + len(part), number + len(lines)
            yield from lines
            if not data:
                break
    if blank:
        raise ValueError(f"{path}: empty file (no non-blank line)")


def iter_text_records(
    files: Sequence[Path], on_read: OnRead | None = None
) -> Iterator[dict[str, str]]:
    """``{"text": line}`` for every non-blank line of ``files``."""
    for path in files:
        for line in iter_lines(path, on_read):
            if line.strip():
                yield {"text": line}


def iter_jsonl_records(
    files: Sequence[Path], field: str = "text", on_read: OnRead | None = None
) -> Iterator[dict[str, str]]:
    """``{"text": obj[field]}`` for every non-blank line (a JSON object) of the JSONL ``files``.

    Raises:
      ValueError: a line that is not a JSON object, lacks ``field``, or whose ``field`` is not a
        string; the message names the file and line.
    """
    for path in files:
        for number, line in enumerate(iter_lines(path, on_read), start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            if field not in obj:
                keys = ", ".join(map(repr, obj)) or "none"
                raise ValueError(f"{where}: no field {field!r} (keys: {keys})")
            if not isinstance(obj[field], str):
                kind = type(obj[field]).__name__
                raise ValueError(f"{where}: field {field!r} must be a string, got {kind}")
            yield {"text": obj[field]}


def iter_parallel_records(
    files: Sequence[Path], on_read: OnRead | None = None
) -> Iterator[dict[str, str]]:
    """``{"source": ..., "target": ...}`` pairs from a TSV file or two line-aligned files.

    Args:
      files: either one file of ``source<TAB>target`` lines, or two files whose line ``k`` are a
        pair (:func:`source_files` of ``"src_file,tgt_file"``). Lines blank on both sides are
        skipped.
      on_read: see :data:`OnRead`.

    Raises:
      ValueError: a TSV line without exactly one tab, or two files with different line counts
        (the message names both files and their counts).
    """
    if len(files) == 1:
        for number, line in enumerate(iter_lines(files[0], on_read), start=1):
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) != 2:
                raise ValueError(
                    f"{files[0]}:{number}: expected source<TAB>target, found {len(fields) - 1} tabs"
                )
            yield {"source": fields[0], "target": fields[1]}
        return
    src_path, tgt_path = files
    sources, targets = iter_lines(src_path, on_read), iter_lines(tgt_path, on_read)
    for count, (source, target) in enumerate(itertools.zip_longest(sources, targets)):
        if source is None or target is None:  # one file ended: count the other's lines
            rest = 1 + sum(1 for _ in (targets if source is None else sources))
            counts = (count, count + rest) if source is None else (count + rest, count)
            raise ValueError(
                f"{src_path} has {counts[0]} lines but {tgt_path} has {counts[1]}; "
                "parallel files must be line-aligned"
            )
        if source.strip() or target.strip():
            yield {"source": source, "target": target}


def iter_records(
    source: str, files: Sequence[Path], field: str = "text", on_read: OnRead | None = None
) -> Iterator[dict[str, str]]:
    """The records of a ``text``, ``jsonl`` (text in ``field``) or ``parallel`` source's
    ``files`` (:func:`source_files`)."""
    if source == "text":
        return iter_text_records(files, on_read)
    if source == "jsonl":
        return iter_jsonl_records(files, field, on_read)
    if source == "parallel":
        return iter_parallel_records(files, on_read)
    raise ValueError(f"unknown source {source!r}; valid sources: {', '.join(SOURCES)}")


def _parallel_files(path_or_pair: str) -> list[Path]:
    """The TSV file (the first a glob names), or the source and target files of a pair."""
    parts = path_or_pair.split(",")
    if len(parts) > 2:
        raise ValueError(f"{path_or_pair}: expected a TSV file or 'src_file,tgt_file'")
    if len(parts) == 1:
        return [expand_files(parts[0])[0]]
    return [expand_files(part.strip())[0] for part in parts]


def _decode(data: bytes, path: Path, offset: int, number: int) -> str:
    """``data`` decoded; it starts at byte ``offset`` of ``path``, after ``number`` lines."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = number + data.count(b"\n", 0, e.start) + 1
        raise ValueError(
            f"{path}: not valid UTF-8 at line {line}, byte offset {offset + e.start} ({e.reason})"
        ) from None
