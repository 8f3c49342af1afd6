"""A run's metrics: one JSON object per logged step in ``metrics.jsonl``, the same scalars as
TensorBoard events, a PNG plot of each logged metric, and the devices' peak FLOP/s that MFU is
taken against."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pathlib
import socket
import stat
import struct
import sys
import time
from collections.abc import Mapping

from flaxformer_lite.evals.tasks import PREFIX, is_count
from flaxformer_lite.train.figures import (
    draw,
    log_scale_if_wide,
    readable_ticks,
    tokens_axis,
    tokens_label,
)
from flaxformer_lite.train.figures import pyplot as figure_pyplot
from flaxformer_lite.train.run_dir import RunDir

# Notices, as the package's warnings: on stderr (``warning: ...``), not among a command's output.
logger = logging.getLogger(__name__)


class MetricsWriter:
    """Appends metrics to ``run_dir/metrics.jsonl`` and TensorBoard events in ``run_dir/tb``.

    A resumed run appends; lines of steps after the resumed step (written by the interrupted run
    after its last checkpoint) are dropped first, so the file reads as one uninterrupted run, and
    so is a partial last line (a disk that filled mid-write), with a notice to ``log``.

    Raises:
      ValueError: ``metrics.jsonl`` is not a regular file, or a line before its last is not a
        record.
      OSError: a file cannot be written (a full disk), naming the file.
    """

    def __init__(self, run_dir: pathlib.Path, *, resume_step: int = 0, log=logger.warning):
        self.path = RunDir(run_dir).metrics
        if self.path.exists():
            kept = [r for r in _records(self.path, log) if r["step"] <= resume_step]
            # Written aside and renamed: a process killed meanwhile keeps the old file.
            rewritten = self.path.with_name(self.path.name + ".tmp")
            with _writing(rewritten):
                rewritten.write_text("".join(json.dumps(record) + "\n" for record in kept))
            os.replace(rewritten, self.path)
        with _writing(self.path):
            self._file = self.path.open("a")
        self._events = _Events(RunDir(run_dir).tensorboard, purge_step=resume_step + 1)

    def write(self, step: int, values: Mapping[str, float]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in values.items()}}
        with _writing(self.path):
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, int | float)}
        self._events.write(step, scalars)

    def close(self) -> None:
        # After a failed write the buffers still hold what did not fit: closing retries it, and
        # that error is the one already raised.
        with contextlib.suppress(OSError):
            self._file.close()
        self._events.close()


class _Events:
    """A TensorBoard event file of scalars in ``directory``, each step's written and flushed as
    it comes, on the caller's thread: tensorboardX's ``SummaryWriter`` writes from a thread of
    its own, which dies of a failed write (a full disk) and leaves the run blocked for good,
    signals unheard, on its full queue."""

    def __init__(self, directory: pathlib.Path, *, purge_step: int):
        self._event, self._session_log, self._summary, self._crc = _tensorboard_protos()
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        self.path = directory / name
        with _writing(self.path):
            directory.mkdir(exist_ok=True)
            self._file = self.path.open("ab")  # a run resumed in the same second appends
        # A session starting at purge_step: TensorBoard drops the events of that step and after
        # that earlier files hold (an interrupted run's after its last checkpoint), as
        # metrics.jsonl drops their lines.
        start = self._session_log(status=self._session_log.START)
        self._add([self._event(file_version="brain.Event:2")])
        self._add([self._event(step=purge_step, session_log=start)])

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        values = [self._summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
        self._add([self._event(step=step, summary=self._summary(value=values))])

    def _add(self, events) -> None:
        """Appends ``events`` as TFRecords (length, its checksum, the event, its checksum)."""
        records = []
        for event in events:
            event.wall_time = time.time()
            data = event.SerializeToString()
            header = struct.pack("<Q", len(data))
            records += [header, struct.pack("<I", self._crc(header))]
            records += [data, struct.pack("<I", self._crc(data))]
        with _writing(self.path):
            self._file.write(b"".join(records))
            self._file.flush()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # as MetricsWriter.close
            self._file.close()


@contextlib.contextmanager
def _writing(path: pathlib.Path):
    """Names ``path`` in a failed write's ``OSError`` (a full disk's ENOSPC names no file)."""
    try:
        yield
    except OSError as error:
        raise OSError(
            f"cannot write {path}: {error.strerror or error}; free disk space (or make it "
            "writable) and run again to resume from the last checkpoint"
        ) from error


def _tensorboard_protos():
    """tensorboardX's ``Event``, ``SessionLog`` and ``Summary`` protos and its TFRecord
    checksum, imported when a run starts. tensorboardX imports PyTorch whenever it is installed,
    only to accept torch tensors (these events hold floats), which costs every run seconds of
    start-up: the import is made with torch hidden, unless it is loaded already."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # `import torch` raises ImportError, loads nothing
    try:
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.proto.summary_pb2 import Summary
        from tensorboardX.record_writer import masked_crc32c
    finally:
        if hide:
            del sys.modules["torch"]
    return Event, SessionLog, Summary, masked_crc32c


def _plain(value):
    """A JSON value: ints and strings as they are, numbers as floats, None for missing or
    non-finite values (e.g. no throughput yet on the first step after compiling)."""
    if value is None:
        return None
    value = float(value) if not isinstance(value, int | str) else value
    return None if isinstance(value, float) and not math.isfinite(value) else value


def read_metrics(run_dir: pathlib.Path, log=logger.warning) -> list[dict]:
    """The records of ``run_dir/metrics.jsonl`` (a partial last line is left out, with a notice
    to ``log``).

    Raises:
      FileNotFoundError: the run directory has no metrics file.
      ValueError: a line before the last is not a JSON record (naming the file and line).
    """
    path = RunDir(run_dir).metrics
    if not path.exists():
        raise FileNotFoundError(f"{path}: no metrics file (is {run_dir} a run directory?)")
    return _records(path, log)


def _records(path: pathlib.Path, log) -> list[dict]:
    """The JSON records of ``path``, one a line; a last line that does not parse is what a
    writer stopped mid-line leaves (killed, or a full disk): dropped with a notice.

    Raises:
      ValueError: ``path`` is not a regular file (read whole, a device such as /dev/zero never
        ends and a FIFO never opens), or a line before the last is not a record.
    """
    _check_regular(path)
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    records = []
    for n, line in lines:
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not a record with an integer 'step'")
        except ValueError as error:
            if n != lines[-1][0]:
                raise ValueError(f"{path}, line {n}: not a metrics record ({error})") from None
            log(f"{path}: dropped the partial last line {n} ({line[:40]!r})")
            continue
        records.append(record)
    return records


# What stat's file types are called in messages, but regular files.
_FILE_KINDS = {
    stat.S_ISDIR: "a directory",
    stat.S_ISCHR: "a character device",
    stat.S_ISBLK: "a block device",
    stat.S_ISFIFO: "a FIFO",
    stat.S_ISSOCK: "a socket",
}


def _check_regular(path: pathlib.Path) -> None:
    """Raises ``ValueError`` unless ``path`` is a regular file (or a link to one), naming what
    it is instead."""
    mode = path.stat().st_mode
    if stat.S_ISREG(mode):
        return
    kind = next((name for test, name in _FILE_KINDS.items() if test(mode)), "another kind of file")
    where = f", {path.resolve()}" if path.is_symlink() else ""
    raise ValueError(f"{path}: not a regular file ({kind}{where})")


def plot_run(run_dir: pathlib.Path) -> list[pathlib.Path]:
    """Writes :func:`run_figures` to ``plots/`` (``loss.png``, ``learning_rate.png``,
    ``metrics.png``); writes nothing and returns ``[]`` if no step is logged (the plots of an
    earlier run are kept).

    Raises:
      FileNotFoundError, ValueError: as :func:`read_metrics`.
      RunDirLinkError: the run directory holds symbolic links (nothing is written).
    """
    figures = run_figures(run_dir)
    if not figures:
        return []
    RunDir(run_dir).refuse_links()
    plots = RunDir(run_dir).plots
    plots.mkdir(exist_ok=True)
    written = []
    for name, figure in figures.items():
        written.append(plots / f"{name}.png")
        figure.savefig(written[-1], dpi=100)
        figure_pyplot().close(figure)
    return written


def run_figures(run_dir: pathlib.Path) -> dict:
    """The figures of ``run_dir``'s logged metrics, by file name: ``loss`` (with ``eval_loss``)
    and ``learning_rate`` alone, and ``metrics``, a panel for every metric the run logged (a
    training metric with its ``eval_`` twin; one only evaluated, ``eval_bleu``, alone). Titles
    name the run and the metric; x is the step, with the tokens trained on top when the run's
    config is there; a metric logged once is a marked point, its value in the legend.

    Raises:
      FileNotFoundError, ValueError: as :func:`read_metrics`.
    """
    records = read_metrics(run_dir)
    groups = _metric_groups(records)
    if not groups:
        return {}
    plt = figure_pyplot()
    tokens_per_step = _tokens_per_step(run_dir)
    figures = {}
    for name in ("loss", "learning_rate"):
        if name in groups:
            figures[name], axes = plt.subplots(figsize=(6.4, 4.2))
            _fixed_margins(figures[name], top=1.0 if tokens_per_step else 0.5)
            _panel(axes, records, groups[name], f"{run_dir}: {_words(name)}")
            if tokens_per_step:
                tokens_axis(axes, tokens_per_step)
    # Axes of 4.3 x 2.8 inches, 0.9 between columns, 1.4 above a row (its titles and tokens axes).
    columns = min(len(groups), 3)
    rows = -(-len(groups) // columns)
    width, height = 5.2 * columns, 4.2 * rows + 0.5
    figure, panels = plt.subplots(rows, columns, figsize=(width, height), squeeze=False)
    _fixed_margins(figure, top=1.4, wspace=0.9 / 4.3, hspace=1.4 / 2.8)
    for axes, (name, keys) in zip(panels.flat, groups.items(), strict=False):
        _panel(axes, records, keys, _words(name))
        if tokens_per_step:
            tokens_axis(axes, tokens_per_step, "tokens")
    for axes in panels.flat[len(groups) :]:
        axes.remove()
    title = f"{run_dir}: every logged metric"
    title += f"; {tokens_label(tokens_per_step)}" if tokens_per_step else ""
    figure.suptitle(title, y=1 - 0.12 / height, va="top")
    figures["metrics"] = figure
    return figures


def _fixed_margins(figure, top: float, **spacing) -> None:
    """Margins of ``figure`` in inches: ``top`` above (titles, a tokens axis), 0.8 left, 0.6
    below, 0.2 right. ``tight_layout`` would measure them by drawing the figure once more, and
    leave a layout engine that has ``savefig`` draw it yet again before the drawing it saves."""
    width, height = figure.get_size_inches()
    figure.subplots_adjust(
        left=0.8 / width,
        right=1 - 0.2 / width,
        top=1 - top / height,
        bottom=0.6 / height,
        **spacing,
    )


def _panel(axes, records: list[dict], keys: list[str], title: str) -> None:
    """``keys``' values in ``records`` against their steps on ``axes``."""
    for key in keys:
        points = [(r["step"], r[key]) for r in records if _number(r.get(key))]
        draw(axes, *zip(*points, strict=True), label=key, value_in_legend=True)
    axes.set_title(title)
    axes.set_xlabel("step")
    axes.set_ylabel(_AXIS_LABELS.get(keys[0]) or _words(keys[0].removeprefix("eval_")))
    if "loss" in keys[0]:
        log_scale_if_wide(axes)
    readable_ticks(axes)
    axes.legend(fontsize="small")


# Axis labels that say what a number counts where its name alone does not.
_AXIS_LABELS = {"tokens_per_sec": "tokens/s (batch_size x seq_len positions, padding in)"}


def _words(name: str) -> str:
    return name.replace("_", " ")


def _metric_groups(records: list[dict]) -> dict[str, list[str]]:
    """The metrics of ``records`` by figure, in the order first logged (``loss`` and
    ``learning_rate`` first): ``{"loss": ["loss", "eval_loss"], "eval_bleu": ["eval_bleu"]}``;
    a downstream task's accuracies in one, ``{"task/hellaswag": ["task/hellaswag/acc",
    "task/hellaswag/acc_norm"]}``."""
    logged = dict.fromkeys(["loss", "learning_rate"])
    for record in records:
        logged |= dict.fromkeys(k for k, v in record.items() if k != "step" and _number(v))
    logged = [key for key in logged if any(_number(r.get(key)) for r in records)]
    groups = {}
    for key in logged:
        if is_count(key):  # what a task's metrics are over: said by its line, not drawn
            continue
        if key.startswith(PREFIX) and key.endswith(("/acc", "/acc_norm")):  # a task's shares
            group = key.rsplit("/", 1)[0]
        else:
            train = key.removeprefix("eval_")
            group = train if train in logged else key
        groups.setdefault(group, []).append(key)
    return groups


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _tokens_per_step(run_dir: pathlib.Path) -> int | None:
    """Token positions a step of the run trains on (``train.batch_size`` rows of
    ``data.seq_len``), from its ``config.yaml``; None where that is missing or unreadable."""
    import yaml

    try:
        config = yaml.safe_load(RunDir(run_dir).config.read_text())
        return int(config["train"]["batch_size"]) * int(config["data"]["seq_len"])
    except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError):
        return None
