"""train.py as a real multi-process run: two processes on 127.0.0.1 with 2 CPU devices each.

What only separate processes show: ``jax.distributed`` start-up, process 0 alone writing the run
directory's files, checkpoints written collectively and resumed (also onto another mesh), the
same losses as one process with the same 4 devices (faults and bad settings:
test_multiprocess_faults.py; the runs and checks both use: multiprocess_cases.py).

Every subprocess gets its own environment (the ``XLA_FLAGS`` of this test process asks for 8
devices; ``subprocess_env`` turns XLA's backend optimizations off and keeps the session's
compilation cache, which the runs share) and writes stdout/stderr to files whose tails go into
the assertion messages.
Independent runs are started together, and each test is one scenario (so that ``pytest -n``
never runs a scenario's set-up twice), to keep the file short on a small machine.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from multiprocess_cases import (
    COMPILED,
    QUICK,
    assert_losses_close,
    assert_succeeded,
    checkpoint_steps,
    finish,
    launcher,
    records,
    reports,
    start_pair,
)
from tiny_runs import task_files

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


@pytest.fixture
def launch():
    """Starts ``train.py`` processes (``multiprocess_cases.launcher``), killed after the test."""
    with launcher() as start:
        yield start


@pytest.mark.slow
def test_two_processes_train_resume_and_match_one_process(tmp_path, launch):
    two, reshard, reference = tmp_path / "two", tmp_path / "reshard", tmp_path / "reference"
    # The one-process reference on the same 4 devices runs alongside.
    one = launch(
        "reference", tmp_path, [f"run_dir={reference}", *QUICK, "train.steps=15"], devices=4
    )

    # 1. Two processes train 10 steps: process 0 alone logs and writes the run's files.
    first = start_pair(launch, "first", tmp_path, [f"run_dir={two}", *QUICK, "train.steps=10"])
    finish(first)
    assert_succeeded(first, "the two-process run")
    context = reports(first)
    main_out, other_out = first[0].out(), first[1].out()
    assert "mesh: data 4 x fsdp 1 x tensor 1 (4 cpu devices, 2 processes)" in main_out, context
    assert COMPILED not in other_out and "mesh:" not in other_out, context
    steps = [r["step"] for r in records(two)]
    assert steps == [5, 10], f"metrics.jsonl steps {steps}: not written once{context}"
    assert np.isfinite(records(two)[-1]["eval_loss"]), context
    assert checkpoint_steps(two) == [5, 10], context
    assert not list((two / "checkpoints").glob("*.orbax-checkpoint-tmp*")), context
    for name in ("config.yaml", "tokenizer", "plots/loss.png"):
        assert (two / name).exists(), name + context
    shutil.copytree(two, reshard)  # the step-10 run, to resume on another mesh

    # 2. Both resumed to 15 steps, on the same mesh and (a copy) on data 2 x tensor 2: the
    # data-parallel checkpoint's arrays are restored into tensor-split layouts.
    args = [*QUICK, "train.steps=15"]
    resumed = start_pair(launch, "resumed", tmp_path, [f"run_dir={two}", *args])
    other_mesh = [f"run_dir={reshard}", *args, "mesh.data=2", "mesh.tensor=2"]
    resharded = start_pair(launch, "resharded", tmp_path, other_mesh)
    finish([*resumed, *resharded, one])
    assert_succeeded([one], "the one-process reference")
    for jobs, run_dir in ((resumed, two), (resharded, reshard)):
        assert_succeeded(jobs, f"the resumed run in {run_dir.name}")
        out, context = jobs[0].out(), reports(jobs) + one.report()
        assert f"resumed from step 10 of {run_dir / 'checkpoints'}" in out, context
        assert [r["step"] for r in records(run_dir)] == [5, 10, 15], context
        assert checkpoint_steps(run_dir)[-1] == 15, context
        assert_losses_close(run_dir, reference, context)
    assert "resuming on mesh" not in resumed[0].out(), reports(resumed)
    assert (
        "resuming on mesh data 2 x fsdp 1 x tensor 2; the checkpoint was written on "
        "data 4 x fsdp 1 x tensor 1"
    ) in resharded[0].out(), reports(resharded)


@pytest.mark.slow
def test_two_processes_share_one_prepared_text_cache_and_match_one_process(tmp_path, launch):
    """A text source is prepared once, by process 0, into the shared run directory's cache; the
    other process reads it, and the two processes' global batches are one process's; the
    downstream tasks, each process scoring its rows of each batch, score as one process."""
    lines = [f"{a} plus {b} is {a + b}" for a in range(60) for b in range(0, 60, 7)]
    (tmp_path / "corpus.txt").write_text("\n".join(lines) + "\n")
    text = ["data.source=text", f"data.path={tmp_path / 'corpus.txt'}", "data.tokenizer=char"]
    args = [*QUICK, *text, *task_files(tmp_path), "train.steps=10", "checkpoint.every=1000"]
    reference = tmp_path / "reference"
    one = launch("reference", tmp_path, [f"run_dir={reference}", *args], devices=4)
    two = tmp_path / "two"
    pair = start_pair(launch, "pair", tmp_path, [f"run_dir={two}", *args])
    finish([*pair, one])
    assert_succeeded([one, *pair], "the text runs")
    context = reports(pair) + one.report()
    caches = [p for p in (two / "prepared").iterdir()]
    assert len(caches) == 1 and caches[0].name.startswith("text-"), f"{caches}{context}"
    assert (caches[0] / "manifest.json").is_file(), context
    assert_losses_close(two, reference, context)
    scored = [
        {k: v for k, v in records(d)[-1].items() if k.startswith("task/")} for d in (two, reference)
    ]
    assert scored[0].keys() == scored[1].keys() and "task/sums/acc_norm" in scored[0], context
    for key, value in scored[1].items():
        assert scored[0][key] == pytest.approx(value, rel=1e-5), key + context
