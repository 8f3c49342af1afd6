"""benchmarks/tasks.py at a tiny size: the tasks' scoring and the forward pass timed side by
side, the positions the requests fill counted by hand, and a short run's tasks share."""

import pytest
from benchmark_scripts import load_benchmark

from flaxformer_lite.data.tokenizers import ByteTokenizer
from flaxformer_lite.evals import TaskFile, load_task

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


def test_the_tasks_cost_beside_the_forward_pass():
    argv = [
        "--configs",
        "default",
        "--windows",
        "1",
        "--limit",
        "3",
        "--steps",
        "4",
        "--every",
        "2",
    ]
    (row,) = load_benchmark("tasks").main(argv)["rows"]
    # 3 lines cut mid-way (4 choices each) and 3 last words, each request's tokens but one.
    tokenizer, positions = ByteTokenizer(), 0
    for name, path in (
        ("next_line", "builtin:shakespeare_next_line"),
        ("w", "builtin:shakespeare_last_word"),
    ):
        for request in load_task(name, TaskFile(path=path, limit=3)).requests(tokenizer, 64):
            positions += len(request.tokens(64)) - 1
    assert row["requests"] == 15 and row["positions"] == positions
    assert 0 < row["filled"] <= 1 and row["rows"] == "32 x 64"
    assert row["ratio"] == pytest.approx(row["tasks_per_sec"] / row["forward_per_sec"])
    assert 0 < row["tasks_seconds"] < row["run_seconds"]
    assert row["share"] == pytest.approx(row["tasks_seconds"] / row["run_seconds"])
