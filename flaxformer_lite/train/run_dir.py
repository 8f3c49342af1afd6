"""One run per run directory: process 0 holds an OS file lock (``fcntl.flock`` on
``<run_dir>/run.lock``) for as long as the run uses the directory. The operating system drops
the lock when the process ends, however it ends (``kill -9`` included), so a lock file left
behind never blocks a later run; a second run started while the first is alive stops at once,
naming the process that holds the directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import shutil
from collections.abc import Callable, Iterator

LOCK_FILE = "run.lock"


class RunDirInUseError(ValueError):
    """Another live process holds the run directory (a user error: exit status 2)."""


@contextlib.contextmanager
def locked_run_dir(
    run_dir: pathlib.Path, *, fresh: bool = False, log: Callable[[str], None] = print
) -> Iterator[pathlib.Path]:
    """Creates ``run_dir`` and holds its lock while the ``with`` block runs.

    ``fresh`` first moves an existing directory aside to ``<run_dir>.old<N>``, under that
    directory's lock, so that a directory in use is never moved.

    Raises:
      RunDirInUseError: another process holds the directory (nothing is moved or written).
    """
    if fresh and run_dir.exists():
        with _flock(run_dir):
            moved = move_aside(run_dir)
        log(f"--fresh: moved the previous run to {moved}")
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        with _flock(run_dir):
            yield run_dir
    except BaseException:
        if created:
            _remove_if_unused(run_dir)
        raise


def _remove_if_unused(run_dir: pathlib.Path) -> None:
    """Removes a run directory that a failed run created and left nothing in but its lock and
    empty folders: bad input leaves no trace."""
    files = [p for p in run_dir.rglob("*") if not p.is_dir() and p.name != LOCK_FILE]
    if not files:
        shutil.rmtree(run_dir, ignore_errors=True)


@contextlib.contextmanager
def _flock(run_dir: pathlib.Path) -> Iterator[None]:
    """An exclusive, non-blocking ``flock`` on the directory's lock file, which then holds our
    pid (for the message another process prints); closing the file releases the lock."""
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "(starting)"
            raise RunDirInUseError(
                f"run_dir {run_dir} is in use by process {holder} (it holds {path}); wait for "
                "it to end or stop it, or choose another run_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def move_aside(run_dir: pathlib.Path) -> pathlib.Path:
    """Moves ``run_dir`` (or any path) to the first free ``<name>.old<N>``; returns where."""
    number = 1
    while (target := run_dir.with_name(f"{run_dir.name}.old{number}")).exists():
        number += 1
    shutil.move(run_dir, target)
    return target
