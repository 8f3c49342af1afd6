"""What a run's data depend on, its inputs' fingerprint: the ``data`` settings and the source
files (path and size, and sha256 where a prepared store's manifest has it: the store hashed them,
this module never does). :meth:`~flaxformer_lite.data.plan.DataPlan.build` records it in
``RUN/inputs.json`` when the run's data are built; resuming reads it back and compares it with
the inputs as they are now, once:

    recorded = read_inputs(run.inputs)
    now = current_inputs(cfg.data)
    settings, files = setting_changes(recorded, now), file_changes(recorded, now)
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

from flaxformer_lite.data.config import DataConfig, settled_parts
from flaxformer_lite.data.sources import SOURCES
from flaxformer_lite.data.store import MANIFEST
from flaxformer_lite.settings import flatten


def current_inputs(cfg: DataConfig) -> dict[str, Any]:
    """The data settings and the source files as they are now (sizes only: cheap)."""
    files = [f for part, path in cfg.paths().values() for f in _files_now(part, path)]
    return {"data": dataclasses.asdict(cfg), "files": files}


def built_inputs(cfg: DataConfig, prepared: pathlib.Path) -> dict[str, Any]:
    """The inputs the run's data were just built from: :func:`current_inputs` with each
    file's sha256 from the prepared store's manifest (``data.path`` and
    ``data.validation_path`` for prepared sources, the run's stores in ``prepared`` of text,
    jsonl or parallel ones)."""
    inputs = current_inputs(cfg)
    files = []
    for part, path in cfg.paths().values():
        found = store_of(part, prepared, path)
        files += _files_now(part, path) if found is None else _manifest_files(found[1])
    inputs["files"] = files
    return inputs


def write_inputs(path: pathlib.Path, inputs: dict[str, Any]) -> None:
    """Writes the record ``path`` aside and renames it: a killed write keeps the old record."""
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(inputs, indent=1) + "\n", encoding="utf-8")
    partial.replace(path)


def read_inputs(path: pathlib.Path) -> dict[str, Any] | None:
    """The inputs recorded in ``path``, or None when the run has no record (an older run)."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise ValueError(f"{path}: not a record of the run's inputs ({error})") from None


def setting_changes(recorded: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple]:
    """``data.<key>`` (a mixture's sources key by key) -> ``(before, now)`` of each setting
    that differs, but for changes that give the same data from the source
    (:meth:`~flaxformer_lite.data.sources.Source.same_setting`)."""
    before, now = dict(recorded.get("data", {})), current["data"]
    recorded_source = SOURCES.get(before.get("source"))
    if recorded_source is not None:
        before = {**recorded_source.unrecorded, **before}
    source = SOURCES[now["source"]]
    before, now = flatten(settled_parts(before)), flatten(settled_parts(now))
    return {
        f"data.{key}": (source.settled(key, before.get(key)), source.settled(key, now.get(key)))
        for key in sorted(before.keys() | now.keys())
        if not source.same_setting(key, before.get(key), now.get(key))
    }


def file_changes(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One ``  path: what`` line per file added, gone or changed: by size, and by sha256
    where both sides have it."""
    lines = []
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
    source = cfg.reader
    if not source.made_by_run:  # a given store never changes: its manifest is its source
        found = store_of(cfg, None, path)
        return [] if found is None else _manifest_files(found[1])
    try:
        files = source.files(path)
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
    read from (where the source keeps it: ``path`` for a prepared source, the run's
    cache in ``prepared`` for a source of files), if there is one yet."""
    path = cfg.path if path is None else path
    source = cfg.reader
    if not source.stored or (source.made_by_run and prepared is None):
        return None
    directory = source.store_at(path, prepared)
    try:
        return directory, json.loads((directory / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
