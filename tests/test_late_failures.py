"""Failures after steps were trained: an evaluation that fails, a closed output pipe. The steps
are kept (issue 43 items 3 and 4)."""

import pytest
from tiny_runs import TINY

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
