"""Failures after steps were trained: an evaluation that fails, a closed output pipe. The steps
are kept (issue 43 items 3 and 4)."""

import os
import subprocess
import sys

import pytest
from subprocess_env import subprocess_env
from tiny_runs import TINY

from flaxformer_lite.cli.errors import say
from flaxformer_lite.train import actions
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.loop import run
from flaxformer_lite.train.run_dir import RunDir

pytestmark = pytest.mark.fast_compile


def test_a_failing_evaluation_comes_after_the_checkpoint_due_at_its_step(tmp_path, monkeypatch):
    def evaluate(*_args, **_kwargs):
        raise ValueError("the evaluation failed")

    monkeypatch.setattr(actions, "evaluate", evaluate)
    run_dir = RunDir(tmp_path / "run")
    overrides = [*TINY, f"run_dir={run_dir}", "train.steps=4", "train.eval_every=2"]
    with pytest.raises(ValueError, match="the evaluation failed"):
        run(load_config(None, [*overrides, "checkpoint.every=2"]), progress=False, log=print)
    assert sorted(p.name for p in run_dir.checkpoints.iterdir()) == ["2"]


def test_a_closed_output_pipe_lets_the_run_train_on_to_its_checkpoint(tmp_path):
    """``train ... | head -3``: the run trains on without its output and saves at its end."""
    run_dir = RunDir(tmp_path / "run")
    args = [*TINY, f"run_dir={run_dir}", "train.steps=8", "checkpoint.every=100", "--no-progress"]
    process = subprocess.Popen(
        [sys.executable, "-m", "flaxformer_lite.train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=subprocess_env(1),
    )
    for _ in range(3):
        process.stdout.readline()
    process.stdout.close()  # as head does once it has its lines
    err = process.stderr.read().decode()
    assert process.wait() == 0, err
    assert "Broken pipe" not in err, err
    assert sorted(p.name for p in run_dir.checkpoints.iterdir()) == ["8"]


def test_say_to_a_closed_pipe_goes_on_quietly():
    read_end, write_end = os.pipe()
    os.close(read_end)
    with os.fdopen(write_end, "w") as stream:
        say("a line nobody reads", stream=stream)
        say("nor this one", stream=stream)
