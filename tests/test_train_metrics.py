"""A run's metrics (``flaxformer_lite.train.metrics``): TensorBoard events, a disk that fills
while they are written, a ``metrics.jsonl`` that is not a regular file, a run with nothing to
plot, and the figures of one that has: every logged metric, titled and labelled; the devices'
peak FLOP/s that MFU is taken against."""

import builtins
import io
import json
import os
import pathlib
import re
import shutil
import struct
import threading

import jax
import pytest
import yaml
from mounts import mount_works, tmpfs, train_under
from tiny_runs import TINY

from flaxformer_lite.cli import main
from flaxformer_lite.cli.train import train_main
from flaxformer_lite.train import metrics, peak_flops
from flaxformer_lite.train.config import TrainConfig
from flaxformer_lite.train.metrics import MetricsWriter, plot_run, read_metrics
from flaxformer_lite.train.run_dir import MARK

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_peak_flops_is_the_datasheet_on_accelerators_and_a_measured_matmul_on_cpu(
    monkeypatch, tmp_path
):
    assert 0 < peak_flops.matmul_peak_flops(n=128, repeats=2) < float("inf")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    timings = iter([7.0e9, 5.0e9])
    monkeypatch.setattr(peak_flops, "matmul_peak_flops", lambda: next(timings))
    # Issue 45 item 9: this host's CPU, measured once; a later start (a resumed run) reads the
    # same peak, so its MFU compares.
    assert peak_flops.peak_flops() == peak_flops.peak_flops() == 7.0e9
    (cached,) = json.loads((tmp_path / "flaxformer_lite" / "cpu_peak_flops.json").read_text())
    assert cached.endswith(f"cores, jax {jax.__version__}")
    (tmp_path / "flaxformer_lite" / "cpu_peak_flops.json").write_text("{not json")
    assert peak_flops.peak_flops() == 5.0e9  # a damaged cache: measured again
    chip = type("Device", (), {"platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3"})
    monkeypatch.setattr(jax, "devices", lambda: [chip(), chip()])
    assert peak_flops.peak_flops() == 2 * 989e12
    chip.device_kind = "a chip not in the table"
    assert peak_flops.peak_flops() is None


def events(directory: pathlib.Path) -> list:
    """The events of every TFRecord file in ``directory``, checksums checked."""
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    read = []
    for path in sorted(directory.iterdir()):
        data = path.read_bytes()
        while data:
            (length,) = struct.unpack("<Q", data[:8])
            assert struct.unpack("<I", data[8:12])[0] == masked_crc32c(data[:8])
            payload, data = data[12 : 12 + length], data[12 + length :]
            assert struct.unpack("<I", data[:4])[0] == masked_crc32c(payload)
            data = data[4:]
            read.append(Event.FromString(payload))
    return read


def test_tensorboard_events_hold_the_scalars_and_purge_what_a_resumed_run_drops(tmp_path):
    writer = MetricsWriter(tmp_path)
    writer.write(1, {"loss": 2.0, "learning_rate": 1e-3, "mfu": None})
    writer.write(2, {"loss": 1.5, "learning_rate": 1e-3, "mfu": None})
    writer.close()
    MetricsWriter(tmp_path, resume_step=1).close()
    read = events(tmp_path / "tb")
    scalars = [(e.step, v.tag, v.simple_value) for e in read for v in e.summary.value]
    assert scalars == [
        (1, "loss", 2.0),
        (1, "learning_rate", pytest.approx(1e-3)),
        (2, "loss", 1.5),
        (2, "learning_rate", pytest.approx(1e-3)),
    ]
    # TensorBoard drops the steps from a session's start on, as metrics.jsonl drops them
    starts = [e.step for e in read if e.HasField("session_log")]
    assert starts == [1, 2]
    assert all(e.file_version == "brain.Event:2" for e in read if e.HasField("file_version"))


def test_a_full_disk_under_the_events_raises_naming_the_file(tmp_path, monkeypatch):
    """The events file opened on /dev/full: every write past the buffer fails with ENOSPC, as
    on a full disk. tensorboardX's writer thread died of it and the run blocked for good on its
    queue; the writer raises an ``OSError`` naming the file instead (the CLI's exit 2)."""
    real_open = io.open

    def open_on_full_disk(file, mode="r", *args, **kwargs):
        if "tfevents" in str(file):
            return real_open("/dev/full", mode, *args, **kwargs)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_on_full_disk)
    monkeypatch.setattr(io, "open", open_on_full_disk)
    raised = []

    def log_steps():
        try:
            writer = MetricsWriter(tmp_path)
            try:
                for step in range(1, 100):
                    writer.write(step, {"loss": 1.0, "accuracy": 0.5, "learning_rate": 1e-3})
            finally:
                writer.close()
        except OSError as error:
            raised.append(error)

    logging = threading.Thread(target=log_steps, daemon=True)
    logging.start()
    logging.join(timeout=30)
    assert not logging.is_alive(), "the metrics writer blocked on a full disk"
    assert len(raised) == 1, raised
    message = str(raised[0])
    assert len(message.splitlines()) == 1, message
    assert str(tmp_path / "tb" / "events.out.tfevents") in message, message
    assert "No space left on device" in message, message


@pytest.mark.slow
@pytest.mark.skipif(not mount_works(tmpfs("4k")), reason="no user and mount namespaces here")
def test_train_exits_2_when_the_disk_under_the_events_fills(tmp_path):
    """The real thing: a 16 KiB tmpfs under ``RUN/tb`` fills after some tens of logged steps."""
    run_dir = tmp_path / "run"
    tb = run_dir / "tb"
    args = [*TINY, "train.steps=2000", "checkpoint.every=1000"]
    # It used to hang for good, signals ignored: killed after 120 s.
    status, out, err = train_under(tmpfs("16k"), tb, run_dir, args, timeout=120)
    assert status == 2, (out[-2000:], err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: cannot write {tb}/events.out.tfevents"), err[-3000:]
    assert "No space left on device" in last, last


# A character device, as /dev/zero is (read whole, it never ends); /dev/null keeps a regression
# from reading until the kernel kills the tests.
NOT_REGULAR = {"a character device": "/dev/null", "a directory": None}


def make_not_regular(path: pathlib.Path, kind: str) -> None:
    if NOT_REGULAR[kind] is None:
        path.mkdir()
    else:
        path.symlink_to(NOT_REGULAR[kind])


@pytest.mark.parametrize("kind", NOT_REGULAR)
def test_a_metrics_file_that_is_not_a_regular_file_is_refused(tmp_path, kind):
    path = tmp_path / "metrics.jsonl"
    make_not_regular(path, kind)
    for read in (lambda: read_metrics(tmp_path), lambda: MetricsWriter(tmp_path, resume_step=3)):
        with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: not a regular file "):
            read()
    assert path.is_symlink() or path.is_dir()  # left as it was
    assert main(["plot", str(tmp_path)]) == 2
    assert not (tmp_path / "plots").exists()


@pytest.mark.slow
def test_resuming_with_metrics_on_a_character_device_exits_2_with_one_line(
    trained_runs, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    shutil.copytree(trained_runs("tiny"), run_dir)
    args = [f"run_dir={run_dir}", *TINY, "checkpoint.every=1"]  # SHARED_RUNS["tiny"]'s
    path = run_dir / "metrics.jsonl"
    path.unlink()
    make_not_regular(path, "a character device")
    capsys.readouterr()
    assert train_main(["--no-progress", *args, "train.steps=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds symbolic links" in err[0], err  # a link: the run writes
    assert "metrics.jsonl -> /dev/null" in err[0], err
    assert os.readlink(path) == NOT_REGULAR["a character device"]


@pytest.mark.parametrize("logged", ["", "\n"])
def test_plot_refuses_a_run_with_nothing_logged_and_keeps_its_plots(tmp_path, capsys, logged):
    (tmp_path / "run.json").write_text(json.dumps(MARK))  # a run's directory
    path = tmp_path / "metrics.jsonl"
    path.write_text(logged)
    plots = tmp_path / "plots"
    plots.mkdir()
    (plots / "loss.png").write_bytes(b"the last run's plot")
    assert plot_run(tmp_path) == []  # what the training loop calls at a run's end
    assert main(["plot", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {path}: no metrics logged yet, nothing to plot"
    ]
    assert sorted(plots.iterdir()) == [plots / "loss.png"]
    assert (plots / "loss.png").read_bytes() == b"the last run's plot"
    (tmp_path / "run.json").unlink()  # metrics and plots, not a run's: the user's folder
    path.write_text('{"step": 1, "loss": 2.0}\n')
    assert main(["plot", str(tmp_path)]) == 2
    assert "is neither a run directory" in capsys.readouterr().err
    assert (plots / "loss.png").read_bytes() == b"the last run's plot"
    (tmp_path / "run.json").write_text(json.dumps(MARK))
    path.unlink()
    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics file" in capsys.readouterr().err
    assert (plots / "loss.png").read_bytes() == b"the last run's plot"


def short_run(directory: pathlib.Path) -> pathlib.Path:
    """A run directory as a short ``train.py`` run leaves it: training metrics every 50 steps,
    one evaluation at the end (a single point of each eval metric), MFU not known (null)."""
    directory.mkdir()
    (directory / "config.yaml").write_text(yaml.safe_dump(TrainConfig().to_dict()))
    logs = [
        {"step": s, "loss": 3 / s**0.5, "accuracy": s / 500, "learning_rate": 1e-3}
        | {"grad_norm": 1 / s, "tokens_per_sec": 25_000.0 + s, "mfu": None}
        for s in range(50, 401, 50)
    ]
    evals = {"eval_loss": 0.2, "eval_accuracy": 0.75, "eval_perplexity": 1.22, "eval_tokens": 512}
    records = logs + [{"step": 400, **evals, "eval_exact_match": 0.5}]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


def test_plot_draws_every_logged_metric_titled_with_the_run_and_marks_single_points(tmp_path):
    run_dir = short_run(tmp_path / "run")
    figures = metrics.run_figures(run_dir)
    assert list(figures) == ["loss", "learning_rate", "metrics"]
    panels = figures["metrics"].axes
    assert [ax.get_title() for ax in panels] == [
        "loss",
        "learning rate",
        "accuracy",
        "grad norm",
        "tokens per sec",
        "eval perplexity",
        "eval tokens",
        "eval exact match",
    ]  # mfu was never known: no panel
    assert figures["metrics"].get_suptitle() == (
        f"{run_dir}: every logged metric; tokens (2,048 a step: batch_size x seq_len)"
    )
    for name in ("loss", "learning_rate"):
        assert figures[name].axes[0].get_title() == f"{run_dir}: {name.replace('_', ' ')}"
    for ax in [*panels, figures["loss"].axes[0], figures["learning_rate"].axes[0]]:
        assert ax.get_xlabel() == "step"
        (tokens,) = ax.child_axes  # the tokens trained by each step, on top
        assert tokens.get_xlabel().startswith("tokens")
        assert [line.get_label() for line in ax.get_legend().get_lines()] == [
            line.get_label() for line in ax.lines
        ]
    assert figures["loss"].axes[0].child_axes[0].get_xlabel() == (
        "tokens (2,048 a step: batch_size x seq_len)"
    )
    loss, eval_loss = figures["loss"].axes[0].lines
    assert eval_loss.get_label() == "eval_loss = 0.2" and len(loss.get_xdata()) == 8
    assert list(eval_loss.get_xdata()) == [400]
    assert eval_loss.get_marker() == "o"  # a line through one point draws nothing
    accuracy = panels[2]
    assert accuracy.get_ylabel() == "accuracy"
    assert [line.get_label() for line in accuracy.lines] == ["accuracy", "eval_accuracy = 0.75"]
    assert [line.get_label() for line in panels[6].lines] == ["eval_tokens = 512"]
    assert plot_run(run_dir) == [run_dir / "plots" / f"{name}.png" for name in figures]
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == [
        "learning_rate.png",
        "loss.png",
        "metrics.png",
    ]


def test_plot_ticks_read_as_numbers_not_run_together(tmp_path):
    figure = metrics.run_figures(short_run(tmp_path / "run"))["metrics"]
    figure.canvas.draw()
    axes = figure.axes[4]  # tokens_per_sec: 25,050 to 25,400
    assert axes.get_title() == "tokens per sec"
    labels = [t.get_text() for t in axes.get_yticklabels() + axes.child_axes[0].get_xticklabels()]
    assert labels and all(re.fullmatch(r"−?\d+(\.\d+)?k?", label) for label in labels), labels
    assert len(axes.get_xticks()) <= 7


def test_a_loss_spanning_decades_is_on_a_log_axis_in_decimals(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    records = [{"step": s, "loss": 10 / s} for s in (1, 10, 100, 1000)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    figures = metrics.run_figures(run_dir)
    assert list(figures) == ["loss", "metrics"]  # no config.yaml: no tokens axis, else as usual
    (axes,) = figures["loss"].axes
    assert axes.get_yscale() == "log" and axes.child_axes == []
    figures["loss"].canvas.draw()
    assert {t.get_text() for t in axes.get_yticklabels()} >= {"0.1", "1", "10"}


def test_an_infinite_loss_does_not_make_a_narrow_loss_a_log_axis(tmp_path):
    """Issue 43 item 19: an inf loss switched the plot to a log axis and lost its ticks."""
    records = [
        {"step": 1, "loss": 2.0},
        {"step": 2, "loss": float("inf")},
        {"step": 3, "loss": 1.5},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (axes,) = metrics.run_figures(tmp_path)["loss"].axes
    assert axes.get_yscale() == "linear"


def test_a_dropped_partial_line_is_a_warning_not_among_the_output(tmp_path, capsys, caplog):
    """Issue 43 item 19: the notice went to stdout, unlabelled; as a warning of the package it
    reaches the terminal's stderr as ``warning: ...`` (plain_terminal_records)."""
    (tmp_path / "run.json").write_text(json.dumps(MARK))  # a run's directory
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert main(["plot", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert all(line.startswith("wrote ") for line in out.splitlines()), out
    (record,) = [r for r in caplog.records if "partial" in r.getMessage()]
    assert (record.name, record.levelname) == ("flaxformer_lite.train.metrics", "WARNING")
    assert record.getMessage() == (
        f'{tmp_path / "metrics.jsonl"}: dropped the partial last line 2 (\'{{"step": 2, "lo\')'
    )
