"""Faults of saves and checkpoints (issue 27): a failing save ends the run in seconds with one
line, signals at start-up exit 128 + signal, kills at any point of a save resume, unreadable
checkpoint parts are set aside (bad input and resume changes: test_input_faults.py)."""

import errno
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
from mounts import mount_works, read_only, tmpfs, train_under
from subprocess_env import subprocess_env
from tiny_runs import TINY

from flaxformer_lite.train.checkpoint import Checkpointer, CheckpointError
from flaxformer_lite.train.metrics import read_metrics

pytestmark = pytest.mark.fast_compile

REPO = pathlib.Path(__file__).resolve().parents[1]
# Makes the checkpoint writer fail as a read-only checkpoints directory does (EROFS), without
# root for a read-only bind mount: orbax creates each step in <step>.orbax-checkpoint-tmp.
FAILING_WRITER = """
import errno, os, sys
real = os.makedirs
def makedirs(path, *args, **kwargs):
    if "orbax-checkpoint-tmp" in str(path):
        raise OSError(errno.EROFS, "Read-only file system", str(path))
    return real(path, *args, **kwargs)
os.makedirs = makedirs
from flaxformer_lite.cli.library_log import library_log_to
from flaxformer_lite.cli.train import train_main
sys.exit(train_main(sys.argv[1:]))
"""


def failing_makedirs(monkeypatch):
    real = os.makedirs

    def makedirs(path, *args, **kwargs):
        if "orbax-checkpoint-tmp" in str(path):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", makedirs)


def orbax_threads():
    from orbax.checkpoint._src.futures import future

    return [t for t in threading.enumerate() if isinstance(t, future._SignalingThread)]


def test_a_failing_save_raises_one_line_and_stops_orbax_threads(tmp_path, monkeypatch):
    checkpointer = Checkpointer(tmp_path / "ckpt", keep=2)
    failing_makedirs(monkeypatch)
    checkpointer.save(1, {"a": np.ones(3)}, data_state={}, config={})
    with pytest.raises(CheckpointError, match="cannot write a checkpoint in .*Read-only") as info:
        checkpointer.wait()
    assert len(str(info.value).splitlines()) == 1
    assert isinstance(info.value, OSError)  # the CLI's exit 2
    assert not [t for t in orbax_threads() if t.is_alive()]
    checkpointer.close()  # nothing left to wait for


def start(args, tmp_path, script=None, **popen):
    command = [sys.executable, "-c", script, *args] if script else [sys.executable, *args]
    return subprocess.Popen(
        command,
        cwd=REPO,
        env=subprocess_env(1),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


@pytest.mark.slow
def test_train_exits_2_in_seconds_when_checkpoints_cannot_be_written(tmp_path):
    args = [f"run_dir={tmp_path / 'run'}", *TINY, "train.steps=4", "checkpoint.every=2"]
    child = start(["--no-progress", *args], tmp_path, script=FAILING_WRITER)
    out, err = child.communicate(timeout=300)  # it used to hang for good
    assert child.returncode == 2, err
    assert "Traceback" not in err and "Traceback" not in out, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("error: cannot write a checkpoint in "), err
    # orbax's own tracebacks went to the run's library log instead
    assert "Read-only" in (tmp_path / "run" / "library.log").read_text()


@pytest.mark.slow
@pytest.mark.skipif(not mount_works(read_only), reason="no user and mount namespaces here")
def test_train_exits_2_on_a_read_only_bind_mounted_checkpoints_directory(tmp_path):
    """The real thing: EROFS from the kernel."""
    run_dir = tmp_path / "run"
    status, out, err = train_under(
        read_only, run_dir / "checkpoints", run_dir, [*TINY, "train.steps=2"]
    )
    assert status == 2, (out, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("error: cannot write a checkpoint in "), err


@pytest.mark.slow
@pytest.mark.skipif(not mount_works(tmpfs("1m")), reason="no user and mount namespaces here")
def test_a_full_disk_during_a_save_ends_with_one_line(tmp_path):
    """A 2 MiB tmpfs as the checkpoints directory: two checkpoints fit, the third save fails
    inside TensorStore, whose threads then report "Event loop is closed" many times."""
    run_dir = tmp_path / "run"
    args = [*TINY, "train.steps=4", "checkpoint.every=1"]
    status, out, err = train_under(tmpfs("2m"), run_dir / "checkpoints", run_dir, args)
    assert status == 2, (out, err[-3000:])
    assert "Traceback" not in out + err and "Event loop" not in out + err, err[-3000:]
    assert len(err.strip().splitlines()) == 1, err[-3000:]
    assert err.startswith("error: cannot write a checkpoint in "), err
    assert "No space left on device" in err
    assert "No space left on device" in (tmp_path / "run" / "library.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_start_up_exits_128_plus_signal(tmp_path, signum):
    args = ["train.py", "--no-progress", f"run_dir={tmp_path / 'run'}", *TINY, "train.steps=2"]
    child = start(args, tmp_path)
    first = child.stdout.readline()  # the tokenizer is built: the model is next
    assert first, child.stderr.read()
    child.send_signal(signum)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 128 + signum, (out, err)
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] in (
        f"stopped by {signal.Signals(signum).name}",
        f"{signal.Signals(signum).name} at step 1: checkpoint saved; run the same command to "
        "resume",  # it was that quick
    )


@pytest.fixture
def saved_run(trained_runs):
    """A run of 2 steps with a checkpoint at each (``tiny_runs.SHARED_RUNS["tiny"]``), trained
    once per session; the tests copy it."""
    return trained_runs("tiny")


def copied_run(saved_run, tmp_path) -> pathlib.Path:
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run, run_dir)
    (run_dir / "library.log").unlink(missing_ok=True)
    return run_dir


def listing(directory: pathlib.Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


@pytest.mark.slow
def test_kills_at_random_points_of_saves_always_resume(saved_run, tmp_path):
    """kill -9 at random moments of a run that saves every step; each restart resumes from a
    finished checkpoint, and the last one reaches the end with every step logged once. (The run
    starts from a copy of the saved run, at a checkpoint: a kill before the first one leaves
    logged steps without a checkpoint, which the next start refuses, by design, without
    --fresh.)"""
    run_dir = copied_run(saved_run, tmp_path)
    args = ["train.py", "--no-progress", f"run_dir={run_dir}", *TINY, "checkpoint.every=1"]
    args += ["train.steps=12"]
    rng = random.Random(0)
    for _ in range(3):
        child = start(args, tmp_path)
        lines = 0
        while lines < 2 + rng.randrange(4):  # start-up lines, then the first logged steps
            if not child.stdout.readline():
                break
            lines += 1
        threading.Event().wait(rng.uniform(0.0, 1.0))
        child.kill()
        child.communicate()
    final = start(args, tmp_path)
    out, err = final.communicate(timeout=300)
    assert final.returncode == 0, err[-3000:]
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert steps == list(range(1, 13)), steps


@pytest.mark.slow
def test_no_restorable_checkpoint_exits_2_and_moves_nothing(saved_run, tmp_path):
    run_dir = copied_run(saved_run, tmp_path)
    for path in (run_dir / "checkpoints").rglob("*"):
        if path.is_file():  # garbage of the same size, metadata and metrics included
            path.write_bytes(bytes(range(256)) * (path.stat().st_size // 256 + 1))
    before = listing(run_dir)
    child = start(
        ["train.py", "--no-progress", f"run_dir={run_dir}", *TINY, "train.steps=3"], tmp_path
    )
    out, err = child.communicate(timeout=300)
    assert child.returncode == 2, (out, err[-3000:])
    assert len(err.strip().splitlines()) == 1, err[-3000:]
    assert err.startswith(
        f"error: none of the checkpoints in {run_dir / 'checkpoints'} (steps [1, 2]) can be "
        "restored"
    ), err
    assert "pass --fresh" in err
    after = listing(run_dir)
    for written in ("library.log", "run.lock"):  # this run's own files
        before.pop(written, None)
        after.pop(written, None)
    assert after == before  # nothing set aside, metrics.jsonl as it was


def truncate_arrays(step_dir: pathlib.Path) -> None:
    for path in (step_dir / "state").rglob("d/*"):
        os.truncate(path, path.stat().st_size // 2)


def change_an_array(step_dir: pathlib.Path) -> None:
    """One element of a layer norm's scale changed, in a checkpoint that stays readable: as
    damaged bytes that still decode."""
    import tensorstore as ts

    base = f"file://{step_dir}/state/"
    kvstore = {"driver": "ocdbt", "base": base, "path": "0.decoder.final_norm.scale/"}
    array = ts.open({"driver": "zarr", "kvstore": kvstore}).result()
    array[3].write(array[3].read().result() * 2).result()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("damage", "why"),
    [(truncate_arrays, "OUT_OF_RANGE"), (change_an_array, "DamagedArrayError")],
)
def test_an_unreadable_newest_checkpoint_is_set_aside_in_one_line(saved_run, tmp_path, damage, why):
    """Resumed from the previous checkpoint, with one warning and no library output; step 2
    then trains again to the same loss."""
    run_dir = copied_run(saved_run, tmp_path)
    damage(run_dir / "checkpoints" / "2")
    child = start(
        ["train.py", "--no-progress", f"run_dir={run_dir}", *TINY, "train.steps=3"], tmp_path
    )
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, (out, err[-3000:])
    assert "Traceback" not in out + err and "Event loop" not in out + err, err[-3000:]
    warnings = err.strip().splitlines()
    assert len(warnings) == 1, err[-3000:]
    assert warnings[0].startswith("warning: checkpoint step 2 cannot be restored, moved to ")
    assert why in warnings[0]
    assert f"resumed from step 1 of {run_dir / 'checkpoints'}" in out
    assert (run_dir / "checkpoints" / "2.corrupt").is_dir()
    # (the saved run was trained in-process, at another matmul precision: conftest.py)
    losses = {r["step"]: r["loss"] for r in read_metrics(saved_run)}
    assert {r["step"]: r["loss"] for r in read_metrics(run_dir)}[2] == pytest.approx(losses[2])


@pytest.mark.slow
def test_changed_parameter_shapes_with_force_exit_2_and_keep_the_checkpoints(saved_run, tmp_path):
    run_dir = copied_run(saved_run, tmp_path)
    before = listing(run_dir / "checkpoints")
    args = [f"run_dir={run_dir}", *TINY, "train.steps=3", "model.d_model=32"]
    child = start(["train.py", "--no-progress", "--force", *args], tmp_path)
    out, err = child.communicate(timeout=300)
    assert child.returncode == 2, (out, err[-3000:])
    assert "Traceback" not in out + err, err[-3000:]
    assert len(err.strip().splitlines()) == 1, err
    assert "cannot be restored" not in err and "unreadable" not in err, err
    assert listing(run_dir / "checkpoints") == before
