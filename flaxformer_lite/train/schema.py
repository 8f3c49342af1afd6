"""Typed values from plain ones: a frozen dataclass built from nested mappings (YAML, JSON) and
command-line text, every key and type checked, with a message that names the key. The schema
itself, :class:`~flaxformer_lite.train.config.TrainConfig`, is in ``config.py``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

from flaxformer_lite.data import DataConfig
from flaxformer_lite.models.config import ModelConfig
from flaxformer_lite.models.presets import PRESETS

# Every integer setting fits an int32 (step counters, sizes, seeds): a larger one would pass the
# checks and fail late (an OverflowError, islice), after the trained steps were lost.
INT_LIMIT = 2**31


class ConfigError(ValueError):
    """A configuration the user wrote is wrong; the message names the key or the file."""


class UnknownKeyError(ConfigError):
    """A key that its section does not have; ``config_from_dict`` adds the closest valid key
    of the whole schema to the message."""

    def __init__(self, key: str):
        super().__init__(f"unknown config key {key!r}")
        self.key = key


class OverrideText(str):
    """A value typed on the command line: parsed according to the field it lands in."""


def build(cls, values: Any, where: str, base: Mapping[str, Any] | None = None):
    """``cls`` from ``values`` laid over ``base`` (the defaults of the enclosing config), or
    over a model preset when ``values`` name one."""
    if isinstance(values, cls):
        return values
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where.rstrip('.') or 'the config'} must be a mapping, got {values!r}")
    values = dict(values)
    if cls is ModelConfig and "preset" in values:
        name = values.pop("preset")
        if name not in PRESETS:
            close = difflib.get_close_matches(str(name), PRESETS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown model preset {where}preset={name!r}{hint}")
        base = PRESETS[name]
    hints = typing.get_type_hints(cls)
    fields = {field.name: field for field in dataclasses.fields(cls)}
    for key in values:
        if key not in fields:
            raise UnknownKeyError(where + str(key))
    kwargs = {}
    for key, value in {**(base or {}), **values}.items():
        section_base = None
        if key in values:  # a section given in part is laid over its preset or default
            inherited = (base or {}).get(key)
            section_base = (
                inherited if isinstance(inherited, Mapping) else _default_dict(fields[key])
            )
        kwargs[key] = coerce(hints[key], value, where + key, section_base)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as error:
        message = str(error)
        if where and message.startswith(where):  # it names its key already: data.seq_len ...
            raise ConfigError(message) from None
        raise ConfigError(f"{where.rstrip('.') or 'config'}: {message}") from None


def _default_dict(field: dataclasses.Field) -> dict[str, Any] | None:
    """The default of a section (or mapping) field as plain values (None for other leaves)."""
    default = field.default
    if field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    # Derived defaults follow the values laid over them.
    if isinstance(default, (ModelConfig, DataConfig)):
        return default.to_dict(derived=False)
    if dataclasses.is_dataclass(default):
        return dataclasses.asdict(default)
    return dict(default) if isinstance(default, Mapping) else None


def coerce(annotation, value, key: str, base: Mapping[str, Any] | None = None):
    """``value`` as the type ``annotation`` names, or a ConfigError naming ``key``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if isinstance(value, OverrideText) and value.strip().lower() in ("none", "null", "~"):
            value = None
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return coerce(option, value, key, base)
            except ConfigError as error:
                errors.append(error)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(f"{key}: {value!r} fits none of {options}")
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, OverrideText):
            raise ConfigError(f"{key} is a section; set its keys, e.g. {key}.<name>=...")
        return build(annotation, value, key + ".", base)
    if origin is dict:  # entries laid over the default mapping, one by one
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key} is a mapping; set its entries, e.g. {key}.<name>=...")
        _, value_type = typing.get_args(annotation)
        merged = {**(base or {}), **value}
        return {str(k): coerce(value_type, v, f"{key}.{k}") for k, v in merged.items()}
    if origin is tuple:  # tuple[item, ...]: a list, one item, none; "a,b" or "[a,b]" as text
        item_type = typing.get_args(annotation)[0]
        if isinstance(value, OverrideText):
            text = value.strip()
            if text.startswith("[") and text.endswith("]"):  # as --help and YAML write it
                text = text[1:-1]
            value = [] if text.lower() in ("", "none", "null", "~") else text.split(",")
            value = [OverrideText(item.strip()) for item in value]
        if value is None or isinstance(value, str):
            value = [] if value is None else [value]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key} must be a list, got {type(value).__name__} {value!r}")
        return tuple(coerce(item_type, item, key) for item in value)
    if isinstance(value, OverrideText):
        value = str(value) if annotation is str else _parse_text(value, annotation, key)
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    if annotation in (int, float, bool, str):
        if type(value) is not annotation:
            raise ConfigError(
                f"{key} must be {annotation.__name__}, got {type(value).__name__} {value!r}"
            )
        if annotation is int and not -INT_LIMIT <= value < INT_LIMIT:
            bound = f"at most {INT_LIMIT - 1:,}" if value > 0 else f"at least {-INT_LIMIT:,}"
            raise ConfigError(f"{key} must be {bound} (an int32), got {value}")
        return value
    raise ConfigError(f"{key}: unsupported type {annotation}")


def _parse_text(text: str, annotation, key: str):
    text = text.strip()
    if annotation is bool:
        lowered = text.lower()
        if lowered in ("true", "yes", "1"):
            return True
        if lowered in ("false", "no", "0"):
            return False
        raise ConfigError(f"{key} must be true or false, got {text!r}")
    try:
        return annotation(text)
    except ValueError:
        if annotation is float:
            raise ConfigError(f"{key} must be a number, got {text!r}") from None
        if annotation is int:
            raise ConfigError(f"{key} must be an integer, got {text!r}") from None
        raise
