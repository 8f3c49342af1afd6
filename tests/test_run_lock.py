"""A run directory is locked while a run uses it: a second train.py on it exits 2 naming the
process that holds it, and a lock left by a killed process (kill -9) does not block."""

import os
import pathlib
import signal
import subprocess
import sys

import pytest
from subprocess_env import subprocess_env

from flaxformer_lite.cli.plot import plot_main
from flaxformer_lite.cli.train import train_main
from flaxformer_lite.train.run_dir import NotARunError, RunDir, RunDirInUseError

LOCK_FILE, MARK_FILE = RunDir(".").lock.name, RunDir(".").mark.name

HOLD = """
import pathlib, sys, time
from flaxformer_lite.train.run_dir import RunDir
with RunDir(pathlib.Path(sys.argv[1])).locked():
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """A process holding ``tmp_path / "run"``, as a running train.py does; killed at the end."""
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)],
        stdout=subprocess.PIPE,
        text=True,
        env=subprocess_env(1),
    )
    assert process.stdout.readline().strip() == "held"
    yield run_dir, process
    process.kill()
    process.wait()


def test_a_second_run_on_a_held_run_dir_exits_2_naming_the_holder(holder, capsys):
    run_dir, process = holder
    (run_dir / "metrics.jsonl").write_text("")
    for extra in ([], ["--fresh"]):
        status = train_main([f"run_dir={run_dir}", "train.steps=2", "--no-progress", *extra])
        err = capsys.readouterr().err
        assert status == 2, err
        assert f"in use by process {process.pid}" in err and str(run_dir) in err, err
    # Nothing was moved aside or written by the refused runs.
    assert sorted(p.name for p in run_dir.parent.iterdir()) == ["run"]
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(
        ["metrics.jsonl", LOCK_FILE, MARK_FILE]
    )


def test_a_lock_left_by_a_killed_process_does_not_block(holder):
    run_dir, process = holder
    with pytest.raises(RunDirInUseError), RunDir(run_dir).locked():
        pass
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert (run_dir / LOCK_FILE).read_text().strip() == str(process.pid)  # left behind
    with RunDir(run_dir).locked():
        assert (run_dir / LOCK_FILE).read_text().strip() == str(os.getpid())


def test_the_lock_is_released_when_the_block_ends_or_raises(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(KeyError), RunDir(run_dir).locked():
        raise KeyError("the run failed")
    held = pytest.raises(RunDirInUseError, match=f"process {os.getpid()}")
    with RunDir(run_dir).locked(), held, RunDir(run_dir).locked():
        pass


def test_fresh_moves_the_old_run_aside_and_locks_the_new_one(tmp_path):
    run_dir = tmp_path / "run"
    with RunDir(run_dir).locked():
        (run_dir / "metrics.jsonl").write_text("{}\n")
    messages = []
    with RunDir(run_dir).locked(fresh=True, log=messages.append):
        assert (tmp_path / "run.old1" / "metrics.jsonl").exists()
        assert sorted(p.name for p in run_dir.iterdir()) == sorted([LOCK_FILE, MARK_FILE])
    assert messages == [f"--fresh: moved the previous run to {tmp_path / 'run.old1'}"]


def test_a_directory_that_is_not_a_run_is_refused_and_left_as_it_was(tmp_path, capsys):
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    own = "# my own config\ntrain:\n  steps: 2\n"
    (run_dir / "config.yaml").write_text(own)
    for flags in (
        [],
        ["--fresh"],
        ["--config", str(run_dir / "config.yaml")],
    ):
        status = train_main([f"run_dir={run_dir}", "--no-progress", *flags])
        err = capsys.readouterr().err
        assert status == 2, err
        assert f"run_dir {run_dir} is not a run directory: it holds config.yaml" in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # nothing moved aside
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]
    assert (run_dir / "config.yaml").read_text() == own


def test_a_stranger_s_checkpoints_folder_is_not_a_run(tmp_path, capsys):
    """Issue 43 item 1: a project with checkpoints/ was taken for a run and its config.yaml
    replaced; a run directory is one holding the run.json a run writes first."""
    project = tmp_path / "proj"
    (project / "checkpoints" / "3").mkdir(parents=True)
    (project / "checkpoints" / "model.pt").write_text("weights")
    (project / "config.yaml").write_text("mine\n")
    for name in ("metrics.jsonl", "inputs.json", "run.lock"):
        (project / name).write_text("{}\n")
    (project / MARK_FILE).write_text('{"written_by": "someone else"}\n')
    status = train_main([f"run_dir={project}", "train.steps=3", "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert f"run_dir {project} is not a run directory: it holds checkpoints/, " in err, err
    assert f"and not the {MARK_FILE} a run writes first" in err, err
    assert (project / "config.yaml").read_text() == "mine\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["proj"]


def test_a_run_directory_is_known_by_its_mark_or_as_a_run_from_before_the_mark(tmp_path):
    assert RunDir(tmp_path / "new").is_run() is False
    with RunDir(tmp_path / "marked").locked():
        pass
    assert RunDir(tmp_path / "marked").is_run()
    # Runs written before the mark: the lock holding a pid beside what a run writes, or a
    # checkpoint with the items this library saves.
    older = tmp_path / "older"
    older.mkdir()
    (older / LOCK_FILE).write_text("123\n")
    assert not RunDir(older).is_run()
    (older / "metrics.jsonl").write_text("")
    assert RunDir(older).is_run()
    oldest = tmp_path / "oldest"
    step = oldest / "checkpoints" / "20"
    for item in ("state", "data_state", "config"):
        (step / item).mkdir(parents=True)
    assert not RunDir(oldest).is_run()
    (step / "_CHECKPOINT_METADATA").write_text("{}")
    assert RunDir(oldest).is_run()


def test_a_directory_of_empty_folders_is_no_one_s_work(tmp_path):
    (tmp_path / "run" / "tb").mkdir(parents=True)
    RunDir(tmp_path / "run").refuse_if_not_a_run()
    (tmp_path / "run" / "tb" / "notes.txt").write_text("mine")
    with pytest.raises(NotARunError, match="it holds tb/, and not the run.json"):
        RunDir(tmp_path / "run").refuse_if_not_a_run()


@pytest.mark.parametrize("link", ["run.lock", "config.yaml.tmp", "checkpoints"])
def test_a_run_holding_a_symbolic_link_is_refused_and_its_target_untouched(tmp_path, link, capsys):
    """Issue 43 item 2: a run directory from someone else could link a run's writes to any
    file the user can write."""
    run_dir, victim = tmp_path / "run", tmp_path / "victim.txt"
    victim.write_text("precious\n")
    with RunDir(run_dir).locked():
        (run_dir / "metrics.jsonl").write_text("")
    (run_dir / link).unlink(missing_ok=True)
    (run_dir / link).symlink_to(victim)
    for flags in ([], ["--fresh"]):
        status = train_main([f"run_dir={run_dir}", "train.steps=2", "--no-progress", *flags])
        err = capsys.readouterr().err
        assert status == 2, err
        assert f"run_dir {run_dir} holds symbolic links" in err, err
        assert f"{link} -> {victim}" in err and len(err.strip().splitlines()) == 1, err
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "victim.txt"]


@pytest.mark.parametrize("link", ["plots", "plots/loss.png"])
def test_plot_does_not_write_through_a_link_in_the_run(tmp_path, link, capsys):
    run_dir, victim = tmp_path / "run", tmp_path / "victim"
    with RunDir(run_dir).locked():
        (run_dir / "metrics.jsonl").write_text(
            '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.0}\n'
        )
    if link == "plots":
        victim.mkdir()
    else:
        (run_dir / "plots").mkdir()
        victim.write_text("precious\n")
    (run_dir / link).symlink_to(victim)
    assert plot_main([str(run_dir)]) == 2
    assert f"holds symbolic links, which its writes would follow out of it: {link} -> " in (
        capsys.readouterr().err
    )
    assert (list(victim.iterdir()) == []) if link == "plots" else victim.read_text() == "precious\n"


def test_fresh_refuses_a_mount_point_and_the_current_directory(tmp_path, monkeypatch):
    """Issue 43 item 16: a mount point was copied aside, emptied, then [Errno 16] Device or
    resource busy; run_dir=. said PosixPath('.') has an empty name."""
    run_dir = tmp_path / "run"
    with RunDir(run_dir).locked():
        (run_dir / "metrics.jsonl").write_text("{}\n")
    mounted = run_dir.resolve()
    monkeypatch.setattr(os.path, "ismount", lambda path: pathlib.Path(path) == mounted)
    with pytest.raises(ValueError, match=f"run_dir {run_dir} aside: it is a mount point; move"):
        RunDir(run_dir).locked(fresh=True).__enter__()
    monkeypatch.chdir(run_dir)
    with pytest.raises(ValueError, match="run_dir . aside: the current directory is in it"):
        RunDir(".").locked(fresh=True).__enter__()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert (run_dir / "metrics.jsonl").read_text() == "{}\n"


def test_a_bad_validation_file_leaves_no_run_directory(tmp_path, capsys):
    """Issue 43 item 19: the training store was prepared, then the validation file failed and
    left prepared/, run.lock; its error lacked the data.validation_path: prefix."""
    (tmp_path / "corpus.txt").write_text("".join(f"line {i}: text\n" for i in range(40)))
    (tmp_path / "valid.txt").write_bytes(b"fine\n\xff\xfe bad\n")
    argv = [
        f"run_dir={tmp_path / 'run'}",
        "data.source=text",
        f"data.path={tmp_path / 'corpus.txt'}",
        f"data.validation_path={tmp_path / 'valid.txt'}",
        "--no-progress",
    ]
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: data.validation_path: {tmp_path / 'valid.txt'}: not valid UTF-8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "valid.txt"]
