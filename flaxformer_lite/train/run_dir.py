"""A run directory: where each of a run's files lives, whether a directory is a run at all, and
the lock that gives it one run at a time.

    RUN/
      config.yaml      the resolved config (written once the run is restored or started)
      inputs.json      what the data were built from (:mod:`.run_inputs`)
      tokenizer/       the run's tokenizer: its ids are the checkpoints' ids
      prepared/        token stores prepared from the text, jsonl or parallel sources
      checkpoints/     Orbax step directories (:mod:`.checkpoint`)
      metrics.jsonl    one line per logged or evaluated step; tb/ the same as TensorBoard events
      plots/           loss, learning rate and attention maps
      library.log      the libraries' own log records (:mod:`flaxformer_lite.cli.library_log`)
      run.lock         held by the process that runs in the directory

Process 0 holds an OS file lock (``fcntl.flock`` on ``run.lock``) for as long as the run uses
the directory. The operating system drops the lock when the process ends, however it ends
(``kill -9`` included), so a lock file left behind never blocks a later run; a second run
started while the first is alive stops at once, naming the process that holds the directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import pathlib
import shutil
from collections.abc import Callable, Iterator

import yaml


class RunDirInUseError(ValueError):
    """Another live process holds the run directory (a user error: exit status 2)."""


class NotARunError(ValueError):
    """The directory holds files a run did not write (a user error: exit status 2)."""


@dataclasses.dataclass(frozen=True)
class RunDir:
    """The layout of the run directory ``path``; nothing is created until a run writes."""

    path: pathlib.Path

    def __post_init__(self):
        object.__setattr__(self, "path", pathlib.Path(self.path))

    config = property(lambda self: self.path / "config.yaml")
    inputs = property(lambda self: self.path / "inputs.json")
    tokenizer = property(lambda self: self.path / "tokenizer")
    prepared = property(lambda self: self.path / "prepared")
    checkpoints = property(lambda self: self.path / "checkpoints")
    metrics = property(lambda self: self.path / "metrics.jsonl")
    tensorboard = property(lambda self: self.path / "tb")
    plots = property(lambda self: self.path / "plots")
    library_log = property(lambda self: self.path / "library.log")
    lock = property(lambda self: self.path / "run.lock")

    def __str__(self) -> str:
        return str(self.path)

    def is_run(self) -> bool:
        """Whether a run has used the directory: it holds the lock file, checkpoints, logged
        metrics or the record of its inputs (a run writes one of them before anything else)."""
        return self.lock.exists() or any(
            p.exists() for p in (self.checkpoints, self.metrics, self.inputs)
        )

    def has_checkpoint(self) -> bool:
        """Whether ``checkpoints/`` holds a step directory (finished or not)."""
        directory = self.checkpoints
        return directory.is_dir() and any(p.name.isdigit() for p in directory.iterdir())

    def refuse_if_not_a_run(self) -> None:
        """Refuses an existing directory with files in it (empty folders aside) that is not a
        run: the run would write its ``config.yaml`` and the rest over the user's own files.

        Raises:
          NotARunError: naming some of the files.
        """
        if not self.path.is_dir() or self.is_run():
            if self.path.exists() and not self.path.is_dir():
                raise NotARunError(f"run_dir {self.path} is a file, not a directory")
            return
        held = sorted(
            p.name + ("/" if p.is_dir() else "")
            for p in self.path.iterdir()
            if not p.is_dir() or any(f.is_file() for f in p.rglob("*"))
        )
        if held:  # empty folders are not the user's work
            shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
            raise NotARunError(
                f"run_dir {self.path} is not a run directory: it holds {shown}, and no "
                f"{self.lock.name}, checkpoints/ or {self.metrics.name} of a run; choose a new "
                "or empty run_dir (a run writes config.yaml and more into it)"
            )

    def write_config(self, config: dict) -> None:
        """Writes ``config.yaml`` aside and renames it: a killed write keeps the old one."""
        partial = self.config.with_name(self.config.name + ".tmp")
        partial.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        partial.replace(self.config)

    @contextlib.contextmanager
    def locked(self, *, fresh: bool = False, log: Callable[[str], None] = print) -> Iterator[None]:
        """Creates the directory and holds its lock while the ``with`` block runs; a directory
        this call created is removed again if the block fails before writing a file.

        ``fresh`` first moves an existing run aside to ``<run_dir>.old<N>``, under that
        directory's lock, so that a directory in use is never moved.

        Raises:
          NotARunError: the directory holds files a run did not write (nothing is touched).
          RunDirInUseError: another process holds the directory (nothing is moved or written).
        """
        self.refuse_if_not_a_run()
        if fresh and self.path.exists():
            with _flock(self.lock):
                moved = move_aside(self.path)
            log(f"--fresh: moved the previous run to {moved}")
        created = not self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        try:
            with _flock(self.lock):
                yield
        except BaseException:
            if created:
                self._remove_if_unused()
            raise

    def _remove_if_unused(self) -> None:
        """Removes the directory if a failed run left nothing in it but its lock and empty
        folders: bad input leaves no trace."""
        files = [p for p in self.path.rglob("*") if not p.is_dir() and p != self.lock]
        if not files:
            shutil.rmtree(self.path, ignore_errors=True)


@contextlib.contextmanager
def _flock(path: pathlib.Path) -> Iterator[None]:
    """An exclusive, non-blocking ``flock`` on the lock file ``path``, which then holds our pid
    (for the message another process prints); closing the file releases the lock."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "(starting)"
            raise RunDirInUseError(
                f"run_dir {path.parent} is in use by process {holder} (it holds {path}); wait "
                "for it to end or stop it, or choose another run_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def move_aside(path: pathlib.Path) -> pathlib.Path:
    """Moves ``path`` (a run directory or any path) to the first free ``<name>.old<N>``."""
    number = 1
    while (target := path.with_name(f"{path.name}.old{number}")).exists():
        number += 1
    shutil.move(path, target)
    return target
