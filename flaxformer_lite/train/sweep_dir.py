"""A sweep directory: where each of a sweep's files lives, beside :class:`~.run_dir.RunDir`.

SWEEP/
  sweep.json       the sweep's record: the varied settings, the shared config, the members
                   and their settings, the diverged ones, and at the end the summary
  <member>/        each member's run directory (a run: every command reads it)
  plots/           sweep.png, each group's mean curve ± std (``flaxformer-lite plot``)
  library.log      the libraries' own log records
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
from collections.abc import Callable

from flaxformer_lite.train.config import ConfigError
from flaxformer_lite.train.run_dir import RunDir, check_movable, move_aside


@dataclasses.dataclass(frozen=True)
class SweepDir:
    """The layout of the sweep directory ``path``; nothing is created until a sweep writes."""

    path: pathlib.Path

    def __post_init__(self):
        object.__setattr__(self, "path", pathlib.Path(self.path))

    record = property(lambda self: self.path / "sweep.json")
    plots = property(lambda self: self.path / "plots")
    library_log = property(lambda self: self.path / "library.log")

    def __str__(self) -> str:
        return str(self.path)

    def member(self, name: str) -> RunDir:
        """The run directory of the member ``name``."""
        return RunDir(self.path / name)

    def is_sweep(self) -> bool:
        """Whether a sweep recorded itself here."""
        return self.record.is_file()

    def refuse_if_not_a_sweep(self, written: tuple[str, ...] = ()) -> None:
        """Refuses a file, a directory with symbolic links (the sweep's writes would follow
        them), a run's directory, and one that holds files (other than ``written``, the
        command's own) but no sweep record: the user's.

        Raises:
          ConfigError: naming the directory and what it holds.
          RunDirLinkError: naming the links."""
        path = self.path
        if path.exists() and not path.is_dir():
            raise ConfigError(f"run_dir {path} is a file, not a sweep directory")
        if not path.is_dir():
            return
        RunDir(path).refuse_links()
        if RunDir(path).is_run():
            raise ConfigError(
                f"run_dir {path} holds a run (train.py's), not a sweep: choose another run_dir"
            )
        held = sorted(p.name for p in path.iterdir() if p.name not in written)
        if held and not self.is_sweep():
            raise ConfigError(
                f"run_dir {path} is not a sweep directory: it holds {', '.join(held[:5])} and no "
                f"{self.record.name}; choose a new or empty run_dir"
            )

    def member_runs(self) -> list[RunDir]:
        """The run directories in the sweep directory."""
        return [RunDir(p) for p in sorted(self.path.iterdir()) if RunDir(p).is_run()]

    def move_aside(self, log: Callable[[str], None]) -> None:
        """Moves the sweep to ``<path>.old<N>``, holding every member's lock meanwhile.

        Raises:
          ValueError: a directory that cannot move as a whole (a mount point).
          RunDirInUseError: a process trains a member (nothing is moved)."""
        check_movable(self.path)
        with contextlib.ExitStack() as held:
            for run in self.member_runs():
                held.enter_context(run.held())
            log(f"--fresh: moved the previous sweep to {move_aside(self.path)}")

    def read(self) -> dict:
        """The sweep's record.

        Raises:
          ValueError: the file cannot be read, or is not a JSON object."""
        try:
            record = json.loads(self.record.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ValueError(f"{self.record}: not a readable sweep record ({error})") from None
        shapes = {"members": dict, "config": dict, "vary": dict, "diverged": dict}
        if not isinstance(record, dict) or not all(k in record for k in ("members", "config")):
            raise ValueError(
                f"{self.record}: not a sweep record (an object with its members and config)"
            )
        for key, shape in shapes.items():
            if key in record and not isinstance(record[key], shape):
                raise ValueError(f"{self.record}: {key} is not an object ({record[key]!r})")
        return record

    def write(self, record: dict) -> None:
        """Writes the record aside and renames it into place, on process 0: a killed write
        keeps the old file."""
        import jax  # the commands that only read a sweep start without JAX

        if jax.process_index() != 0:
            return
        partial = self.record.with_name(self.record.name + ".tmp")
        partial.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        partial.replace(self.record)
