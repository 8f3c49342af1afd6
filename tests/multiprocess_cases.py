"""The runs, jobs and checks shared by the multi-process tests (test_multiprocess.py,
test_multiprocess_faults.py): each test starts ``train.py`` processes and reads their files."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from subprocess_env import subprocess_env

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


@contextlib.contextmanager
def launcher():
    """``launch(name, directory, args, devices=2, env=None)`` starts ``python train.py
    --no-progress *args`` on ``devices`` simulated CPU devices; all are killed at the end."""
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
