"""The embedded default learns its task: a shortened version of it (two-digit problems, a few
hundred steps) goes from almost no exact answers to at least 30% of the held-out ones: the last
evaluation scores 64 decoded problems, and a float32 round-off change anywhere before it (another
CPU, another compilation of the initializers) moves it by several of them. The full default's
figure is a benchmark (benchmarks/README.md), not a test."""

import json

import pytest

from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.loop import run

SHORT = [
    "data.generator_options.max_digits=2",
    "train.steps=400",
    "train.eval_every=100",
    "train.log_every=50",
    "train.decode_examples=64",
    "checkpoint.every=400",
]


@pytest.mark.slow
def test_a_shortened_default_learns_to_answer_held_out_problems(tmp_path, full_optimization):
    samples = []
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", *SHORT])
    last = run(cfg, progress=False, log=samples.append)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    exact = [r["eval_exact_match"] for r in records if "eval_exact_match" in r]
    losses = [r["loss"] for r in records if "loss" in r]
    assert exact[0] < 0.1 and last["eval_exact_match"] >= 0.3, exact
    assert losses[-1] < 0.6 * losses[0], losses
    # The printed samples are the held-out problems, answered in the task's format.
    printed = [line for line in samples if line.startswith(f"step {cfg.train.steps} sample ")]
    assert printed and all("(reference '" in line for line in printed)
