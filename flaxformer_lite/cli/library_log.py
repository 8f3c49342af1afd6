"""Where the libraries' own log records go: to a file in the run directory, not the terminal.

Orbax logs a failed save's traceback from each of its threads (through absl), TensorStore errors
carry a many-line spec of the array, asyncio reports closed event loops and never-awaited
coroutines of cancelled saves: the command says what went wrong in one line, and this file keeps
the details for whoever wants them. Some of these are not log records: TensorStore's threads
report an exception they cannot hand back ("Event loop is closed", when a failed save or restore
has closed orbax's event loop) through ``sys.unraisablehook``, as Python does for a coroutine
garbage-collected with an exception in it; a thread's uncaught exception goes through
``threading.excepthook``. Both are logged here too (this package's own threads hand their errors
to the thread that waits for them).
"""

from __future__ import annotations

import logging
import pathlib
import sys
import threading

UNRAISABLE, THREADS = "py.unraisable", "py.threads"  # the loggers of the two hooks
LIBRARY_LOGGERS = (
    "absl",
    "asyncio",
    "py.warnings",
    UNRAISABLE,
    THREADS,
    "jax",
    "orbax",
    "tensorstore",
)


def library_log_to(path: pathlib.Path | None) -> None:
    """Sends the records of :data:`LIBRARY_LOGGERS` (Python warnings, unraisable exceptions and
    threads' uncaught exceptions included) to ``path`` (appended, created at the first record),
    or nowhere with ``None``. This package's own warnings still reach the terminal (as
    :func:`plain_terminal_records` writes them); the whole errors they shorten are logged at
    debug level."""
    logging.captureWarnings(True)
    sys.unraisablehook = _log_unraisable
    threading.excepthook = _log_thread_exception
    handler = _QuietFileHandler(path) if path is not None else logging.NullHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False


def plain_terminal_records() -> None:
    """Records that reach the terminal read as the commands' other lines (``warning: ...``).

    absl's first record (orbax logs one as it is imported) calls ``logging.basicConfig()``, whose
    handler prints ``WARNING:flaxformer_lite.train.checkpoint:...``; setting the root logger up
    first makes absl's call do nothing, and a handler it set up already is given this format."""
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(_Stderr())
    for handler in root.handlers:
        if type(handler) in (logging.StreamHandler, _Stderr):
            handler.setFormatter(_Plain())


class _Plain(logging.Formatter):
    """``warning: message``, the level in lower case as in the commands' ``error: ...`` lines."""

    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {super().format(record)}"


class _Stderr(logging.StreamHandler):
    """A handler that writes to ``sys.stderr`` as it is at each record (as
    ``logging.lastResort`` does), so a replaced ``sys.stderr`` is followed."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _stream) -> None:
        pass


def _log_unraisable(unraisable) -> None:
    """``sys.unraisablehook``: the report Python would print, as a record of :data:`UNRAISABLE`."""
    where = f": {unraisable.object!r}" if unraisable.object is not None else ""
    logging.getLogger(UNRAISABLE).error(
        "%s%s",
        unraisable.err_msg or "Exception ignored",
        where,
        exc_info=(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback),
    )


def _log_thread_exception(args) -> None:
    """``threading.excepthook``: the report Python would print, as a record of :data:`THREADS`
    (a ``SystemExit`` ends its thread quietly, as by default)."""
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "a thread"
    logging.getLogger(THREADS).error(
        "exception in %s", name, exc_info=(args.exc_type, args.exc_value, args.exc_traceback)
    )


class _QuietFileHandler(logging.FileHandler):
    """A log file that is opened at its first record (the run directory exists by then) and
    whose own failures (an unwritable directory) are not reported: the command reports them."""

    def __init__(self, path: pathlib.Path):
        super().__init__(path, delay=True)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            super().emit(record)  # opening the file (at the first record) may fail too
        except OSError:
            self.handleError(record)

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        pass
