"""Where a run's time went: the closing line's parts are all there and add up to its wall time,
and the compilation is the union of JAX's nested compile spans on the run's thread, and its
waits for the background compile, taken out of the parts that hold them."""

import re
import threading
import time

import pytest
from tiny_runs import TINY

from flaxformer_lite.cli.train import train_main
from flaxformer_lite.train.time_spent import OPTIONAL_PARTS, PARTS, TimeSpent

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

_TRACE, _COMPILE = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/backend_compile_duration",
)


def test_nested_compile_spans_count_once_and_leave_the_parts_that_hold_them():
    spent = TimeSpent(started=time.perf_counter() - 10.0)
    with spent.part("evaluations"):
        now = time.time()
        spent._compile_span(_TRACE, now - 0.5, now - 0.4)  # an inner jit's trace, inside
        spent._compile_span(_TRACE, now - 0.6, now - 0.3)  # the outer trace that holds it
        spent._compile_span(_COMPILE, now - 0.2, now - 0.1)
        spent._compile_span("/jax/some/other_event", now - 5.0, now)
    parts = spent.parts()
    assert parts["compilation"] == pytest.approx(0.4)
    assert parts["evaluations"] < 0.0  # the block's time less the compilation spans put in it
    assert list(parts) == list(PARTS)
    assert sum(parts.values()) == pytest.approx(10.0, abs=0.05)


def test_compiling_on_another_thread_counts_only_while_the_run_waits_for_it():
    spent = TimeSpent(started=time.perf_counter() - 10.0)
    now = time.time()
    spent._compile_span(_COMPILE, now - 3.0, now - 1.0)  # the run's own: the first step's
    elsewhere = threading.Thread(  # overlapping it: counted too, it would be counted twice
        target=spent._compile_span, args=(_COMPILE, now - 2.0, now)
    )
    elsewhere.start()
    elsewhere.join()
    with spent.part("evaluations"), spent.waiting_for_compilation():
        time.sleep(0.05)
    parts = spent.parts()
    assert parts["compilation"] == pytest.approx(2.05, abs=0.02)
    assert parts["evaluations"] == pytest.approx(0.0, abs=0.02)
    assert all(seconds >= 0 for seconds in parts.values())
    assert sum(parts.values()) == pytest.approx(10.05, abs=0.02)


def test_the_start_up_ends_where_the_loop_begins():
    spent = TimeSpent(started=time.perf_counter() - 2.0)
    spent.add("data", 0.5)
    spent.loop_begins()
    with spent.part("plots"):
        time.sleep(0.05)
    parts = spent.parts()
    assert parts["start-up"] == pytest.approx(1.5, abs=0.02)
    assert parts["plots"] == pytest.approx(0.05, abs=0.02)
    assert parts["steps"] == pytest.approx(0.0, abs=0.02)
    assert sum(parts.values()) == pytest.approx(2.05, abs=0.02)


def test_the_closing_line_says_where_the_time_went(tmp_path, capsys):
    began = time.perf_counter()
    argv = ["--no-progress", *TINY, "train.steps=3", "train.eval_every=2"]
    assert train_main([*argv, f"run_dir={tmp_path / 'run'}"]) == 0
    wall = time.perf_counter() - began
    closing = capsys.readouterr().out.strip().splitlines()[-1]
    match = re.fullmatch(r"done: .* \(.*\); ([\d.]+) s: (.*)", closing)
    assert match, closing
    total = float(match[1])
    parts = dict(re.fullmatch(r"(\S+) ([\d.]+) s", part).groups() for part in match[2].split(", "))
    assert list(parts) == [p for p in PARTS if p not in OPTIONAL_PARTS]  # a run with no tasks
    seconds = {name: float(value) for name, value in parts.items()}
    assert sum(seconds.values()) == pytest.approx(total, abs=0.05 * len(PARTS))  # rounded
    assert wall - 0.5 < total <= wall + 0.05  # the command counts from its start
    assert all(value >= 0 for value in seconds.values()), closing
    # The plots are drawn while the last checkpoint is written: they may cost no time of their own.
    assert seconds["compilation"] > 0 and seconds["checkpoints"] > 0, closing
    assert (tmp_path / "run" / "plots" / "loss.png").is_file()
