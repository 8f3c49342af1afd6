"""A run directory: where each of a run's files lives, whether a directory is a run at all, and
the lock that gives it one run at a time.

    RUN/
      run.json         the mark of a run directory, written first
      config.yaml      the resolved config (written once the run is restored or started)
      inputs.json      what the data were built from (:mod:`flaxformer_lite.data.inputs`)
      pieces.json      a fingerprint of the code of each of the user's pieces (a run that has one)
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

A directory is a run only if it holds ``run.json`` (or is a run written before the mark: see
:meth:`RunDir.is_run`); any other directory holding files is the user's, and no run writes in it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import pathlib
import shutil
from collections.abc import Callable, Iterator

import yaml

MARK = {"written_by": "flaxformer_lite"}  # run.json's content
# What Orbax and the checkpointer write in every step directory of a run.
_STEP_FILES = ("_CHECKPOINT_METADATA", "state", "data_state", "config")


class RunDirInUseError(ValueError):
    """Another live process holds the run directory (a user error: exit status 2)."""


class NotARunError(ValueError):
    """The directory holds files a run did not write (a user error: exit status 2)."""


class RunDirLinkError(ValueError):
    """The run directory holds symbolic links, which its writes would follow (exit status 2)."""


@dataclasses.dataclass(frozen=True)
class RunDir:
    """The layout of the run directory ``path``; nothing is created until a run writes."""

    path: pathlib.Path

    def __post_init__(self):
        object.__setattr__(self, "path", pathlib.Path(self.path))

    mark = property(lambda self: self.path / "run.json")
    config = property(lambda self: self.path / "config.yaml")
    inputs = property(lambda self: self.path / "inputs.json")
    pieces = property(lambda self: self.path / "pieces.json")
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
        """Whether a run of this library wrote the directory: it holds the mark ``run.json``.
        A run written before the mark is known by its lock file holding a pid beside logged
        metrics, checkpoints or the record of its inputs, or by a checkpoint with the items
        this library saves; a stranger's ``checkpoints/`` or ``metrics.jsonl`` is neither."""
        return self._is_marked() or self._is_unmarked_run()

    def _is_marked(self) -> bool:
        try:
            return json.loads(self.mark.read_bytes()[:4096]) == MARK
        except (OSError, ValueError):  # absent, a directory, not JSON: a file of the user's
            return False

    def _is_unmarked_run(self) -> bool:
        try:
            pid = self.lock.read_text(encoding="ascii").strip()
        except (OSError, ValueError):
            pid = ""
        if pid.isdigit() and any(p.exists() for p in (self.checkpoints, self.metrics, self.inputs)):
            return True
        steps = self.checkpoints.iterdir() if self.checkpoints.is_dir() else ()
        return any(
            step.name.isdigit() and all((step / name).exists() for name in _STEP_FILES)
            for step in steps
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
                f"run_dir {self.path} is not a run directory: it holds {shown}, and not the "
                f"{self.mark.name} a run writes first; choose a new or empty run_dir (a run "
                "writes config.yaml and more into it)"
            )

    def refuse_links(self) -> None:
        """Refuses a directory that holds symbolic links (from a shared file system or a
        tarball): a run writes its files in place (the lock, ``config.yaml.tmp``, plots,
        checkpoints), and through a link it would overwrite any file the user can write.

        Raises:
          RunDirLinkError: naming the links and where they point.
        """
        links = sorted(
            pathlib.Path(root, name)
            for root, folders, files in os.walk(self.path)  # links are listed, not followed
            for name in folders + files
            if os.path.islink(os.path.join(root, name))
        )
        if links:
            shown = ", ".join(f"{p.relative_to(self.path)} -> {os.readlink(p)}" for p in links[:5])
            more = f" and {len(links) - 5} more" if len(links) > 5 else ""
            raise RunDirLinkError(
                f"run_dir {self.path} holds symbolic links, which its writes would follow out "
                f"of it: {shown}{more}; remove them, or copy the run without them (cp -rL)"
            )

    def write_config(self, config: dict) -> None:
        """Writes ``config.yaml`` aside and renames it: a killed write keeps the old one."""
        partial = self.config.with_name(self.config.name + ".tmp")
        partial.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        partial.replace(self.config)

    def write_pieces(self, fingerprints: dict) -> None:
        """Writes ``pieces.json`` (the user's pieces' code fingerprints) aside and renames it."""
        partial = self.pieces.with_name(self.pieces.name + ".tmp")
        partial.write_text(json.dumps(fingerprints, indent=1), encoding="utf-8")
        partial.replace(self.pieces)

    def read_pieces(self) -> dict | None:
        """What :meth:`write_pieces` wrote, or None (a run started before the record)."""
        if not self.pieces.is_file():
            return None
        return json.loads(self.pieces.read_text(encoding="utf-8"))

    @contextlib.contextmanager
    def locked(
        self,
        *,
        fresh: bool = False,
        log: Callable[[str], None] = print,
        removed_after: tuple[type[BaseException], ...] = (),
    ) -> Iterator[None]:
        """Creates the directory and holds its lock while the ``with`` block runs; a directory
        this call created is removed again if the block fails before writing a file, or, after
        an error of ``removed_after`` (bad input found at the first step), before any step.

        ``fresh`` first moves an existing run aside to ``<run_dir>.old<N>``, under that
        directory's lock, so that a directory in use is never moved.

        Raises:
          NotARunError: the directory holds files a run did not write (nothing is touched).
          RunDirLinkError: the directory holds symbolic links (nothing is touched).
          ValueError: ``fresh`` with a directory that cannot be moved as a whole (a mount
            point, the current directory).
          RunDirInUseError: another process holds the directory (nothing is moved or written).
        """
        self.refuse_if_not_a_run()
        self.refuse_links()
        if fresh and self.path.exists():
            check_movable(self.path)
            with _flock(self.lock):
                moved = move_aside(self.path)
            log(f"--fresh: moved the previous run to {moved}")
        created = not self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        try:
            with _flock(self.lock):
                if not self._is_marked():
                    self.mark.write_text(json.dumps(MARK) + "\n", encoding="utf-8")
                yield
        except BaseException as error:
            if created:
                self._remove_if_unused(bad_input=isinstance(error, removed_after))
            raise

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Holds the lock of this existing run directory, writing nothing else in it.

        Raises:
          RunDirInUseError: another process holds it."""
        with _flock(self.lock):
            yield

    def _remove_if_unused(self, bad_input: bool) -> None:
        """Removes the directory (made by this call) if a failed run left nothing in it but its
        lock, its mark, the stores it prepared (a cache of the data, made again at the next
        start) and empty folders: bad input (a validation file that fails after the training
        data were prepared) leaves no trace. After ``bad_input`` found at the first step (a
        user's piece that fails at the run's shapes) also its config, the records of its inputs
        and pieces, its tokenizer and empty logs; any other failure (out of memory) keeps them."""
        if self.has_checkpoint() or (self.metrics.is_file() and self.metrics.stat().st_size):
            return
        kept, ours = [self.prepared], [self.lock, self.mark]
        if bad_input:
            kept += [self.tokenizer, self.tensorboard]
            ours += [self.config, self.inputs, self.pieces, self.metrics]
        files = [
            p
            for p in self.path.rglob("*")
            if not p.is_dir() and p not in ours and not any(p.is_relative_to(k) for k in kept)
        ]
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


def check_movable(path: pathlib.Path) -> None:
    """Refuses to move aside a directory that cannot go as a whole: a mount point (it would be
    copied, emptied, then fail to go) or one holding the current directory (``.``).

    Raises:
      ValueError: naming the directory and what to do.
    """
    resolved = path.resolve()
    if pathlib.Path.cwd().is_relative_to(resolved):
        raise ValueError(
            f"--fresh cannot move run_dir {path} aside: the current directory is in it; run "
            "from outside it, or move the old run's files yourself"
        )
    if os.path.ismount(resolved):
        raise ValueError(
            f"--fresh cannot move run_dir {path} aside: it is a mount point; move the old "
            "run's files out of it yourself, or choose a run_dir inside it"
        )


def move_aside(path: pathlib.Path) -> pathlib.Path:
    """Moves ``path`` (a run directory or any path) to the first free ``<name>.old<N>``."""
    number = 1
    while (target := path.with_name(f"{path.name}.old{number}")).exists():
        number += 1
    shutil.move(path, target)
    return target
