"""benchmarks/first_step.py: two runs of one config timed to their first step, the second from a
warm compilation cache."""

import re

import pytest
from benchmark_scripts import load_benchmark
from subprocess_env import subprocess_env
from tiny_runs import TINY


def test_the_table_gives_the_second_run_as_a_share_of_the_first():
    benchmark = load_benchmark("first_step")
    first = {"first_step": 10.0, "exit": 20.0, "compilation": 8.0}
    second = {"first_step": 3.0, "exit": 12.0, "compilation": 1.0}
    text = benchmark.table(first, second, load=1.5)
    assert "| second, the cache warm | 3.0 s (30%) | 12.0 s (60%) | 1.0 s |" in text
    assert text.endswith(
        "PASS: the second run's first step at 30% of the first's (target: at most 40%); "
        "load average (1 min) before the runs: 1.5"
    )
    slow = benchmark.table(first, second | {"first_step": 4.5}, load=1.5)
    assert "FAIL: the second run's first step at 45%" in slow


def test_a_run_length_below_one_step_is_refused(capsys):
    with pytest.raises(SystemExit) as exited:
        load_benchmark("first_step").main(["--steps", "0"])
    assert exited.value.code == 2
    assert "--steps must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.slow
def test_two_tiny_runs_are_timed_from_an_empty_then_a_warm_cache(monkeypatch):
    for name, value in subprocess_env(1).items():
        monkeypatch.setenv(name, value)
    text = load_benchmark("first_step").main(["--set", *TINY])
    seconds = {
        run: [float(value) for value in re.findall(r"\| ([\d.]+) s", line)]
        for run, line in zip(("first", "second"), text.splitlines()[2:4], strict=True)
    }
    assert all(len(values) == 3 and min(values) > 0 for values in seconds.values()), text
    # Read back from the cache, the second run compiles less than the first.
    assert seconds["second"][2] < seconds["first"][2], text
