"""What a run's data depend on, recorded in ``RUN/inputs.json`` when its data are built and
checked when it starts again: the ``data`` settings and the source files (path and size, and
sha256 where a prepared store's manifest has it: the store hashed them, this module never
does).

    recorded = read_inputs(run.inputs)
    changes = input_changes(recorded, current_inputs(cfg.data)) if recorded else []
    ...build the data...
    write_inputs(run.inputs, built_inputs(cfg.data, run.prepared))
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from flaxformer_lite.data import sources
from flaxformer_lite.data.config import DataConfig
from flaxformer_lite.data.store import MANIFEST
from flaxformer_lite.train.config import flatten


def current_inputs(cfg: DataConfig) -> dict[str, Any]:
    """The data settings and the source files as they are now (sizes only: cheap)."""
    files = [f for path in _paths(cfg) for f in _files_now(cfg, path)]
    return {"data": dataclasses.asdict(cfg), "files": files}


def built_inputs(cfg: DataConfig, prepared: pathlib.Path) -> dict[str, Any]:
    """The inputs the run's data were just built from: :func:`current_inputs` with each
    file's sha256 from the prepared store's manifest (``data.path`` and
    ``data.validation_path`` for prepared sources, the run's stores in ``prepared`` of text,
    jsonl or parallel ones)."""
    inputs = current_inputs(cfg)
    files = []
    for path in _paths(cfg):
        found = store_of(cfg, prepared, path)
        files += _files_now(cfg, path) if found is None else _manifest_files(found[1])
    inputs["files"] = files
    return inputs


def _paths(cfg: DataConfig) -> list[str]:
    """The data's paths: ``data.path``, ``data.validation_path`` if set, or a mixture's."""
    return list(cfg.paths().values())


def read_inputs(path: pathlib.Path) -> dict[str, Any] | None:
    """The inputs recorded in ``path``, or None when the run has no record (an older run)."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise ValueError(f"{path}: not a record of the run's inputs ({error})") from None


def write_inputs(path: pathlib.Path, inputs: dict[str, Any]) -> None:
    """Writes the record ``path`` aside and renames it: a killed write keeps the old record."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(inputs, indent=1) + "\n", encoding="utf-8")
    partial.replace(path)


def input_changes(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One ``  what: before -> now`` line per difference (files: by path and size, and by
    sha256 where both sides have it)."""
    lines = []
    before, now = dict(recorded.get("data", {})), dict(current["data"])
    if before.get("source") == "text" and "text_documents" not in before:
        before["text_documents"] = "lines"  # recorded before the setting: a document per line
    for side in (before, now):  # unset, a text file is one document: the same as file
        if side.get("source") == "text" and side.get("text_documents") is None:
            side["text_documents"] = "file"
    if now.get("source") == "prepared" and now.get("tokenizer") is None:
        before["tokenizer"] = None  # whatever was recorded, the store's own tokenizer was used
    before, now = flatten(before), flatten(now)  # a mixture's sources key by key
    for key in sorted(before.keys() | now.keys()):
        if before.get(key) != now.get(key):
            lines.append(f"  data.{key}: {before.get(key)!r} -> {now.get(key)!r}")
    old_files = {f["path"]: f for f in recorded.get("files", [])}
    new_files = {f["path"]: f for f in current["files"]}
    for path in sorted(old_files.keys() | new_files.keys()):
        old, new = old_files.get(path), new_files.get(path)
        if old is None or new is None:
            lines.append(f"  {path}: {'added' if old is None else 'gone'}")
        elif old["size"] != new["size"]:
            lines.append(f"  {path}: {old['size']} bytes -> {new['size']} bytes")
        elif "sha256" in old and "sha256" in new and old["sha256"] != new["sha256"]:
            lines.append(f"  {path}: sha256 {old['sha256'][:12]}... -> {new['sha256'][:12]}...")
    return lines


def _files_now(cfg: DataConfig, path: str) -> list[dict[str, Any]]:
    if cfg.source == "synthetic":  # made from the settings alone
        return []
    if cfg.source == "prepared":  # a store never changes: its manifest is its source
        found = store_of(cfg, None, path)
        return [] if found is None else _manifest_files(found[1])
    try:
        files = sources.source_files(cfg.source, path)
    except (FileNotFoundError, ValueError):  # building the data names the problem
        return []
    return [{"path": str(p), "size": p.stat().st_size} for p in files]


def _manifest_files(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"path": f["path"], "size": f["size"], "sha256": f["sha256"]}
        for f in manifest["source"]["files"]
    ]


def store_of(
    cfg: DataConfig, prepared: pathlib.Path | None, path: str | None = None
) -> tuple[pathlib.Path, dict[str, Any]] | None:
    """The directory and manifest of the store the data of ``path`` (default ``data.path``) are
    read from (``path`` for a prepared source, the run's store in ``prepared`` of a file
    source), if there is one yet."""
    path = cfg.path if path is None else path
    if cfg.source == "synthetic":
        return None
    if cfg.source == "prepared":
        candidates = [pathlib.Path(path) / MANIFEST]
    elif prepared is None:
        return None
    else:
        found = prepared.glob(f"{cfg.source}-*/{MANIFEST}")
        # A cached store is <source>-<hex>; one moved aside by --force has a .old<N> suffix.
        candidates = sorted(p for p in found if "." not in p.parent.name)
    for candidate in candidates:
        try:
            manifest = json.loads(candidate.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        made_from = manifest.get("source", {})
        documents = cfg.text_documents or "file" if cfg.source == "text" else None
        if cfg.source == "prepared" or (
            made_from.get("path") == path and made_from.get("documents") == documents
        ):
            return candidate.parent, manifest
    return None
