"""A run's metrics: one JSON object per logged step in ``metrics.jsonl``, the same scalars as
TensorBoard events, PNG plots of the loss and learning-rate curves, and the devices' peak FLOP/s
that MFU is taken against."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
import socket
import stat
import struct
import sys
import time
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from flaxformer_lite.train.run_dir import RunDir

# Dense peak FLOP/s per chip for bf16 matmuls, by jax's device_kind; other devices: n/a.
PEAK_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
}


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

    def __init__(self, run_dir: pathlib.Path, *, resume_step: int = 0, log=print):
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


def read_metrics(run_dir: pathlib.Path, log=print) -> list[dict]:
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
    """Writes ``plots/loss.png`` (train and eval loss) and ``plots/learning_rate.png``; writes
    nothing and returns ``[]`` if no step is logged (the plots of an earlier run are kept).

    Raises:
      FileNotFoundError, ValueError: as :func:`read_metrics`.
    """
    records = read_metrics(run_dir)
    if not records:
        return []
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    plots = RunDir(run_dir).plots
    plots.mkdir(exist_ok=True)
    written = []
    for name, keys in (("loss", ("loss", "eval_loss")), ("learning_rate", ("learning_rate",))):
        figure, axes = plt.subplots(figsize=(6, 4))
        plotted = False
        for key in keys:
            points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            if points:
                axes.plot(*zip(*points, strict=True), label=key)
                plotted = True
        axes.set_xlabel("step")
        axes.set_ylabel(name.replace("_", " "))
        if plotted:  # a run stopped before its first log has nothing to draw
            axes.legend()
            if name == "loss":
                axes.set_yscale("log")
        figure.tight_layout()
        path = plots / f"{name}.png"
        figure.savefig(path, dpi=100)
        plt.close(figure)
        written.append(path)
    return written


def matmul_peak_flops(n: int = 2048, repeats: int = 5) -> float:
    """float32 FLOP/s of XLA's ``n x n x n`` matmul on the default device, the best of ``repeats``.

    A CPU has no datasheet number to look up: this measured peak is what MFU is taken against
    there, by ``train.py`` and ``benchmarks/train_step.py`` alike.
    """
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    matmul = jax.jit(jnp.matmul).lower(a, a).compile()
    matmul(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def peak_flops() -> float | None:
    """Peak FLOP/s of all devices: :data:`PEAK_FLOPS` for accelerators (``None`` for a kind not
    in the table); on CPU :func:`matmul_peak_flops`, once per host (simulated CPU devices share the
    same cores), all hosts taken to be alike."""
    devices = jax.devices()
    if devices[0].platform != "cpu":
        peak = PEAK_FLOPS.get(devices[0].device_kind)
        return peak * len(devices) if peak else None
    return matmul_peak_flops() * jax.process_count()
