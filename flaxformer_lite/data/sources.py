"""Readers of local training data: text files, JSONL fields and parallel (translation) text.

Each reader returns a list of records, dicts of strings, in the shapes the synthetic tasks use:
``{"text": ...}`` for :func:`text_records` and :func:`jsonl_records`, ``{"source": ...,
"target": ...}`` for :func:`parallel_records`. Files are read whole into memory, which suits the
small-to-medium corpora this library trains on; files are read in sorted path order, so the same
files always give the same records. :func:`split_records` holds out a validation split.

One record per non-blank line (a line holding only whitespace is skipped; other lines are kept
as they are, minus the line break). Line-per-record is the layout of lm1b and of most parallel
corpora; documents longer than the pipeline's ``seq_len`` would be truncated anyway.

Problems raise before any record is returned, naming the file (and line) and the reason:
``FileNotFoundError`` for a missing path or a glob that matches no file, ``ValueError`` for an
empty file, bytes that are not UTF-8, a malformed JSONL line or a missing field, and parallel
files of different lengths.
"""

from __future__ import annotations

import glob
import hashlib
import json
from pathlib import Path

_GLOB_CHARS = frozenset("*?[")


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


def read_lines(path: Path) -> list[str]:
    """All lines of a UTF-8 file without their line breaks (``\\n`` or ``\\r\\n``).

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: the file is empty (or only whitespace), or not valid UTF-8 (the message gives
        the line and byte offset of the first bad byte).
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: file not found") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(
            f"{path}: not valid UTF-8 at line {line}, byte offset {e.start} ({e.reason})"
        ) from None
    if not text.strip():
        raise ValueError(f"{path}: empty file (no non-blank line)")
    lines = text.split("\n")
    if lines[-1] == "":  # the final line break ends the last line, it does not start one
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def text_records(pattern: str) -> list[dict[str, str]]:
    """``{"text": line}`` for every non-blank line of the files ``pattern`` names."""
    return [
        {"text": line}
        for path in expand_files(pattern)
        for line in read_lines(path)
        if line.strip()
    ]


def jsonl_records(pattern: str, field: str = "text") -> list[dict[str, str]]:
    """``{"text": obj[field]}`` for every non-blank line (a JSON object) of the JSONL files.

    Raises:
      ValueError: a line that is not a JSON object, lacks ``field``, or whose ``field`` is not a
        string; the message names the file and line.
    """
    records = []
    for path in expand_files(pattern):
        for number, line in enumerate(read_lines(path), start=1):
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
            records.append({"text": obj[field]})
    return records


def parallel_records(path_or_pair: str) -> list[dict[str, str]]:
    """``{"source": ..., "target": ...}`` pairs from a TSV file or two line-aligned files.

    Args:
      path_or_pair: either one file of ``source<TAB>target`` lines, or ``"src_file,tgt_file"``:
        two files whose line ``k`` are a pair (so paths may not contain a comma). Lines blank on
        both sides are skipped.

    Raises:
      ValueError: a TSV line without exactly one tab, or two files with different line counts
        (the message names both files and their counts).
    """
    parts = path_or_pair.split(",")
    if len(parts) > 2:
        raise ValueError(f"{path_or_pair}: expected a TSV file or 'src_file,tgt_file'")
    if len(parts) == 1:
        pairs = []
        path = expand_files(parts[0])[0]
        for number, line in enumerate(read_lines(path), start=1):
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) != 2:
                raise ValueError(
                    f"{path}:{number}: expected source<TAB>target, found {len(fields) - 1} tabs"
                )
            pairs.append(fields)
    else:
        src_path, tgt_path = (expand_files(part.strip())[0] for part in parts)
        sources, targets = read_lines(src_path), read_lines(tgt_path)
        if len(sources) != len(targets):
            raise ValueError(
                f"{src_path} has {len(sources)} lines but {tgt_path} has {len(targets)}; "
                "parallel files must be line-aligned"
            )
        pairs = zip(sources, targets, strict=True)
    return [{"source": s, "target": t} for s, t in pairs if s.strip() or t.strip()]


def split_records(
    records: list[dict], fraction: float, where: str
) -> tuple[list[dict], list[dict]]:
    """``(train, validation)``: holds out the ``round(fraction * N)`` records of least hash.

    The hash is of a record's content, so the split depends on neither the seed nor the file
    order, and adding data moves few records between splits. Identical records hash alike and
    stay together unless they straddle the cut. Both parts keep the records' order.

    Raises:
      ValueError: naming ``where`` (the data path), if either part would be empty.
    """
    count = round(fraction * len(records))
    if not 0 < count < len(records):
        raise ValueError(
            f"{where}: {len(records)} records cannot be split by data.validation_fraction="
            f"{fraction} into non-empty training and validation sets"
        )

    def digest(i: int) -> bytes:
        text = json.dumps(records[i], sort_keys=True).encode()
        return hashlib.blake2b(text, digest_size=8).digest()

    held_out = set(sorted(range(len(records)), key=lambda i: (digest(i), i))[:count])
    train = [r for i, r in enumerate(records) if i not in held_out]
    return train, [r for i, r in enumerate(records) if i in held_out]
