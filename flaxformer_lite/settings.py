"""Config fields that carry their help: ``name: int = setting(3, help="what it means")`` is a
dataclass field whose one line of help sits beside its default, the line ``flaxformer-lite
config`` prints for it (:mod:`flaxformer_lite.train.config_help`). Every field of the run's
config is one (``tests/test_cli_help.py`` checks)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    factory: Callable[[], Any] | Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with ``default`` (or ``factory()``, for a mutable default) and its
    ``help``, read back by :func:`help_of`."""
    return dataclasses.field(default=default, default_factory=factory, metadata={"help": help})


def help_of(field: dataclasses.Field) -> str | None:
    """The help of a :func:`setting` field; None for another field."""
    return field.metadata.get("help")


def flatten(values: Mapping, prefix: str = "") -> dict[str, Any]:
    """``{dotted key: value}`` of the leaves of nested ``values``."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat
