"""A smoke run shorter than the default warmup: it trains, with a notice, instead of refusing."""

import json

import pytest

from flaxformer_lite.cli.train import train_main

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


@pytest.mark.slow
def test_a_20_step_run_of_the_default_exits_0_and_names_the_shortened_warmup(tmp_path, capsys):
    run_dir = tmp_path / "run"
    status = train_main([f"run_dir={run_dir}", "train.steps=20", "--no-progress"])
    out = capsys.readouterr().out
    assert status == 0, out
    notice = [line for line in out.splitlines() if "optimizer.warmup_steps" in line]
    assert len(notice) == 1 and "20 steps" in notice[0], out
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert steps[-1] == 20
    assert (run_dir / "checkpoints" / "20").is_dir()
