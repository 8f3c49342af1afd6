"""Have a run's inputs changed? ``RUN/inputs.json`` (written when the data are built:
:mod:`flaxformer_lite.data.inputs`) read back and compared with the inputs as they are now.

    recorded = read_inputs(run.inputs)
    changes = input_changes(recorded, current_inputs(cfg.data)) if recorded else []
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from flaxformer_lite.train.config import flatten


def read_inputs(path: pathlib.Path) -> dict[str, Any] | None:
    """The inputs recorded in ``path``, or None when the run has no record (an older run)."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise ValueError(f"{path}: not a record of the run's inputs ({error})") from None


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
