"""Programs compiled on a thread of their own while the first train steps run: the evaluation's
step and its decoding (:meth:`.actions.Evaluate.compile`), which a run would otherwise compile
at its first evaluation, in the way of the steps after it.

The thread lowers and compiles the very jitted functions the evaluation calls, for the shapes and
shardings it will call them with, so the compiled executables land in JAX's caches and the
evaluation's calls find them there: the same programs, hence the same results, as compiling them
at the evaluation. The evaluation waits for the thread first; that wait is the run's compilation
(:class:`~.time_spent.TimeSpent`). A program the thread could not compile is compiled where it
is called, and fails there if it fails.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from flaxformer_lite.train.time_spent import TimeSpent

logger = logging.getLogger(__name__)


class BackgroundCompile:
    """One compile thread: :meth:`start` it once, :meth:`wait` for it before the programs run,
    :meth:`close` it with the run."""

    def __init__(self, spent: TimeSpent):
        self.spent = spent
        self._thread: threading.Thread | None = None

    def start(self, compile_programs: Callable[[], None]) -> None:
        """Runs ``compile_programs`` on a new thread."""
        self._thread = threading.Thread(
            target=_quietly, args=(compile_programs,), name="background-compile", daemon=True
        )
        self._thread.start()

    def wait(self) -> None:
        """Returns once the thread (if started) is done; the wait counts as compilation."""
        if self._thread is None or not self._thread.is_alive():
            return
        with self.spent.waiting_for_compilation():
            self._thread.join()

    def close(self) -> None:
        """Waits for the thread, so that it never outlives the run (a run stopped before its first
        evaluation); the wait counts as compilation too."""
        self.wait()


def _quietly(compile_programs: Callable[[], None]) -> None:
    # The evaluation compiles what failed here, where it is called, and raises there if it fails;
    # a warning says the thread failed, so that a broken compile path does not go unseen.
    try:
        compile_programs()
    except Exception as error:
        logger.warning(
            "the evaluation's programs did not compile in the background (%s: %s); the "
            "evaluation compiles them itself",
            type(error).__name__,
            error,
        )
