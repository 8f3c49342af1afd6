"""How a command ends: an error the user can fix (config, data, files) prints one line and the
command exits with status 2, without a traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable

from flaxformer_lite.train.config import ConfigError

USER_ERRORS = (ConfigError, ValueError, FileNotFoundError, NotADirectoryError)


def guarded(fn: Callable[[], int]) -> int:
    """``fn()``'s exit status, or 2 after printing ``error: ...`` for one of :data:`USER_ERRORS`."""
    try:
        return fn()
    except USER_ERRORS as error:
        say(f"error: {error}", stream=sys.stderr)
        return 2


def say(message: str, stream=None) -> None:
    """Prints ``message`` to ``stream`` (default stdout) at once, so it shows before a long step."""
    print(message, file=stream or sys.stdout, flush=True)
