"""How a command ends: an error the user can fix (config, data, files, the disk) prints one line
and the command exits with status 2, without a traceback; SIGINT / SIGTERM end it with
128 + signal (the training loop first saves a checkpoint)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable

from flaxformer_lite.cli.platforms import skip_absent_tpu
from flaxformer_lite.train.config import ConfigError

# OSError: unreadable, unwritable or corrupt files, a full disk (CheckpointError is one).
USER_ERRORS = (ConfigError, ValueError, OSError)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def guarded(fn: Callable[[], int]) -> int:
    """``fn()``'s exit status, or 2 after printing ``error: ...`` for one of :data:`USER_ERRORS`;
    a stop signal while ``fn`` runs ends the process (:func:`exit_on_signals`)."""
    skip_absent_tpu()
    try:
        with exit_on_signals():
            return fn()
    except USER_ERRORS as error:
        say(f"error: {error}", stream=sys.stderr)
        return 2


@contextlib.contextmanager
def exit_on_signals():
    """SIGINT / SIGTERM end the process at once with status 128 + signal and one line, whatever
    it is doing: a ``KeyboardInterrupt`` raised inside JAX's start-up (model initialization,
    compiling) leaves its threads in a state that crashes the interpreter's exit. Code that
    must finish something first (the training loop, a checkpoint) installs its own handler
    meanwhile. The previous handlers are restored after."""

    def stop(signum, _frame):
        say(f"stopped by {signal.Signals(signum).name}", stream=sys.stderr)
        os._exit(128 + signum)  # no interpreter shutdown: nothing of a half-built run to keep

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def notice(message: str) -> None:
    """Says ``message`` on stderr, as a notice: what the command did differently from what it
    was told, without stopping (stdout may be a command's result, as ``config``'s YAML)."""
    say(f"notice: {message}", stream=sys.stderr)


def say(message: str, stream=None) -> None:
    """Prints ``message`` to ``stream`` (default stdout) at once, so it shows before a long step."""
    print(message, file=stream or sys.stdout, flush=True)
