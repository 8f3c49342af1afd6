"""Prepared token stores: a corpus tokenized once into flat arrays on disk, memory-mapped to read.

    store = prepare_store("stores/lines", source="text", path="data/*.txt", documents="lines",
                          tokenizer_name="bpe", vocab_size=8192)
    store = open_store("stores/lines")            # checked against its manifest, read-only
    ids = store.documents.document("text", 0)     # the first document's ids, a view

A store is a directory (nanoGPT-style raw arrays: any document or window is a zero-copy slice,
and any tool reads the files)::

    manifest.json     written last, so its presence marks a complete store
    tokenizer/        Tokenizer.save
    {field}.tokens    every document's ids end to end: uint16 if the vocabulary has at most
                      65,536 ids, else uint32 (fields: text, or source and target)
    {field}.offsets   int64 [N + 1]: document i is tokens[offsets[i]:offsets[i + 1]]
    digests.u64       uint64 [N]: documents.text_digests of the documents (decides the split)
    labels.i32        int32 [N], optional: class indices (prepare_store writes none)

The manifest names the format and version, the source (its name under ``kind``, path, field,
how a text file became documents, each file's size and sha256), the tokenizer (its name under
``kind``, its files' sha256, what a fitted one was fitted with), the number of documents, each
field's number of tokens and dtype, each data file's size, and the sha256 of the small ones (all
but ``{field}.tokens``).

Opening a store checks every file's size, the small files' sha256 (16 bytes a document of
text, 24 of pairs: about 0.1 s per million documents) and the tokenizer's files. The tokens,
which may be GBs, are not hashed: an id past the tokenizer's vocabulary is refused as batches
read it (:meth:`~flaxformer_lite.data.documents.Documents.checked`, a max over what is read).

:func:`prepare_store` writes into a sibling ``.NAME.partial-<host>-<pid>`` directory, flushes it
to disk, writes the manifest and renames it into place: an interrupted prepare leaves nothing
that opens, and its leftover directory is removed by the next prepare on the same host once its
process is gone (a partial of another host, on a shared file system, is left alone). Memory holds
a few batches of documents, never the corpus (fitting a tokenizer on the training split holds
each document's digest); the passes are in :mod:`~flaxformer_lite.data.store_writer`. Nothing
here prints: a caller that wants a progress bar passes a tqdm-like factory.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import numpy as np

from flaxformer_lite.data import readers, tokenizers
from flaxformer_lite.data.documents import FIELDS, Documents
from flaxformer_lite.data.sources import FileSource, Source, source_named
from flaxformer_lite.data.store_writer import (
    BATCH_SIZE,
    DIGESTS,
    FileHashes,
    Progress,
    SourcePasses,
    fit_tokenizer,
    fsync_directory,
    fsync_tree,
    hash_files,
    token_dtype,
    write_documents,
)
from flaxformer_lite.data.tokenizers import Tokenizer

FORMAT, VERSION = "flaxformer-lite token store", 1
MANIFEST, TOKENIZER_DIR, LABELS = "manifest.json", "tokenizer", "labels.i32"
_DTYPES = (token_dtype(1), token_dtype(1 << 32))


@dataclasses.dataclass(frozen=True)
class Store:
    """An opened store: its documents (read-only memory maps), tokenizer and manifest."""

    path: Path
    documents: Documents
    tokenizer: Tokenizer
    manifest: dict[str, Any]


def prepare_store(
    out_dir: Path | str,
    *,
    source: str | Source,
    path: str,
    field: str = "text",
    documents: str = readers.DEFAULT_DOCUMENTS,
    tokenizer: Tokenizer | None = None,
    tokenizer_name: str = "byte",
    vocab_size: int | None = None,
    tokenizer_path: Path | str | None = None,
    validation_fraction: float | None = 0.1,
    batch_size: int = BATCH_SIZE,
    progress: Progress | None = None,
) -> Store:
    """Tokenizes a source of files (``path``, read by the :class:`~flaxformer_lite.data
    .sources.FileSource` named ``source``) into a store at ``out_dir``, or opens the store
    already there if it was made from the same files (by size and sha256) and tokenizer.

    Args:
      out_dir: the store directory; it must not exist, be empty, or hold a store of these
        inputs. A symbolic link is followed: the store is made where it points, the link kept.
      source, path: the source (as a config's ``reader`` gives it, or its name: ``text``,
        ``jsonl``, ``parallel``, or another registered) and its files.
      field, documents: the JSONL field holding the text and how a ``text`` source's files
        become documents (``file``, ``paragraphs`` or ``lines``:
        :mod:`~flaxformer_lite.data.readers`), for a source given by name.
      tokenizer: use this tokenizer; otherwise ``tokenizer_name`` (``byte``, ``sentencepiece``
        from ``tokenizer_path``, or ``char``, ``word``, ``bpe`` fitted with ``vocab_size`` on
        the training part: all but the ``validation_fraction`` that
        :func:`~flaxformer_lite.data.documents.split_documents` holds out, or for ``file``
        documents the tail each keeps back; all of it if None, for a separate validation set).
      batch_size: texts per ``encode_batch`` call (fewer if they are long: :data:`BATCH_CHARS`).
      progress: see :data:`Progress`; None shows nothing.

    Raises:
      ValueError: bad settings or data (naming the file and line), a source file changed while
        being prepared, or ``out_dir`` holding anything but a store of these inputs (named).
      FileNotFoundError: a missing source or tokenizer file.
      OSError: a full disk (naming ``out_dir``; nothing of the store is kept), or another
        error writing it.
    """
    out_dir = Path(out_dir)
    if out_dir.is_symlink():  # the store is renamed into place: onto the link it would fail
        out_dir = out_dir.resolve()
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    file_source = source if isinstance(source, Source) else source_named(source, field, documents)
    if not isinstance(file_source, FileSource):
        raise ValueError(f"source {file_source.name!r} is not files to prepare into a store")
    files = file_source.files(path)
    fitted = None
    if tokenizer is None and tokenizer_name in tokenizers.FITTED_TOKENIZERS:
        if tokenizer_name == "bpe" and vocab_size is None:
            raise ValueError("tokenizer 'bpe' needs vocab_size")
        vocab_size = None if tokenizer_name == "char" else vocab_size
        fitted = {"vocab_size": vocab_size, "validation_fraction": validation_fraction}
    elif tokenizer is None:
        tokenizer = tokenizers.make_tokenizer(tokenizer_name, path=tokenizer_path)
    tokenizer_name = tokenizer_name if tokenizer is None else tokenizer.name
    request = {
        "source": file_source.identity(path),
        "tokenizer": {"kind": tokenizer_name, "fitted": fitted},
    }
    if tokenizer is not None:
        request["tokenizer"]["sha256"] = _files_sha256(tokenizer.files())[0]
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())):
        return _existing_store(out_dir, request, files, progress)  # an empty directory is filled

    partial = out_dir.absolute().parent / f".{out_dir.absolute().name}.partial-{owner()}"
    remove_stale_partials(partial)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        stats = [(p, p.stat()) for p in files]
        hashes = FileHashes(files)  # fed by the first pass over the files
        passes = SourcePasses(file_source, files, batch_size, progress)
        if fitted is not None:
            tokenizer = fit_tokenizer(passes, tokenizer_name, **fitted, where=path, on_read=hashes)
            hashes, request["source"]["files"] = None, hashes.infos()
        tokenizer.save(partial / TOKENIZER_DIR)
        count, tokens = write_documents(partial, passes, tokenizer, on_read=hashes)
        if hashes is not None:
            request["source"]["files"] = hashes.infos()
        for p, stat in stats:
            now = p.stat()
            if (now.st_size, now.st_mtime_ns) != (stat.st_size, stat.st_mtime_ns):
                raise ValueError(f"{p}: changed while the store was being prepared")
        manifest = _manifest(partial, request, tokenizer, count, tokens)
        fsync_tree(partial)  # the data on disk before the manifest that vouches for it
        with (partial / MANIFEST).open("w", encoding="utf-8") as file:
            file.write(json.dumps(manifest, indent=1) + "\n")
            file.flush()
            os.fsync(file.fileno())
        try:
            os.rename(partial, out_dir)
        except OSError as error:  # another prepare of out_dir finished first
            if error.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            shutil.rmtree(partial, ignore_errors=True)
            return _existing_store(out_dir, request, files, progress)
        fsync_directory(out_dir.absolute().parent)
    except BaseException as error:
        shutil.rmtree(partial, ignore_errors=True)
        # Writes that fail for want of room name no file: say which store, and that no part of it
        # is left taking up room.
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OSError(
                f"{out_dir}: {os.strerror(error.errno)} while preparing the store; nothing of it "
                "was kept"
            ) from error
        raise
    return open_store(out_dir)


def open_store(path: Path | str) -> Store:
    """The store at ``path``, its arrays memory-mapped read-only.

    Checked: the manifest (JSON, format and version), every data file's size against it, the
    sha256 of all but the tokens (where the manifest has them: stores prepared before it
    recorded them are not hashed), the offsets' bounds and order, and the sha256 of each
    tokenizer file. The documents refuse an id past the tokenizer's vocabulary as it is read.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: anything else amiss, naming the file (a missing ``manifest.json``: an
        interrupted prepare).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no prepared store here (not a directory)")
    manifest = _read_manifest(path)
    where = path / MANIFEST
    try:
        count, fields = int(manifest["documents"]), manifest["fields"]
        sizes = {name: int(size) for name, size in manifest["files"].items()}
        dtypes = {name: np.dtype(info["dtype"]) for name, info in fields.items()}
        n_tokens = {name: int(info["tokens"]) for name, info in fields.items()}
        tokenizer_info = manifest["tokenizer"]
        tokenizer_files = dict(tokenizer_info["files"])
        if tuple(fields) not in FIELDS.values() or {*dtypes.values()} - {*_DTYPES}:
            raise ValueError(f"fields {fields}")
        if any(Path(name).name != name for name in tokenizer_files):
            raise ValueError(f"tokenizer files {list(tokenizer_files)}")
        sha256 = {name: str(digest) for name, digest in manifest.get("sha256", {}).items()}
        if sha256.keys() - sizes.keys():
            raise ValueError(f"sha256 of {sorted(sha256)}")
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{where}: not a valid store manifest ({e!r})") from None
    expected = {DIGESTS: 8 * count}
    for name in fields:
        expected |= {f"{name}.tokens": n_tokens[name] * dtypes[name].itemsize}
        expected |= {f"{name}.offsets": 8 * (count + 1)}
    if LABELS in sizes:
        expected[LABELS] = 4 * count
    if sizes != expected:
        raise ValueError(f"{where}: its file sizes {sizes} do not match its counts {expected}")
    for name, size in sizes.items():
        if not (file := path / name).is_file():
            raise ValueError(f"{file}: missing from the store")
        if (actual := file.stat().st_size) != size:
            raise ValueError(
                f"{file}: {actual} bytes, but the manifest says {size}: a truncated or changed "
                "file (prepare the store again)"
            )
    for name, digest in sha256.items():
        if _file_sha256(path / name) != digest:
            raise ValueError(
                f"{path / name}: not the file the store was made with (its sha256 differs from "
                "the manifest's): a changed or corrupt file (prepare the store again)"
            )
    _check_tokenizer_files(path / TOKENIZER_DIR, tokenizer_files)
    tokenizer = tokenizers.load_tokenizer(path / TOKENIZER_DIR)
    if tokenizer.name != tokenizer_info.get("kind"):
        name = tokenizer_info.get("kind")
        raise ValueError(f"{path / TOKENIZER_DIR}: a {tokenizer.name!r} tokenizer, not {name!r}")

    tokens, offsets = {}, {}
    for name in fields:
        tokens[name] = _map(path / f"{name}.tokens", dtypes[name], n_tokens[name])
        offsets[name] = _map(path / f"{name}.offsets", np.int64, count + 1)
        ends = offsets[name]
        if ends[0] != 0 or ends[-1] != n_tokens[name] or np.any(ends[1:] < ends[:-1]):
            raise ValueError(f"{path / f'{name}.offsets'}: corrupt (not 0 .. {n_tokens[name]})")
    labels = _map(path / LABELS, np.int32, count) if LABELS in sizes else None
    digests = _map(path / DIGESTS, np.uint64, count)
    files = {name: str(path / f"{name}.tokens") for name in fields}
    documents = Documents(tokens, offsets, digests, labels, tokenizer.vocab_size, files)
    return Store(path, documents, tokenizer, manifest)


def check_tokenizer(store: Store, tokenizer: Tokenizer) -> None:
    """Refuses a store made with another tokenizer than ``tokenizer``.

    Raises:
      ValueError: naming the store's tokenizer files.
    """
    if not store.tokenizer.same_as(tokenizer):
        names = ", ".join(sorted(store.manifest["tokenizer"]["files"]))
        raise ValueError(
            f"{store.path / TOKENIZER_DIR}: the store was made with another tokenizer (a "
            f"{store.tokenizer.name!r} one: {names}) than this {tokenizer.name!r} one"
        )


def _manifest(
    directory: Path,
    request: dict[str, Any],
    tokenizer: Tokenizer,
    documents: int,
    tokens: dict[str, int],
) -> dict[str, Any]:
    """The manifest of the store written in ``directory`` from ``request``'s inputs."""
    dtype = token_dtype(tokenizer.vocab_size).name
    sha256, tokenizer_files = _files_sha256(tokenizer.files())
    files = [p for p in sorted(directory.iterdir()) if p.is_file()]
    return {
        "format": FORMAT,
        "version": VERSION,
        "source": request["source"],
        "tokenizer": {
            **request["tokenizer"],
            "vocab_size": tokenizer.vocab_size,
            "sha256": sha256,
            "files": tokenizer_files,
        },
        "documents": documents,
        "fields": {name: {"tokens": count, "dtype": dtype} for name, count in tokens.items()},
        "files": {p.name: p.stat().st_size for p in files},
        "sha256": {p.name: _file_sha256(p) for p in files if p.suffix != ".tokens"},
    }


def _existing_store(
    out_dir: Path, request: dict[str, Any], files: list[Path], progress: Progress | None
) -> Store:
    """The store at ``out_dir`` if it was made from ``request``'s inputs (``files``, hashed
    only if their sizes match); else an error."""
    if not (out_dir / MANIFEST).is_file():
        raise ValueError(
            f"{out_dir}: exists and is not a prepared store (no {MANIFEST}); prepare into "
            "another directory, or remove it"
        )
    store = open_store(out_dir)
    request["source"]["files"] = [{"path": str(p), "size": p.stat().st_size} for p in files]
    try:
        why = _difference(store.manifest, request)
        if why is None:  # the same but for the files' contents, which only a hash tells
            request["source"]["files"] = hash_files(files, progress)
            why = _difference(store.manifest, request)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{out_dir / MANIFEST}: not a valid store manifest ({e!r})") from None
    if why:
        raise ValueError(
            f"{out_dir}: holds a store of other inputs ({why}); prepare into another "
            "directory, or remove it to prepare it again"
        )
    return store


def _difference(made: dict[str, Any], request: dict[str, Any]) -> str | None:
    """What differs between the inputs a manifest records and ``request``'s, or None (files
    not hashed yet are compared by size)."""
    source, wanted = made["source"], request["source"]
    if (source["kind"], source.get("field")) != (wanted["kind"], wanted["field"]):
        return f"source {source['kind']!r} field {source.get('field')!r}"
    if text_documents(made) != wanted["documents"]:
        return f"{text_documents(made)!r} documents, not {wanted['documents']!r}"
    if len(source["files"]) != len(wanted["files"]):
        return f"{len(source['files'])} source files, not {len(wanted['files'])}"
    for before, now in zip(source["files"], wanted["files"], strict=True):
        if before["size"] != now["size"] or before["sha256"] != now.get("sha256", before["sha256"]):
            return f"{now['path']} differs from the file the store was made from"
    tokenizer, wanted = made["tokenizer"], request["tokenizer"]
    if tokenizer["kind"] != wanted["kind"]:
        return f"a {tokenizer['kind']!r} tokenizer, not {wanted['kind']!r}"
    if wanted["fitted"] is not None and tokenizer.get("fitted") != wanted["fitted"]:
        return f"a tokenizer fitted with {tokenizer.get('fitted')}, not {wanted['fitted']}"
    if wanted["fitted"] is None and tokenizer["sha256"] != wanted["sha256"]:
        return "another tokenizer's files"
    return None


def text_documents(manifest: dict[str, Any]) -> str | None:
    """How the text files of a store's source became documents (None: not a text source).
    Stores made before the setting existed made a document of each line."""
    made_from = manifest["source"]
    return source_named(made_from["kind"]).documents_of(made_from)


def _read_manifest(path: Path) -> dict[str, Any]:
    where = path / MANIFEST
    if not where.is_file():
        raise ValueError(f"{path}: not a prepared store (no {MANIFEST}): an interrupted prepare?")
    try:
        manifest = json.loads(where.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: not valid UTF-8 JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{where}: not the manifest of a {FORMAT}")
    if manifest.get("version") != VERSION:
        raise ValueError(
            f"{where}: store format version {manifest.get('version')!r}; this version of "
            f"flaxformer_lite reads version {VERSION} (prepare the store again)"
        )
    return manifest


def _check_tokenizer_files(directory: Path, expected: dict[str, Any]) -> None:
    for name, info in expected.items():
        file = directory / name
        if not file.is_file():
            raise ValueError(f"{file}: missing from the store")
        if hashlib.sha256(file.read_bytes()).hexdigest() != info.get("sha256"):
            raise ValueError(f"{file}: not the tokenizer file the store was made with")


def _file_sha256(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _files_sha256(files: dict[str, bytes]) -> tuple[str, dict[str, dict[str, Any]]]:
    """The sha256 of a set of files (names and contents), and each file's size and sha256."""
    each = {
        name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for name, data in files.items()
    }
    whole = hashlib.sha256(json.dumps(each, sort_keys=True).encode()).hexdigest()
    return whole, each


def owner() -> str:
    """``<host>-<pid>``: which process, on which machine, writes a partial store (or export)."""
    return f"{socket.gethostname()}-{os.getpid()}"


def remove_stale_partials(partial: Path) -> None:
    """Removes the partial directories of the same store (or export) left by processes of this
    host that are no longer running (another host's processes cannot be asked)."""
    prefix = partial.name.rsplit("-", 1)[0] + "-"  # .NAME.partial-<host>-
    for leftover in partial.parent.glob(f"{prefix}*"):
        pid = leftover.name[len(prefix) :]
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), 0)  # signal 0: only asks whether the process exists
            except ProcessLookupError:
                shutil.rmtree(leftover, ignore_errors=True)
            except PermissionError:  # another user's process, running
                pass


def _map(path: Path, dtype, count: int) -> np.ndarray:
    """The ``count`` values in ``path``, memory-mapped read-only (numpy cannot map 0 bytes)."""
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,)) if count else np.zeros(0, dtype)
