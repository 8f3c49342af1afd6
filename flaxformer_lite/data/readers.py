"""Readers of local training data: text files, JSONL fields and parallel (translation) text.

Records are dicts of strings, in the shapes the synthetic generators use: ``{"text": ...}`` for text
and JSONL files, ``{"source": ..., "target": ...}`` for parallel text. Each has a streaming
reader, ``iter_text_records``, ``iter_jsonl_records`` and ``iter_parallel_records`` (its source,
:mod:`~flaxformer_lite.data.sources`, calls it), which reads the files in bounded chunks and
yields one record at a time, so a corpus larger than memory can be tokenized
(:mod:`flaxformer_lite.data.store`). The readers take the files a source resolved from a path or
glob (:func:`expand_files`: sorted path order, so the same files always give the same records):
a caller that records the files it read (a store's manifest) reads exactly those, even if the
glob matches more files later.

A text file becomes documents as :data:`TEXT_DOCUMENTS` says: ``file`` (the default) keeps each
file whole, line breaks and blank lines included, as a book or a code file is; ``paragraphs``
makes one record of each run of non-blank lines (their line breaks kept; blank lines separate);
``lines`` one record per non-blank line, minus its line break (lm1b's layout, and that of JSONL
and parallel corpora, whose lines are always records). A line holding only whitespace is blank.

Files ending in ``.gz`` or ``.xz`` are read decompressed (what ``on_read`` sees and a store hashes
are the file's own bytes). ``builtin:NAME`` names a text shipped inside the package
(:data:`BUILTIN_TEXTS`).

Problems raise naming the file (and line) and the reason: ``FileNotFoundError`` for a missing path
or a glob that matches no file, ``ValueError`` for an empty file, bytes that are not UTF-8, a
malformed JSONL line or a missing field, and parallel files of different lengths. The readers
raise when they reach the problem (an empty file or misaligned parallel files: at the end of the
file).
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import itertools
import json
import lzma
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

_GLOB_CHARS = frozenset("*?[")
# Bytes read at a time: what a streaming reader holds, with the longest line.
CHUNK_BYTES = 1 << 20
DEFAULT_DOCUMENTS = "file"  # what data.text_documents unset means
TEXT_DOCUMENTS = (DEFAULT_DOCUMENTS, "paragraphs", "lines")
BUILTIN = "builtin:"
# Public-domain texts shipped compressed in the package: name -> file in data/texts/.
BUILTIN_TEXTS = {"tinyshakespeare": "tinyshakespeare.txt.xz"}
_DECOMPRESS = {".gz": lambda file: gzip.GzipFile(fileobj=file), ".xz": lzma.LZMAFile}

OnRead = Callable[[Path, bytes], None]
"""Called with each chunk of raw bytes as it is read from a file (e.g. to hash it)."""


def expand_files(pattern: str) -> list[Path]:
    """The files a path or glob (``**`` recurses) names, sorted; directories are left out.

    Raises:
      FileNotFoundError: a plain path that is not a file, a glob that matches no file, or an
        unknown ``builtin:`` name.
    """
    if pattern.startswith(BUILTIN):
        return [builtin_text(pattern.removeprefix(BUILTIN))]
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


def builtin_text(name: str) -> Path:
    """The file of the text shipped as ``builtin:name``."""
    if name not in BUILTIN_TEXTS:
        known = ", ".join(BUILTIN + n for n in BUILTIN_TEXTS)
        raise FileNotFoundError(f"{BUILTIN}{name}: no such built-in text (there are: {known})")
    return Path(__file__).parent / "texts" / BUILTIN_TEXTS[name]


def iter_lines(path: Path, on_read: OnRead | None = None) -> Iterator[str]:
    """The lines of a UTF-8 file without their line breaks (``\\n`` or ``\\r\\n``), read in
    chunks of :data:`CHUNK_BYTES`.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: the file is not valid UTF-8 (the message gives the line and byte offset of the
        first bad byte), or, at its end, it was empty (or only whitespace).
    """
    path = Path(path)
    with _open(path, on_read) as file:
        offset, number, blank = 0, 0, True  # offset and line number of the next complete part
        pending: list[bytes] = []  # the start of a line whose break is not read yet
        while True:
            data = _read(file, path)
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


def check_not_blank(path: Path) -> None:
    """Refuses a file with nothing but (ASCII) blanks, reading only up to its first other byte.

    Raises:
      FileNotFoundError, ValueError: as :func:`iter_lines`.
    """
    with _open(Path(path), None) as file:
        while data := _read(file, path):
            if data.strip():
                return
    raise ValueError(f"{path}: empty file (no non-blank line)")


def read_text(path: Path, on_read: OnRead | None = None) -> str:
    """A UTF-8 file's whole text, as it is (line breaks and blank lines kept).

    Raises:
      FileNotFoundError, ValueError: as :func:`iter_lines`.
    """
    path = Path(path)
    with _open(path, on_read) as file:
        parts = []
        while data := _read(file, path):
            parts.append(data)
    text = _decode(b"".join(parts), path, 0, 0)
    if not text.strip():
        raise ValueError(f"{path}: empty file (no non-blank line)")
    return text


def iter_paragraphs(path: Path, on_read: OnRead | None = None) -> Iterator[str]:
    """Each run of non-blank lines of a file, its lines joined by line breaks."""
    lines: list[str] = []
    for line in iter_lines(path, on_read):
        if line.strip():
            lines.append(line)
        elif lines:
            yield "\n".join(lines)
            lines = []
    if lines:
        yield "\n".join(lines)


def iter_text_records(
    files: Sequence[Path], documents: str = DEFAULT_DOCUMENTS, on_read: OnRead | None = None
) -> Iterator[dict[str, str]]:
    """``{"text": document}`` for every document of ``files``, made as ``documents`` (one of
    :data:`TEXT_DOCUMENTS`) says."""
    check_text_documents(documents)
    for path in files:
        if documents == DEFAULT_DOCUMENTS:
            yield {"text": read_text(path, on_read)}
        elif documents == "paragraphs":
            yield from ({"text": paragraph} for paragraph in iter_paragraphs(path, on_read))
        else:
            yield from ({"text": line} for line in iter_lines(path, on_read) if line.strip())


def check_text_documents(documents: str) -> None:
    if documents not in TEXT_DOCUMENTS:
        raise ValueError(
            f"unknown text documents {documents!r}; valid: {', '.join(TEXT_DOCUMENTS)}"
        )


def iter_jsonl_records(
    files: Sequence[Path], field: str = "text", on_read: OnRead | None = None
) -> Iterator[dict[str, str]]:
    """``{"text": obj[field]}`` for every non-blank line (a JSON object) of the JSONL ``files``.

    Raises:
      ValueError: a line that is not a JSON object, lacks ``field``, or whose ``field`` is not a
        string; the message names the file and line.
    """
    for path in files:
        for where, obj in iter_json_objects(path, on_read):
            if field not in obj:
                keys = ", ".join(map(repr, obj)) or "none"
                raise ValueError(f"{where}: no field {field!r} (keys: {keys})")
            if not isinstance(obj[field], str):
                got = type(obj[field]).__name__
                raise ValueError(f"{where}: field {field!r} must be a string, got {got}")
            yield {"text": obj[field]}


def iter_json_objects(path: Path, on_read: OnRead | None = None) -> Iterator[tuple[str, dict]]:
    """``(where, object)`` for every non-blank line of a JSONL file, ``where`` its
    ``path:line``.

    Raises:
      FileNotFoundError, ValueError: as :func:`iter_lines`; a line that is not a JSON object
        (the message names the file and line).
    """
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
        yield where, obj


def iter_parallel_records(
    files: Sequence[Path], on_read: OnRead | None = None
) -> Iterator[dict[str, str]]:
    """``{"source": ..., "target": ...}`` pairs from a TSV file or two line-aligned files.

    Args:
      files: either one file of ``source<TAB>target`` lines, or two files whose line ``k`` are a
        pair (``data.path`` ``"src_file,tgt_file"``). Lines blank on both sides are
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


class _RawBytes:
    """A binary file whose reads are also handed to ``on_read`` (a compressed file's own bytes)."""

    def __init__(self, file, path: Path, on_read: OnRead):
        self.file, self.path, self.on_read = file, path, on_read

    def read(self, size: int = -1) -> bytes:
        data = self.file.read(size)
        if data:
            self.on_read(self.path, data)
        return data


@contextlib.contextmanager
def _open(path: Path, on_read: OnRead | None) -> Iterator:
    """``path`` opened to read its (decompressed) bytes; ``on_read`` sees the file's bytes."""
    try:
        raw = path.open("rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: file not found") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from None
    with raw:
        reader = raw if on_read is None else _RawBytes(raw, path, on_read)
        decompress = _DECOMPRESS.get(path.suffix)
        yield reader if decompress is None else decompress(reader)


def _read(file, path: Path) -> bytes:
    """The next chunk of ``file`` (empty at its end)."""
    try:
        return file.read(CHUNK_BYTES)
    except (OSError, EOFError, lzma.LZMAError, zlib.error) as e:  # zlib: a corrupt deflate
        reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise ValueError(f"{path}: cannot read ({reason})") from None


def _decode(data: bytes, path: Path, offset: int, number: int) -> str:
    """``data`` decoded; it starts at byte ``offset`` of ``path``, after ``number`` lines."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = number + data.count(b"\n", 0, e.start) + 1
        raise ValueError(
            f"{path}: not valid UTF-8 at line {line}, byte offset {offset + e.start} ({e.reason})"
        ) from None
