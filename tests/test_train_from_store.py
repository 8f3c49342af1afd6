"""``train.py`` from a prepared store: killed with SIGKILL mid-run and resumed, it logs exactly
the losses of a run that was never interrupted (the data state is the count of batches handed
out, saved with each checkpoint)."""

import pathlib
import subprocess
import sys

import pytest
from subprocess_env import subprocess_env
from test_train_e2e import QUICK, losses, wait_for

from flaxformer_lite.data.store import prepare_store
from flaxformer_lite.train.checkpoint import Checkpointer

REPO = pathlib.Path(__file__).resolve().parents[1]
WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "while",
    "two",
    "dogs",
    "ran",
    "past",
    "in",
    "the",
    "rain",
]


@pytest.fixture
def store(tmp_path):
    lines = [
        " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + i % 9)) for i in range(400)
    ]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(lines) + "\n")
    return prepare_store(
        tmp_path / "store",
        source="text",
        path=str(corpus),
        documents="lines",
        tokenizer_name="char",
    )


@pytest.mark.slow
def test_kill_9_during_a_run_from_a_store_then_resume_is_bit_exact(tmp_path, store):
    data = ["data.source=prepared", f"data.path={store.path}", "data.lm_rows=windows"]
    killed = tmp_path / "killed"
    process = train_py(killed, *data, "train.steps=100000")
    checkpoints = killed / "checkpoints"
    wait_for(
        lambda: (
            checkpoints.exists()
            and len([p for p in checkpoints.iterdir() if p.name.isdigit()]) >= 2
        ),
        process,
    )
    process.kill()
    process.wait()
    with Checkpointer(checkpoints, keep=3) as checkpointer:
        last = checkpointer.latest_step()
    # Both runs in subprocesses, compiled alike; a constant learning rate: the total steps do
    # not change the updates.
    steps = f"train.steps={last + 7}"
    for run_dir in (killed, tmp_path / "straight"):
        assert train_py(run_dir, *data, steps).wait(timeout=600) == 0
    resumed, reference = losses(killed), losses(tmp_path / "straight")
    assert resumed == reference, (last, resumed, reference)


def train_py(run_dir, *overrides):
    return subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), "--no-progress", f"run_dir={run_dir}"]
        + [*QUICK, *overrides, "checkpoint.every=3"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=subprocess_env(1),
        cwd=REPO,
    )
