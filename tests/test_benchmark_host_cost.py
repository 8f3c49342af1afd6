"""benchmarks/host_cost.py: the no-op size end to end at a few steps (its table and JSON say what
its runs measured), and its per-step arithmetic and verdicts on given figures."""

import json

import pytest
from benchmark_scripts import load_benchmark

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


@pytest.mark.slow
def test_the_no_op_size_end_to_end(capsys):
    benchmark = load_benchmark("host_cost")
    summary = benchmark.main(["--sizes", "noop", "--windows", "1", "--noop-steps", "3"])
    out = capsys.readouterr().out.strip().splitlines()

    assert json.loads(out[-1]) == json.loads(json.dumps(summary))
    (measured,) = summary["sizes"].values()
    # Batch 8 of 16 tokens: conftest.py's 8 devices take a row each.
    assert measured["tokens_per_step"] == 8 * 16 and measured["steps_per_window"] == 3
    assert len(measured["logged_tokens_per_sec"]) == 1 and len(measured["step_seconds"]) == 2
    loop_us = 1e6 * 8 * 16 / measured["logged_tokens_per_sec"][0]
    assert measured["loop_us"] == pytest.approx(loop_us)
    assert measured["host_us"] == pytest.approx(measured["loop_us"] - measured["step_us"])
    (host_cpu,) = measured["host_cpu_seconds"]
    assert host_cpu > 0 and measured["host_cpu_us"] == pytest.approx(1e6 * host_cpu)
    row = next(line for line in out if line.startswith("| no-op step"))
    assert row.endswith(
        f"| {measured['host_us']:.0f} | {measured['host_cpu_us']:.0f} | "
        f"{100 * measured['share']:.1f}% |"
    )
    assert not [line for line in out if line.startswith(("PASS", "FAIL"))]  # no target size


def test_per_step_and_verdicts_from_given_figures():
    benchmark = load_benchmark("host_cost")
    measured = {
        "tokens_per_step": 1000,
        "train_py_tokens_per_sec": 50_000.0,  # 20 ms a step in the loop
        "step_seconds": [0.0195, 0.0194, 0.0196],
        "host_cpu_seconds": [0.0003, 0.0009, 0.0004],
    }
    assert benchmark.per_step(measured) == pytest.approx(
        {"loop_us": 20_000.0, "step_us": 19_500.0, "host_us": 500.0, "host_cpu_us": 400.0}
    )
    sizes = {"noop": {"share": 0.5}, "default": {"share": 0.97}, "recipe": {"share": 0.969}}
    assert benchmark.checks({"sizes": sizes}) == [
        "PASS: default: the loop's logged tokens/s = 97.0% of its step alone's >= 97%",
        "FAIL: recipe: the loop's logged tokens/s = 96.9% of its step alone's >= 97%",
    ]
