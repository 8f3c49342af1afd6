"""train.py as a real multi-process run, when things go wrong: a dead peer stops the survivor
instead of hanging it, SIGTERM to one process stops both at the same step (a mixture too, then
resumed as one process trains), and bad distributed settings exit with status 2 (in a process
and in process), as test_multiprocess.py runs them."""

from __future__ import annotations

import signal
import time

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
    wait_for_text,
)
from subprocess_env import DISTRIBUTED_ENV

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


@pytest.fixture
def launch():
    """Starts ``train.py`` processes (``multiprocess_cases.launcher``), killed after the test."""
    with launcher() as start:
        yield start


@pytest.mark.slow
def test_a_dead_process_stops_the_other_instead_of_hanging(tmp_path, launch):
    """Two runs at once (heartbeat timeout 5 s): one loses process 1, the other its
    coordinator, process 0, in the middle of training."""
    pairs = {}
    for victim in (1, 0):
        args = [
            f"run_dir={tmp_path / f'run{victim}'}",
            *QUICK,
            "train.steps=2000",
            "checkpoint.every=1000",
            "train.eval_every=1000",
            "train.log_every=50",
        ]
        pairs[victim] = start_pair(
            launch, f"kill{victim}", tmp_path, args, extra=["distributed.heartbeat_timeout=5"]
        )
    for jobs in pairs.values():
        wait_for_text(jobs[0], COMPILED, jobs)  # both processes are in the training loop
    time.sleep(1)
    for victim, jobs in pairs.items():
        assert all(job.returncode is None for job in jobs), reports(jobs)
        jobs[victim].process.send_signal(signal.SIGKILL)
    killed, exited = time.monotonic(), {}
    while len(exited) < len(pairs) and time.monotonic() < killed + 90:
        for victim, jobs in pairs.items():
            if victim not in exited and jobs[1 - victim].returncode is not None:
                exited[victim] = time.monotonic() - killed
        time.sleep(0.1)
    outcomes = [
        f"SIGKILL to process {victim}: process {1 - victim} exited with status "
        f"{jobs[1 - victim].returncode} after {exited.get(victim, 90):.1f} s"
        for victim, jobs in pairs.items()
    ]
    for victim, jobs in pairs.items():
        assert victim in exited, f"{outcomes} (not stopped: a hang)" + reports(jobs)
        assert jobs[1 - victim].returncode != 0, str(outcomes) + reports(jobs)
    print("\n" + "\n".join(outcomes))


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_the_same_step(tmp_path, launch):
    """The signal reaches process 1 only; the processes agree to stop after the same step, save
    that step together and both exit 128 + SIGTERM (a process saving alone would hang)."""
    run_dir = tmp_path / "run"
    args = [
        f"run_dir={run_dir}",
        *QUICK,
        "train.steps=2000",
        "checkpoint.every=1000",
        "train.eval_every=1000",
        "train.log_every=50",
    ]
    jobs = start_pair(launch, "term", tmp_path, args)
    wait_for_text(jobs[0], COMPILED, jobs)
    time.sleep(1)
    jobs[1].process.send_signal(signal.SIGTERM)
    finish(jobs, timeout=120)
    assert [job.returncode for job in jobs] == [143, 143], reports(jobs)
    steps = checkpoint_steps(run_dir)
    assert len(steps) == 1 and 0 < steps[0] < 2000, (steps, reports(jobs))
    assert f"SIGTERM at step {steps[0]}: checkpoint saved" in jobs[1].err(), reports(jobs)


@pytest.mark.slow
def test_a_mixture_stopped_by_sigterm_on_two_processes_resumes_as_one_process_trains(
    tmp_path, launch
):
    """A 3:1 mixture of two text files: SIGTERM stops the pair, which resumes; every logged
    loss, per-source eval loss among them, is the one-process run's."""
    for name, line in (("a", "the cat sat on mat {}\n"), ("b", "{} + 1 = ?\n")):
        (tmp_path / f"{name}.txt").write_text("".join(line.format(i) for i in range(200)))
    args = [
        *QUICK,
        "model.d_model=32",
        "model.num_heads=2",
        "model.d_ff=64",
        "data.source=text",
        "data.text_documents=lines",
        "data.tokenizer=char",
        f"data.mixture.a.path={tmp_path / 'a.txt'}",
        "data.mixture.a.weight=3",
        f"data.mixture.b.path={tmp_path / 'b.txt'}",
        # Past the mixture's first 1,024 rows (128 steps of 8) and each file's epochs; longer,
        # the two layouts' float sums drift apart.
        "train.steps=130",
        "train.log_every=10",
        "train.eval_every=65",
        "checkpoint.every=1000",
    ]
    reference, two = tmp_path / "reference", tmp_path / "two"
    one = launch("reference", tmp_path, [f"run_dir={reference}", *args], devices=4)
    pair = start_pair(launch, "term", tmp_path, [f"run_dir={two}", *args])
    wait_for_text(pair[0], COMPILED, pair)
    pair[1].process.send_signal(signal.SIGTERM)
    finish(pair, timeout=120)
    assert [job.returncode for job in pair] == [143, 143], reports(pair)
    stopped = checkpoint_steps(two)
    resumed = start_pair(launch, "resumed", tmp_path, [f"run_dir={two}", *args])
    finish([*resumed, one])
    assert_succeeded([one, *resumed], "the mixture runs")
    context = reports(resumed) + one.report()
    assert f"resumed from step {stopped[-1]} of" in resumed[0].out(), context
    assert_losses_close(two, reference, context)
    got, want = records(two)[-1], records(reference)[-1]
    for key in ("eval_loss/a", "eval_loss/b"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key + context)


@pytest.mark.slow
def test_bad_distributed_settings_exit_2_with_a_clear_message(tmp_path, launch):
    cases = [  # (overrides, environment, what the one-line error says)
        (
            [],
            {"JAX_NUM_PROCESSES": "abc"},
            "environment variable JAX_NUM_PROCESSES must be an integer, got 'abc'",
        ),
        (
            [
                "distributed.coordinator_address=127.0.0.1:1",
                "distributed.num_processes=2",
                "distributed.process_id=2",
            ],
            {},
            "process_id < num_processes",
        ),
        (
            ["distributed.num_processes=2", "distributed.process_id=0"],
            {},
            "coordinator_address should be defined. (set distributed.coordinator_address",
        ),
    ]
    jobs = [
        launch(f"bad{i}", tmp_path, [f"run_dir={tmp_path / f'run{i}'}", *overrides], env=env)
        for i, (overrides, env, _) in enumerate(cases)
    ]
    finish(jobs, timeout=240)
    problems = [
        f"{overrides} {env}: expected exit status 2 and 'error: ...{message}'" + job.report()
        for job, (overrides, env, message) in zip(jobs, cases, strict=True)
        if job.returncode != 2 or not job.err().startswith("error: ") or message not in job.err()
    ]
    assert not problems, "\n".join(problems)
    assert not any((tmp_path / f"run{i}").exists() for i in range(len(cases)))


@pytest.mark.parametrize(
    "overrides, env, message",
    [
        (
            [],
            {"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "first"},
            "environment variable JAX_PROCESS_ID must be an integer, got 'first'",
        ),
        (["distributed.num_processes=abc"], {}, "distributed.num_processes must be an integer"),
        (["distributed.process_id=1.5"], {}, "distributed.process_id must be an integer"),
        (
            ["distributed.heartbeat_timeout=0"],
            {},
            "distributed: heartbeat_timeout must be a positive int, got 0",
        ),
        (
            ["distributed.initialization_timeout=-3"],
            {},
            "distributed: initialization_timeout must be a positive int, got -3",
        ),
    ],
)
def test_bad_distributed_settings_in_process(
    tmp_path, monkeypatch, capsys, overrides, env, message
):
    """More of them without a subprocess: they fail before ``jax.distributed`` is touched."""
    from flaxformer_lite.cli.train import train_main

    for name in DISTRIBUTED_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert train_main([f"run_dir={tmp_path / 'run'}", "--no-progress", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
