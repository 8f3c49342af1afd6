"""train.py as a real multi-process run: two processes on 127.0.0.1 with 2 CPU devices each.

What only separate processes show: ``jax.distributed`` start-up, process 0 alone writing the run
directory's files, checkpoints written collectively and resumed (also onto another mesh), the
same losses as one process with the same 4 devices, a dead peer stopping the survivor instead of
hanging it, and bad distributed settings rejected with exit status 2.

Every subprocess gets its own environment (the ``XLA_FLAGS`` of this test process asks for 8
devices; ``subprocess_env`` turns XLA's backend optimizations off and keeps the session's
compilation cache, which the runs share) and writes stdout/stderr to files whose tails go into
the assertion messages.
Independent runs are started together, and each test is one scenario (so that ``pytest -n``
never runs a scenario's set-up twice), to keep the file short on a small machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from subprocess_env import DISTRIBUTED_ENV, subprocess_env

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "train.py"
# A small, fast run (one decoder layer compiles quickly); a constant learning rate so that a run
# resumed with a larger train.steps follows the same schedule as one started with it.
QUICK = [
    "train.batch_size=8",
    "data.seq_len=32",
    "optimizer.warmup_steps=0",
    "optimizer.schedule=constant",
    "model.num_decoder_layers=1",
    "train.log_every=5",
    "train.eval_every=10",
    "train.eval_batches=2",
    "data.eval_size=16",
    "checkpoint.every=5",
]
RUN_TIMEOUT = 420  # seconds for runs started together, on a loaded machine
COMPILED = "compiled the train step"  # process 0's line after the first step


@dataclasses.dataclass
class Job:
    """One ``train.py`` subprocess and the files its output goes to."""

    name: str
    process: subprocess.Popen
    stdout: Path
    stderr: Path

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def out(self) -> str:
        return self.stdout.read_text(errors="replace") if self.stdout.exists() else ""

    def err(self) -> str:
        return self.stderr.read_text(errors="replace") if self.stderr.exists() else ""

    def report(self, chars: int = 2500) -> str:
        return (
            f"\n=== {self.name}: exit status {self.returncode} ===\n"
            f"--- stdout (tail) ---\n{self.out()[-chars:]}\n"
            f"--- stderr (tail) ---\n{self.err()[-chars:]}"
        )

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)


def reports(jobs) -> str:
    return "".join(job.report() for job in jobs)


@contextlib.contextmanager
def killed_at_exit():
    """A list to put jobs in; whatever is still running at the end is killed."""
    jobs: list[Job] = []
    try:
        yield jobs
    finally:
        for job in jobs:
            job.kill()


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports the kernel had free (all held open until each is chosen)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


@pytest.fixture
def launch():
    """``launch(name, directory, args, devices=2, env=None)`` starts ``python train.py
    --no-progress *args`` on ``devices`` simulated CPU devices; all are killed after the test."""
    with killed_at_exit() as jobs:

        def start(name: str, directory: Path, args, *, devices: int = 2, env=None) -> Job:
            environ = subprocess_env(devices, **(env or {}))
            directory.mkdir(parents=True, exist_ok=True)
            stdout, stderr = directory / f"{name}.out", directory / f"{name}.err"
            with stdout.open("w") as out, stderr.open("w") as err:
                process = subprocess.Popen(
                    [sys.executable, str(TRAIN), "--no-progress", *map(str, args)],
                    stdout=out,
                    stderr=err,
                    stdin=subprocess.DEVNULL,
                    env=environ,
                    cwd=directory,
                )
            jobs.append(Job(name, process, stdout, stderr))
            return jobs[-1]

        yield start


def start_pair(launch, name: str, directory: Path, args, *, extra=()) -> list[Job]:
    """Processes 0 and 1 of a two-process run (2 devices each), set up by ``distributed.*``."""
    (port,) = free_ports(1)
    common = [
        *args,
        f"distributed.coordinator_address=127.0.0.1:{port}",
        "distributed.num_processes=2",
        "distributed.initialization_timeout=120",
        *extra,
    ]
    return [
        launch(f"{name}.p{i}", directory, [*common, f"distributed.process_id={i}"])
        for i in range(2)
    ]


def finish(jobs, timeout: float = RUN_TIMEOUT) -> None:
    """Waits for every job; kills them all and fails (with their output) past ``timeout``."""
    deadline = time.monotonic() + timeout
    for job in jobs:
        try:
            job.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            for other in jobs:
                other.kill()
            pytest.fail(f"{job.name} still running after {timeout} s" + reports(jobs))


def assert_succeeded(jobs, what: str) -> None:
    failed = [job.name for job in jobs if job.returncode != 0]
    assert not failed, f"{what}: {failed} failed" + reports(jobs)


def wait_for_text(job: Job, text: str, watched, timeout: float = RUN_TIMEOUT) -> None:
    """Polls ``job``'s stdout for ``text``; fails if any of ``watched`` exits first."""
    deadline = time.monotonic() + timeout
    while text not in job.out():
        exited = [w.name for w in watched if w.returncode is not None]
        if exited:
            pytest.fail(f"{exited} exited before {job.name} printed {text!r}" + reports(watched))
        if time.monotonic() > deadline:
            pytest.fail(f"no {text!r} from {job.name} after {timeout} s" + reports(watched))
        time.sleep(0.25)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoint_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def assert_losses_close(run_dir: Path, reference_dir: Path, context: str) -> None:
    """Every logged loss and eval loss of ``run_dir`` equals ``reference_dir``'s (rtol 1e-5:
    the reductions of different device layouts add in different orders)."""
    keys = ("loss", "eval_loss")
    got = {(r["step"], k): r[k] for r in records(run_dir) for k in keys if k in r}
    want = {(r["step"], k): r[k] for r in records(reference_dir) for k in keys if k in r}
    assert got.keys() == want.keys(), f"{sorted(got)} != {sorted(want)}{context}"
    np.testing.assert_allclose(
        [got[k] for k in sorted(want)],
        [want[k] for k in sorted(want)],
        rtol=1e-5,
        err_msg=f"{got} vs {want}{context}",
    )


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
    other process reads it, and the two processes' global batches are one process's."""
    lines = [f"{a} plus {b} is {a + b}" for a in range(60) for b in range(0, 60, 7)]
    (tmp_path / "corpus.txt").write_text("\n".join(lines) + "\n")
    text = ["data.source=text", f"data.path={tmp_path / 'corpus.txt'}", "data.tokenizer=char"]
    args = [*QUICK, *text, "train.steps=10"]
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
        "train.steps=300",  # longer, the two layouts' float sums drift apart
        "train.log_every=20",
        "train.eval_every=100",
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
