"""``train.py``'s loop against its train step alone, in one process: what ``train_step.py
--train-py`` and ``data.py`` share.

A short run of the loop (:func:`flaxformer_lite.train.loop.run`, what ``train.py`` runs) takes
``2 * steps`` steps and logs tokens/s twice; the last log covers its last ``steps`` steps, after
the compiling step and a warm-up. Each run is paired with windows of the step timed right before
and right after it, so that the shared machine's changes of speed, which last minutes, hit both
sides of each comparison alike: its share is the logged tokens/s over the step's, taken from
the mean seconds per step of those two windows. The median share is what a benchmark reports.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time
from unittest import mock

import jax

from flaxformer_lite.process import use_compilation_cache
from flaxformer_lite.train import loop
from flaxformer_lite.train.config import TrainConfig, load_config
from flaxformer_lite.train.metrics import read_metrics

# jax.monitoring's events for tracing, lowering and compiling a program.
COMPILE_EVENTS = "/jax/core/compile/"


def short_run_overrides(run_dir, steps: int) -> dict:
    """The overrides that make a run of ``2 * steps`` steps whose last log is its steady state:
    one evaluation of one batch and one checkpoint, at the end, no decoded examples, and a
    warmup of one step (the schedule's constants change, not the computation)."""
    total = 2 * steps
    return {
        "run_dir": run_dir,
        "train.steps": total,
        "train.log_every": steps,
        "train.eval_every": total,
        "train.eval_batches": 1,
        "train.decode_examples": 0,
        "checkpoint.every": total,
        "optimizer.warmup_steps": 1,
    }


def logged_tokens_per_sec(cfg: TrainConfig) -> float:
    """Runs the loop on ``cfg`` (a fresh run directory) and returns its last logged tokens/s."""
    use_compilation_cache(cfg.train.compilation_cache)  # as train.py does
    loop.run(cfg, progress=False, log=lambda _: None)
    return read_metrics(cfg.run_dir)[-1]["tokens_per_sec"]


def paired_shares(logged: list[float], between: list[float], tokens_per_step: int) -> list[float]:
    """Run ``i``'s logged tokens/s over the step's in the windows ``between[i]`` and
    ``between[i + 1]`` (seconds per step) timed right before and after it."""
    return [
        tokens_per_sec * (between[i] + between[i + 1]) / 2 / tokens_per_step
        for i, tokens_per_sec in enumerate(logged)
    ]


def train_py_against_step(
    overrides: list[str],
    steps: int,
    windows: int,
    directory: pathlib.Path,
    config: pathlib.Path | None = None,
) -> dict:
    """``windows`` fresh runs of train.py's loop on ``config`` (default: the embedded one) with
    ``overrides``, each between two windows of ``steps`` steps of the step alone; the window
    after a run times the step that run compiled. One more run comes first: it compiles and
    only opens the first window. Tokens count ``batch_size * seq_len`` per step on both sides,
    as the loop logs them."""

    def fresh_run(number: int) -> tuple[LoopRun, int]:
        short = short_run_overrides(directory / f"run{number}", steps)
        cfg = load_config(config, overrides + [f"{key}={value}" for key, value in short.items()])
        return LoopRun(cfg), cfg.train.batch_size * cfg.data.seq_len

    # The step's first timed steps after a run can be slower: a few untimed ones first.
    warmup = max(1, steps // 5)
    latest, tokens_per_step = fresh_run(0)
    between, logged, host_cpu = [latest.seconds_per_step(steps, warmup)], [], []
    for number in range(1, windows + 1):
        latest, _ = fresh_run(number)
        logged.append(latest.tokens_per_sec)
        host_cpu.append(latest.host_cpu_seconds)
        between.append(latest.seconds_per_step(steps, warmup))
        print(f"train.py run {number}/{windows} done", file=sys.stderr, flush=True)
    shares = paired_shares(logged, between, tokens_per_step)
    return {
        "tokens_per_step": tokens_per_step,
        "steps_per_window": steps,
        "logged_tokens_per_sec": logged,
        "step_seconds": between,
        "shares": shares,
        "host_cpu_seconds": host_cpu,
        "train_py_tokens_per_sec": statistics.median(logged),
        "step_tokens_per_sec": tokens_per_step / statistics.median(between),
        "share": statistics.median(shares),
    }


class LoopRun:
    """A run of the loop that keeps what its last step ran (the compiled train step, the state it
    returned, the placed batch it was given), to time that same step alone afterwards.

    The loop builds its step with ``configured_train_step``; the run wraps the step it gets to
    record each call's batch and new state, a dictionary update per step, and the loop thread's
    CPU time at each call (``time.thread_time``): the host's own work per step, which a loaded
    machine's other processes do not inflate as they do wall time.
    """

    def __init__(self, cfg: TrainConfig):
        last: dict = {}
        cpu_at_calls: list[float] = []
        configured_train_step = loop.configured_train_step

        def recording_train_step(cfg, graphdef, shardings, state_treedef):
            step = configured_train_step(cfg, graphdef, shardings, state_treedef)
            last.update(step=step, treedef=state_treedef)

            def recorded(state, batch, numbers, active):
                cpu_at_calls.append(time.thread_time())
                state, metrics, active = step(state, batch, numbers, active)
                last.update(state=state, batch=batch, numbers=numbers, active=active)
                return state, metrics, active

            return recorded

        with mock.patch.object(loop, "configured_train_step", recording_train_step):
            self.tokens_per_sec = logged_tokens_per_sec(cfg)
        self.step, self.state, self.batch = last["step"], last["state"], last["batch"]
        self.numbers, self.active = last["numbers"], last["active"]  # the run's own
        self.treedef = last["treedef"]  # the loop's step takes and returns the state's leaves
        # The median between consecutive calls: the steps that logged, evaluated or saved are
        # the few slow ones; the first call compiled.
        between_calls = [b - a for a, b in zip(cpu_at_calls[1:], cpu_at_calls[2:], strict=False)]
        self.host_cpu_seconds = statistics.median(between_calls)
        self.mesh = jax.tree.leaves(self.state)[0].sharding.mesh

    def seconds_per_step(self, steps: int, warmup: int) -> float:
        """Seconds per step over ``steps`` steps on the run's last batch, after ``warmup``
        untimed ones. The steps are dispatched ahead, as the loop does, and waited for at the
        end of the window only. They run under the run's mesh, part of what finds the step's
        compiled program again; a trace or compile (another program) raises RuntimeError."""
        events = []

        def compiled(event: str, *_, **__) -> None:
            if event.startswith(COMPILE_EVENTS):
                events.append(event)

        jax.monitoring.register_event_duration_secs_listener(compiled)
        try:
            with jax.set_mesh(self.mesh):
                self._steps(warmup)
                start = time.perf_counter()
                self._steps(steps)
                seconds = (time.perf_counter() - start) / steps
        finally:
            jax.monitoring.unregister_event_duration_listener(compiled)
        if events:
            raise RuntimeError(f"the step alone is not the loop's compiled step: {events}")
        return seconds

    def _steps(self, steps: int) -> None:
        if not steps:
            return
        state = self.state
        for _ in range(steps):
            state, metrics, _ = self.step(state, self.batch, self.numbers, self.active)
        float(metrics["loss"])  # waits for the last step
        self.state = state
