"""benchmarks/data.py at a tiny size: every pipeline runs and the table, targets and JSON line
come out with the figures they claim."""

import json

import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    benchmark = load_benchmark("data")
    argv = ["--megabytes", "0.2", "--batches", "2", "--repeats", "1", "--vocab", "400"]
    return benchmark, benchmark.main(argv)


def test_every_pipeline_is_measured(run):
    _, summary = run
    for key in ("default", "encode_batch", "prepare_bpe", "prepare_byte", "memmap_sampler"):
        assert summary[key] > 0, key
    for rows in ("documents", "windows"):
        for processes in (1, 2, 8):
            assert summary[f"store_{rows}_{processes}"] > 0
    assert summary["store_tokens"] > 10_000 and summary["corpus_bytes"] > 0.15 * 2**20


def test_table_and_targets_state_the_ratios(run):
    benchmark, summary = run
    lines = benchmark.table(summary) + benchmark.targets(summary)
    ratio = summary["prepare_bpe"] / summary["encode_batch"]
    assert any(f"{ratio:.2f}x" in line and line.startswith("| prepare, BPE") for line in lines)
    verdicts = [line for line in lines if line.startswith(("PASS", "FAIL"))]
    assert len(verdicts) == 7
    json.dumps(summary)  # the last line printed
