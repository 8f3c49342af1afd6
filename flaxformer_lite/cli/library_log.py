"""Where the libraries' own log records go: to a file in the run directory, not the terminal.

Orbax logs a failed save's traceback from each of its threads (through absl), TensorStore errors
carry a many-line spec of the array, asyncio reports closed event loops and never-awaited
coroutines of cancelled saves: the command says what went wrong in one line, and this file keeps
the details for whoever wants them.
"""

from __future__ import annotations

import logging
import pathlib

LIBRARY_LOGGERS = ("absl", "asyncio", "py.warnings", "jax", "orbax", "tensorstore")


def library_log_to(path: pathlib.Path | None) -> None:
    """Sends the records of :data:`LIBRARY_LOGGERS` (Python warnings included) to ``path``
    (appended, created at the first record), or nowhere with ``None``. This package's own
    warnings still reach the terminal; the whole errors they shorten are logged at debug
    level."""
    logging.captureWarnings(True)
    handler = _QuietFileHandler(path) if path is not None else logging.NullHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False


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
