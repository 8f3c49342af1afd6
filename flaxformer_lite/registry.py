"""One way to register a choice: a :class:`Registry` holds the names a setting accepts, the
built-in ones (each its object, or the import path of one whose module would import JAX,
imported when first read, so that checking a name imports nothing) and those a user registers;
a model's setting may also name code by import path ``package.module:attr``, imported only
inside :func:`trusted_code`. Imports no JAX.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any

IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
TRUST_FLAG = "--trust-code (trust_code=True in Python)"

_TRUSTED: contextvars.ContextVar[bool] = contextvars.ContextVar("trusted_code", default=False)


@contextlib.contextmanager
def trusted_code(trust: bool = True) -> Iterator[None]:
    """Within the block, import paths in model settings are imported if ``trust`` (the
    commands' ``--trust-code``; ``load_run(..., trust_code=True)`` and the like use this). A
    block inside a trusted one stays trusted."""
    token = _TRUSTED.set(_TRUSTED.get() or bool(trust))
    try:
        yield
    finally:
        _TRUSTED.reset(token)


def is_import_path(value: Any) -> bool:
    """Whether ``value`` is written as an import path ``package.module:attr``."""
    return isinstance(value, str) and IMPORT_PATH.match(value) is not None


class Registry(Mapping):
    """The names one setting accepts, each standing for an object that meets ``contract``: a
    read-only mapping of name -> object (the built-in ones first, in order), a user's added by
    :meth:`register`; where the setting may name code by import path (the model's pieces),
    :meth:`resolve` imports it.

    Args:
      setting: the setting, ``model.mixer``.
      contract: what a registered object is, in a line (for error messages).
      builtin: name -> each built-in object, or its import path ``module:attr``, imported when
        the name is first read (so that checking a name imports nothing).
      entry: the import path of ``entry(name, obj)``, which makes a user's object the entry
        kept under its name (an attention function its ``Backend``); default: the object.
      imports: whether the setting may name code by import path.
    """

    def __init__(
        self,
        setting: str,
        contract: str,
        builtin: Mapping[str, Any],
        entry: str | None = None,
        imports: bool = True,
    ):
        self.setting, self.contract, self.imports = setting, contract, imports
        self.builtin = tuple(builtin)
        self.entries: dict[str, Any] = dict(builtin)  # a built-in's import path until read
        self._entry = entry

    def __getitem__(self, name: str) -> Any:
        entry = self.entries[name]
        if name in self.builtin and isinstance(entry, str):
            entry = self.entries[name] = _attribute(entry)
        return entry

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def register(self, name: str, obj: Any) -> None:
        """Makes ``obj`` the piece ``name`` (replacing a name registered before, not a built-in
        one); settings and overrides then take ``name``."""
        if not isinstance(name, str) or not re.fullmatch(r"[\w.-]+", name):
            raise ValueError(
                f"a {self.setting} name is letters, digits, _, - and ., got {name!r} (import "
                "paths module:attr need no registering)"
            )
        if name in self.builtin:
            raise ValueError(f"{self.setting}={name!r} is built in; register under another name")
        if not callable(obj):
            raise ValueError(f"{self.setting}={name!r} must be callable ({self.contract})")
        self.entries[name] = self._made(name, obj)

    def _made(self, name: str, obj: Any) -> Any:
        return obj if self._entry is None else _attribute(self._entry)(name, obj)

    def check(self, value: Any) -> None:
        """Raises a ValueError unless ``value`` is a registered name or an import path; a plain
        name is said to be maybe one registered in another process (a run's config names the
        piece, not its code)."""
        if value in self.entries or (self.imports and is_import_path(value)):
            return
        if not self.imports:
            raise ValueError(f"{self.setting} must be one of {', '.join(self)}, got {value!r}")
        setting = self.setting.removeprefix("model.")
        unknown = (
            f"{setting} must be one of {tuple(self.entries)} or an import path module:attr, got "
            f"{value!r}"
        )
        if isinstance(value, str) and re.fullmatch(r"[\w.-]+", value):
            unknown += (
                f"; a name registered in Python lasts as long as its process: register "
                f"{value!r} again in this one (flaxformer_lite.register_"
                f"{setting.removesuffix('_implementation')}), or name the code by import path"
            )
        raise ValueError(unknown)

    def resolve(self, value: str) -> Any:
        """The object ``value`` names; an import path is imported (only in trusted code) and
        registered under its path.

        Raises:
          ValueError: an unknown name; an import path outside :func:`trusted_code`, that does
            not import, or whose attribute is missing or not callable.
        """
        if value in self.entries:
            return self[value]
        self.check(value)
        module_name, _, attr = value.partition(":")
        if not _TRUSTED.get():
            raise ValueError(
                f"{self.setting}={value!r} names code to import (module {module_name}); "
                f"importing runs it: pass {TRUST_FLAG} if you trust it"
            )
        obj = _imported(module_name, self.setting, value)
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise ValueError(f"{self.setting}={value!r}: {module_name} has no attribute {attr}")
            obj = getattr(obj, part)
        if not callable(obj):
            raise ValueError(
                f"{self.setting}={value!r} is a {type(obj).__name__}, not callable; expected "
                f"{self.contract}"
            )
        self.entries[value] = self._made(value, obj)
        return self.entries[value]

    def is_builtin(self, value: Any) -> bool:
        return value in self.builtin


def _attribute(path: str) -> Any:
    """The object of a built-in import path ``module:attr``."""
    module_name, _, attr = path.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def _imported(module_name: str, setting: str, value: str):
    """The module ``module_name``, imported with the current directory on the path (as
    ``python -m`` has it)."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except Exception as error:  # the user's module may raise anything while importing
        raise ValueError(
            f"{setting}={value!r}: importing {module_name} failed "
            f"({type(error).__name__}: {first_line(error)})"
        ) from error
    finally:
        if added:
            sys.path.remove(cwd)


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else ""
