"""Bad input and errors met while running (issue 27): metrics are never lost, config files
(YAML numbers, duplicate keys, non-UTF-8), non-finite settings, out of memory, a run on other
data or extended steps on resume, warnings that reach the terminal as plain lines."""

import shutil
import subprocess
import sys
import threading

import jax.numpy as jnp
import numpy as np
import pytest
from subprocess_env import subprocess_env
from tiny_runs import TINY

from flaxformer_lite.cli.library_log import library_log_to
from flaxformer_lite.cli.train import train_main
from flaxformer_lite.train import loop as loop_module
from flaxformer_lite.train.checkpoint import Checkpointer
from flaxformer_lite.train.config import ConfigError, load_config
from flaxformer_lite.train.loop import run
from flaxformer_lite.train.metrics import MetricsWriter, read_metrics
from flaxformer_lite.train.optim import make_schedule
from flaxformer_lite.train.resume import _config_differences, keep_schedule_span, stretch_schedule
from flaxformer_lite.train.run_dir import RunDir

pytestmark = pytest.mark.fast_compile


def test_a_corrupt_metrics_item_sets_its_checkpoint_aside(tmp_path, caplog):
    directory = tmp_path / "ckpt"
    with Checkpointer(directory, keep=3) as checkpointer:
        for step in (1, 2):
            state = {"a": np.full(3, step, np.float32)}
            checkpointer.save(step, state, data_state={}, config={}, metrics={"eval_loss": 1.0})
    (directory / "2" / "metrics" / "metrics").write_text("")
    with Checkpointer(directory, keep=3) as checkpointer:
        assert checkpointer.restore({"a": jnp.zeros(3, jnp.float32)}).step == 1
        assert checkpointer.all_steps() == [1]
    assert (directory / "2.corrupt").is_dir()
    assert any("metrics/metrics is unreadable" in r.getMessage() for r in caplog.records)


def test_a_partial_last_metrics_line_is_dropped_with_a_notice(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    notices = []
    assert [r["step"] for r in read_metrics(tmp_path, log=notices.append)] == [1, 2]
    assert len(notices) == 1 and "partial last line 3" in notices[0]
    MetricsWriter(tmp_path, resume_step=2, log=notices.append).close()
    assert path.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl, line 2"):
        read_metrics(tmp_path)


def test_a_run_that_logged_but_wrote_no_checkpoint_starts_again_keeping_its_metrics(tmp_path):
    """kill -9 (or a full disk) after the first logged step and before the first checkpoint:
    the same command starts the run again at step 0, the metrics it logged kept aside."""
    run_dir = tmp_path / "run"
    with RunDir(run_dir).locked():  # a run that logged, and wrote no checkpoint
        (run_dir / "metrics.jsonl").write_text('{"step": 5, "loss": 1.0}\n')
        (run_dir / "tb").mkdir()
        (run_dir / "tb" / "events").write_text("events")
    cfg = load_config(None, [f"run_dir={run_dir}", *TINY, "train.steps=2"])
    lines = []
    run(cfg, progress=False, log=lines.append)
    assert (
        f"{run_dir} logged steps but wrote no checkpoint: starting again at step 0 (what it "
        "logged is kept in metrics.jsonl.old1 and tb.old1)"
    ) in lines
    assert (run_dir / "metrics.jsonl.old1").read_text() == '{"step": 5, "loss": 1.0}\n'
    assert (run_dir / "tb.old1" / "events").read_text() == "events"
    assert [r["step"] for r in read_metrics(run_dir, log=None)] == [1, 2]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("train:\n  steps: 3\n  steps: 4\n", "the key 'steps' is given twice"),
        ("optimizer:\n  lr: .nan\n", "optimizer.lr must be a finite number"),
        ("optimizer:\n  lr: -.inf\n", "optimizer.lr must be a finite number"),
        ("data:\n  seq_len: 512\n", r"data.seq_len \(512\) exceeds model.max_length \(256\)"),
    ],
)
def test_bad_config_files_are_refused_naming_the_key(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path)
    assert len(str(info.value).splitlines()) == 1


def test_yaml_numbers_as_writers_emit_them(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optimizer:\n  lr: 1e-3\n  eps: 3.0E-4\n  b2: .99\n  weight_decay: 1E2\n")
    cfg = load_config(path)
    assert (cfg.optimizer.lr, cfg.optimizer.eps) == (1e-3, 3.0e-4)
    assert (cfg.optimizer.b2, cfg.optimizer.weight_decay) == (0.99, 100.0)
    assert load_config(path, ["optimizer.lr=1e-3"]) == cfg


def test_a_config_file_not_utf8_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"train:\n  steps: 3 \xff\n")
    with pytest.raises(ConfigError, match=f"config file {path} is not UTF-8"):
        load_config(path)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_learning_rates_are_refused(value):
    with pytest.raises(ConfigError, match="optimizer.lr must be a finite number"):
        load_config(None, [f"optimizer.lr={value}"])


def test_a_run_dir_naming_a_file_exits_2_with_one_line(tmp_path, capsys):
    path = tmp_path / "file"
    path.write_text("")
    assert train_main(["--no-progress", f"run_dir={path}", *TINY, "train.steps=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0], err


@pytest.mark.parametrize(
    ("message", "figures"),
    [
        (  # the CPU's, as gpt2_small's first step on a laptop gives it
            "RESOURCE_EXHAUSTED: Out of memory allocating 12884901888 bytes.",
            "12.00 GiB asked for, the host has ",
        ),
        (  # the TPU compiler's, with the program's total and the HBM
            "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
            "space hbm. Used 20.25G of 15.48G hbm. Exceeded hbm capacity by 4.77G.",
            "the program needs 20.25 GiB of 15.48 GiB",
        ),
    ],
)
def test_out_of_memory_exits_2_with_what_it_needed(tmp_path, capsys, monkeypatch, message, figures):
    import jax

    def run(*args, **kwargs):
        raise jax.errors.JaxRuntimeError(f"{message}\nBufferAssignment OOM Debugging.\n...")

    monkeypatch.setattr(loop_module, "run", run)
    assert train_main(["--no-progress", f"run_dir={tmp_path / 'run'}", *TINY]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: out of memory: {figures}"), err
    assert "flaxformer-lite compile" in err[0] and "train.batch_size" in err[0], err


def test_other_xla_runtime_errors_are_not_taken_for_user_errors(tmp_path, monkeypatch):
    import jax

    def run(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("INTERNAL: a bug")

    monkeypatch.setattr(loop_module, "run", run)
    with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
        train_main(["--no-progress", f"run_dir={tmp_path / 'run'}", *TINY])


def test_more_train_steps_on_resume_keep_the_schedule_span():
    common = ["optimizer.lr=1e-3", "optimizer.warmup_steps=0"]
    saved = load_config(None, ["train.steps=60", *common])
    extended = load_config(None, ["train.steps=80", *common])
    logged = []
    kept = keep_schedule_span(saved, extended, logged.append)
    assert kept.optimizer.schedule_steps == 60
    # Issue 45 item 8: what it costs and the one flag that trains on a whole schedule, in the
    # same line.
    assert logged == [
        "train.steps 60 -> 80: the cosine schedule keeps its 60-step span, so the last 20 steps "
        "train at its end rate 0.0001; for a schedule over all 80 steps, pass --stretch-schedule "
        "(this run goes on along the stretched schedule) or --fresh (start over)"
    ]
    assert _config_differences(saved, kept) == []  # no other change
    schedule = make_schedule(kept.optimizer, total_steps=60, d_model=64)
    rates = [float(schedule(step)) for step in (60, 61, 79)]
    np.testing.assert_allclose(rates, [1e-4] * 3, rtol=1e-5)  # stays at the end value
    # Stretching it over the run's steps (--stretch-schedule) is the run's own shape of
    # schedule, no changed setting; any other span is one, refused without --force.
    stretched = stretch_schedule(extended)
    assert keep_schedule_span(saved, stretched, logged.append) is stretched
    assert stretched.optimizer.schedule_steps == 80 and _config_differences(saved, stretched) == []
    other = load_config(None, ["train.steps=80", *common, "optimizer.schedule_steps=70"])
    (changed,) = _config_differences(saved, other)
    assert changed.lines == ("  optimizer.schedule_steps: None -> 70",), changed
    # A third run with the same steps inherits the kept span without a change.
    assert keep_schedule_span(kept, extended, logged.append) == kept


def text_run(run_dir, path, *overrides):
    return load_config(
        None,
        [
            f"run_dir={run_dir}",
            *TINY,
            "data.source=text",
            f"data.path={path}",
            "data.tokenizer=char",
            "data.seq_len=16",
            "data.validation_fraction=0.2",
            *overrides,
        ],
    )


def test_a_tokenizer_left_by_a_failed_attempt_is_refused_for_other_data(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    first, second = tmp_path / "words.txt", tmp_path / "sums.txt"
    first.write_text("".join(f"line {i} of words\n" for i in range(40)))
    second.write_text("".join(f"{i}+{i + 1}={2 * i + 1}\n" for i in range(40)))
    failing = text_run(run_dir, first, "train.steps=2")

    def fail(*args, **kwargs):
        raise ValueError("the optimizer failed")

    with monkeypatch.context() as patch:  # a failure after the tokenizer was saved
        patch.setattr(loop_module, "starting_state", fail)
        with pytest.raises(ValueError, match="the optimizer failed"):
            run(failing, progress=False, log=lambda _: None)
    assert (run_dir / "tokenizer").is_dir() and (run_dir / "inputs.json").is_file()
    other = text_run(run_dir, second, "train.steps=1")
    with pytest.raises(ConfigError, match="the data differ") as info:
        run(other, progress=False, log=lambda _: None)
    assert f"data.path: '{first}' -> '{second}'" in str(info.value)
    logged = []
    run(other, force=True, progress=False, log=logged.append)
    assert any("moved the tokenizer made from the old data" in line for line in logged)
    from flaxformer_lite.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(run_dir / "tokenizer")
    assert tokenizer.decode(tokenizer.encode("123+45=168")) == "123+45=168"


@pytest.mark.slow
def test_changed_data_on_resume_are_shown_and_force_goes_on(tmp_path):
    run_dir, path = tmp_path / "run", tmp_path / "lines.txt"
    path.write_text("".join(f"{i}+{i + 1}={2 * i + 1}\n" for i in range(40)))
    run(text_run(run_dir, path, "train.steps=2"), progress=False, log=lambda _: None)
    path.write_text("".join(f"{i}+{i + 2}={2 * i + 2}\n" for i in range(60)))  # more lines
    more = text_run(run_dir, path, "train.steps=3")
    with pytest.raises(ConfigError, match="the data differ") as info:
        run(more, progress=False, log=lambda _: None)
    assert f"{path}: " in str(info.value) and "bytes ->" in str(info.value)
    logged = []
    run(more, force=True, progress=False, log=logged.append)
    assert any("going on with changed data" in line for line in logged)
    assert any("resuming with changed data" in line for line in logged)  # the pipeline's diff
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]


def test_unraisable_and_thread_exceptions_go_to_the_library_log(tmp_path, capfd):
    """What TensorStore's and orbax's threads report outside of logging (conftest.py puts
    pytest's hooks back after the test)."""
    library_log_to(tmp_path / "library.log")

    class Closing:
        def __del__(self):
            raise RuntimeError("Event loop is closed")

    Closing()  # collected at once: its exception is unraisable
    thread = threading.Thread(target=lambda: 1 / 0, name="a-library-thread")
    thread.start()
    thread.join()
    assert capfd.readouterr().err == ""
    text = (tmp_path / "library.log").read_text()
    assert "RuntimeError: Event loop is closed" in text
    assert "exception in a-library-thread" in text and "ZeroDivisionError" in text


@pytest.mark.parametrize("absl_first", [True, False])
def test_the_package_s_warnings_reach_the_terminal_as_plain_lines(absl_first):
    """absl sets the root logger up as ``logging.basicConfig()`` does at its first record
    (orbax logs one as it is imported), before or after a command starts."""
    absl = "from absl import logging as absl; absl.vlog(1, 'set up')"
    code = "\n".join(
        [
            "import logging",
            "from flaxformer_lite.cli.errors import guarded",
            absl if absl_first else "",
            "def command():",
            "    " + ("" if absl_first else absl),
            "    logging.getLogger('flaxformer_lite.train.checkpoint').warning('step %d', 2)",
            "    return 0",
            "raise SystemExit(guarded(command))",
        ]
    )
    child = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(1), capture_output=True, text=True
    )
    assert (child.returncode, child.stderr) == (0, "warning: step 2\n")


def test_stretch_schedule_resumes_a_raised_run_on_the_longer_schedule(
    trained_runs, tmp_path, capsys
):
    """Issue 45 item 8: the one flag the extension's line names, resuming without --force."""
    shutil.copytree(trained_runs("tiny"), tmp_path / "run")  # 2 steps of SHARED_RUNS["tiny"]
    common = ["--no-progress", f"run_dir={tmp_path / 'run'}", *TINY, "checkpoint.every=1"]
    assert train_main([*common, "train.steps=4", "--stretch-schedule"]) == 0
    out = capsys.readouterr().out
    assert "keeps its" not in out and "done:" in out
    assert "schedule_steps: 4" in (tmp_path / "run" / "config.yaml").read_text()
