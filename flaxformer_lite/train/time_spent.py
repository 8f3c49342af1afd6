"""Where a run's wall time went, for its closing line::

    done: runs/default (loss 0.01, ...); 61.2 s: start-up 3.1 s, data 2.5 s, compilation 5.6 s,
    steps 45.0 s, evaluations 3.0 s, tasks 1.1 s, checkpoints 1.2 s, plots 0.8 s

The parts add up to the wall time by construction. Compilation is JAX's own account of its
tracing, lowering and compiling (or reading back from the cache) on the run's own thread (the
first step, a program the background compile had not ready), and the time that thread waits for
the background compile (:mod:`.background_compile`); compiling on other threads while the steps
run is not counted, since the run does not wait for it: where it takes the cores from the steps,
it shows in the steps' time. Data, evaluations, tasks (downstream), checkpoints and
plots are the spans the loop times, less the compilation inside them (the plots, drawn while the
last checkpoint is written, count what the run waits for them past it); start-up and steps are
what remains before the loop begins and after (steps: dispatching them and waiting for the
devices).
"""

from __future__ import annotations

import contextlib
import threading
import time

PARTS = (
    "start-up",
    "data",
    "compilation",
    "steps",
    "evaluations",
    "tasks",
    "checkpoints",
    "plots",
)
OPTIONAL_PARTS = ("tasks",)  # parts a run without them does not list
# JAX's events around tracing a function, lowering it to MLIR and compiling it (or reading it
# from the cache); they nest for nested jits, so the compilation is the union of their spans.
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


class TimeSpent:
    """A run's wall time from ``started`` (a ``time.perf_counter()``; default: now), split into
    :data:`PARTS`. A context manager: JAX's compilation on the thread that creates it is counted
    while it is open."""

    def __init__(self, started: float | None = None):
        self.started = time.perf_counter() if started is None else started
        self.seconds = dict.fromkeys(PARTS, 0.0)
        # The remainder (what no part times) is start-up outside the loops, steps inside them:
        # each one's share up to the last boundary, and the remainder at that boundary.
        self._between = {"start-up": 0.0, "steps": 0.0}
        self._mark, self._in_loop = 0.0, False
        self._spans: list[tuple[float, float]] = []  # the outermost compile spans so far
        self._compiling = 0.0  # their total
        self._thread = threading.get_ident()  # the run's: its compilation is what is counted

    def __enter__(self) -> TimeSpent:
        from jax import monitoring

        monitoring.register_event_time_span_listener(self._compile_span)
        return self

    def __exit__(self, *exc) -> None:
        from jax import monitoring

        monitoring.unregister_event_time_span_listener(self._compile_span)

    def _compile_span(self, event: str, start_time: float, end_time: float, **kwargs) -> None:
        # Spans of other threads overlap this one's: counted too, they would be counted twice.
        if event not in _COMPILE_EVENTS or threading.get_ident() != self._thread:
            return
        self._count_compiling(start_time, end_time)

    def _count_compiling(self, start_time: float, end_time: float) -> None:
        # An outer span arrives after the inner ones it contains.
        while self._spans and self._spans[-1][0] >= start_time:
            start, end = self._spans.pop()
            self._compiling -= end - start
        self._spans.append((start_time, end_time))
        self._compiling += end_time - start_time

    @contextlib.contextmanager
    def waiting_for_compilation(self):
        """Counts the time inside the block, where this thread waits for programs compiled on
        another, as compilation."""
        started = time.time()
        try:
            yield
        finally:
            self._count_compiling(started, time.time())

    @contextlib.contextmanager
    def part(self, name: str):
        """Counts the time inside the block, less its compilation, to the part ``name``."""
        compiling, started = self._compiling, time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - started - (self._compiling - compiling))

    def add(self, name: str, seconds: float) -> None:
        """``seconds`` more of the part ``name`` (a span the caller timed, with no compilation)."""
        self.seconds[name] += seconds

    def loop_begins(self) -> None:
        """The start-up ends: what remains from here on is the steps' (until :meth:`loop_ends`)."""
        self._boundary()

    def loop_ends(self) -> None:
        """A loop ends: what remains from here on is start-up again (a sweep's next program)."""
        self._boundary()

    def _boundary(self) -> None:
        now = self._remainder()
        self._between["steps" if self._in_loop else "start-up"] += now - self._mark
        self._mark, self._in_loop = now, not self._in_loop

    def _remainder(self) -> float:
        timed = sum(self.seconds[name] for name in PARTS if name not in ("start-up", "steps"))
        return time.perf_counter() - self.started - self._compiling - timed

    def parts(self) -> dict[str, float]:
        """Seconds per part so far, in :data:`PARTS` order; they sum to the wall time since
        ``started`` at the moment of the call."""
        since = dict(self._between)
        since["steps" if self._in_loop else "start-up"] += self._remainder() - self._mark
        return self.seconds | since | {"compilation": self._compiling}

    def summary(self) -> str:
        """``61.2 s: start-up 3.1 s, data 2.5 s, ...``: the wall time and its parts (tasks only
        where a run scored some)."""
        parts = self.parts()
        shown = {name: s for name, s in parts.items() if s or name not in OPTIONAL_PARTS}
        listed = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in shown.items())
        return f"{sum(parts.values()):.1f} s: {listed}"
