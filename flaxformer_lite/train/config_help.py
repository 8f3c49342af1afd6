"""The resolved config as YAML with each key's type, default and help as a comment
(``train.py --show-config``, ``flaxformer-lite config``).

Each key's help is declared with the field itself (:func:`~flaxformer_lite.settings.setting`),
in one place; ``tests/test_cli_help.py`` checks that every field has it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import yaml

from flaxformer_lite.settings import help_of
from flaxformer_lite.train.config import TrainConfig


def help_lines(cls=TrainConfig, prefix: str = "") -> dict[str, str]:
    """``{dotted key: help}`` of every field of the schema, sections included, from the
    :func:`~flaxformer_lite.settings.setting` that declares it.

    Raises:
      TypeError: a field declared without its help.
    """
    lines = {}
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        key = prefix + field.name
        if not help_of(field):
            raise TypeError(f"config key {key} has no help: declare it with settings.setting")
        lines[key] = help_of(field)
        if not prefix and dataclasses.is_dataclass(hints[field.name]):
            lines |= help_lines(hints[field.name], key + ".")
    return lines


_SECTIONS = tuple(
    name
    for name, hint in typing.get_type_hints(TrainConfig).items()
    if dataclasses.is_dataclass(hint)
)


def leaf_keys(cls=TrainConfig, prefix: str = "") -> dict[str, Any]:
    """``{dotted key: type annotation}`` of every leaf of the schema, in field order."""
    leaves = {}
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        annotation = hints[field.name]
        if not prefix and dataclasses.is_dataclass(annotation):
            leaves |= leaf_keys(annotation, f"{prefix}{field.name}.")
        else:
            leaves[prefix + field.name] = annotation
    return leaves


def annotated_yaml(cfg: TrainConfig) -> str:
    """``cfg`` as YAML, every key preceded by a comment with its type, default and help;
    ``yaml.safe_load`` of it gives ``cfg.to_dict()``."""
    values, defaults = _flatten(cfg.to_dict()), _flatten(TrainConfig().to_dict())
    helps = help_lines()
    lines = [
        "# The resolved configuration: every key with its type, default and meaning.",
        "# Save it as a file for --config, or set any key with key=value.",
    ]
    section = None
    for key, annotation in leaf_keys().items():
        head, _, name = key.rpartition(".")
        if head != section:
            section = head
            lines += ["", f"{head}:  # {helps[head]}"] if head else [""]
        indent = "  " if head else ""
        default = _flow(defaults[key])
        if isinstance(defaults[key], dict) and defaults[key] and defaults[key] == values[key]:
            default = "the entries below"
        lines.append(f"{indent}# {type_name(annotation)}, default {default}: {helps[key]}")
        lines += _entry(indent, name, values[key])
    return "\n".join(lines) + "\n"


def type_name(annotation) -> str:
    """``int``, ``str | None``, ``tuple[str, ...]``, ``dict[str, int | bool]``, ..."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else type_name(a) for a in args)
    if origin is tuple:
        return f"tuple[{type_name(args[0])}, ...]"
    if origin is dict:
        return f"dict[{type_name(args[0])}, {type_name(args[1])}]"
    return getattr(annotation, "__name__", str(annotation))


def _entry(indent: str, name: str, value) -> list[str]:
    """``name: value`` in YAML, a non-empty mapping as one line per entry below its name."""
    if isinstance(value, dict) and value:
        return [f"{indent}{name}:"] + [f"{indent}  {k}: {_flow(v)}" for k, v in value.items()]
    return [f"{indent}{name}: {_flow(value)}"]


def _flow(value) -> str:
    """One value as single-line YAML (``null``, ``[a, b]``, ``{}``, a quoted string if needed)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1_000_000)
    return text.removesuffix("\n...\n").removesuffix("\n")


def _flatten(values: dict, prefix: str = "") -> dict[str, Any]:
    """Sections flattened to dotted keys; other mappings (``mesh.rules``) stay values."""
    flat = {}
    for key, value in values.items():
        if key in _SECTIONS and not prefix:
            flat |= _flatten(value, f"{key}.")
        else:
            flat[prefix + key] = value
    return flat
