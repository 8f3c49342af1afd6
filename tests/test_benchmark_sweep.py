"""benchmarks/sweep.py at a tiny size: a sweep of two seeds against their two runs (trained in
this process, its programs compiled once), the table, the target's line and the JSON; and its
subprocesses' wall time, peak memory and exit status."""

import contextlib
import io
import json
import resource
import time

import pytest
from benchmark_scripts import load_benchmark

from flaxformer_lite.cli import main

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

TINY = """\
model:
  preset: gpt2-tiny
  num_decoder_layers: 1
train:
  batch_size: 8
  log_every: 2
  eval_every: 4
  eval_batches: 1
  decode_examples: 0
data:
  seq_len: 32
  eval_size: 8
"""


def in_process(benchmark):
    """``timed``'s figures of ``flaxformer-lite ARGV`` run in this process."""

    def timed(argv: list[str]) -> dict:
        started, printed = time.perf_counter(), io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(argv) == 0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        wall = time.perf_counter() - started
        parts = benchmark.closing_parts(printed.getvalue())
        return {"wall_seconds": wall, "peak_mib": peak, "parts": parts}

    return timed


@pytest.mark.slow
def test_the_sweep_against_its_runs(tmp_path, capsys, monkeypatch):
    benchmark = load_benchmark("sweep")
    monkeypatch.setattr(benchmark, "timed", in_process(benchmark))
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    argv = ["--cases", "default", "--seeds", "2", "--default-steps", "4"]
    summary = benchmark.main([*argv, "--default-config", str(config)])
    out = capsys.readouterr().out.strip().splitlines()

    assert json.loads(out[-1]) == summary
    (case,) = summary["cases"]
    assert case["members"] == 2 and len(case["runs"]) == 2
    walls = [run["wall_seconds"] for run in case["runs"]]
    assert case["wall_ratio"] == pytest.approx(case["sweep"]["wall_seconds"] / sum(walls))
    rates = [run["tokens_per_sec"] for run in case["runs"]]
    assert case["run_tokens_per_sec"] == pytest.approx(sum(rates) / 2) and min(rates) > 0
    assert case["sweep_tokens_per_sec"] > 0
    # The same configs, the members stepped in turn: a member's loss is its run's.
    assert case["max_final_loss_difference"] == 0
    sweep_parts = case["sweep"]["parts"]
    assert list(sweep_parts) == list(benchmark.PARTS)
    assert sum(sweep_parts.values()) <= case["sweep"]["wall_seconds"] + 0.5
    fixed = [run["wall_seconds"] - run["parts"]["steps"] for run in case["runs"]]
    assert case["run_fixed_seconds"] == pytest.approx(sum(fixed) / 2)
    limit = sweep_parts["steps"] + case["run_fixed_seconds"] + 2 * benchmark.SECONDS_A_MEMBER
    assert case["limit_seconds"] == pytest.approx(limit)
    table = [line for line in out if line.startswith("|")]
    assert len(table) == 7 and table[2].startswith("| default | 2 x 4 | ")
    assert table[5].startswith("| default | sweep | ") and table[6].startswith("| default | a run")
    assert out[-2].startswith(("PASS: default, sweep wall", "FAIL: default, sweep wall"))


def test_a_subprocess_is_timed_and_a_failing_one_ends_the_benchmark_with_its_status():
    benchmark = load_benchmark("sweep")
    listed = benchmark.timed(["config", "--list"])
    assert listed["wall_seconds"] > 0 and listed["peak_mib"] > 10 and listed["parts"] is None
    with pytest.raises(SystemExit) as failed:
        benchmark.timed(["train", "train.stepz=3"])  # its one line on stderr, exit status 2
    assert failed.value.code == 2
