"""A sweep directory: where each of a sweep's files lives, beside :class:`~.run_dir.RunDir`.

SWEEP/
  sweep.json       the sweep's record: the varied settings, the shared config, the members
                   and their settings, the diverged ones, and at the end the summary
  <member>/        each member's run directory (a run: every command reads it)
  plots/           sweep.png, each group's mean curve ± std (``flaxformer-lite plot``)
  library.log      the libraries' own log records
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from flaxformer_lite.train.run_dir import RunDir


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

    def read(self) -> dict:
        """The sweep's record.

        Raises:
          ValueError: the file cannot be read, or is not a JSON object."""
        try:
            record = json.loads(self.record.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ValueError(f"{self.record}: not a readable sweep record ({error})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{self.record}: not a sweep record (a JSON object)")
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
