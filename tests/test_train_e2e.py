"""train.py end to end on tiny configs: learning, exact resume, signals, kill -9, bad input."""

import json
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest
from run_states import checkpointed_state
from subprocess_env import subprocess_env
from tiny_runs import QUICK, SHARED_RUNS

from flaxformer_lite.cli import main
from flaxformer_lite.cli.train import train_main
from flaxformer_lite.models import training_flops_per_token
from flaxformer_lite.train.checkpoint import Checkpointer
from flaxformer_lite.train.config import ConfigError, load_config
from flaxformer_lite.train.loop import TrainingError, run
from flaxformer_lite.train.metrics import MetricsWriter, read_metrics

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

REPO = pathlib.Path(__file__).resolve().parents[1]


def config(run_dir, *overrides):
    return load_config(None, [f"run_dir={run_dir}", *QUICK, *overrides])


def records(run_dir):
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses(run_dir):
    return {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}


def quiet(_message):
    pass


def test_the_default_run_learns(trained_runs):
    run_dir = trained_runs("quick")  # QUICK for 150 steps, shared with test_bf16.py
    logged = losses(run_dir)
    assert logged[150] < 0.6 * logged[5], logged
    evals = [r["eval_accuracy"] for r in records(run_dir) if "eval_accuracy" in r]
    assert evals[-1] > evals[0] + 0.05, evals
    last = records(run_dir)[-1]
    assert last["tokens_per_sec"] > 0 and 0 < last["mfu"] < 1
    for name in ("config.yaml", "plots/loss.png", "plots/learning_rate.png", "tb"):
        assert (run_dir / name).exists(), name
    saved = load_config(run_dir / "config.yaml")
    assert saved.model.vocab_size == 260  # resolved from the byte tokenizer


def test_logged_tokens_per_sec_times_the_training_steps_alone(tmp_path, monkeypatch):
    """A fake clock: each train step takes 1 s, each evaluation and checkpoint save 1000 s."""
    from flaxformer_lite.train import actions, loop

    clock = types.SimpleNamespace(now=0.0)
    fake_time = types.SimpleNamespace(perf_counter=lambda: clock.now)
    monkeypatch.setattr(loop, "time", fake_time)
    monkeypatch.setattr(actions, "time", fake_time)

    def taking(seconds, fn):
        def call(*args, **kwargs):
            out = jax.block_until_ready(fn(*args, **kwargs))
            clock.now += seconds
            return out

        return call

    make_train_step = loop.configured_train_step
    monkeypatch.setattr(
        loop, "configured_train_step", lambda *a, **k: taking(1.0, make_train_step(*a, **k))
    )
    monkeypatch.setattr(actions, "evaluate", taking(1000.0, actions.evaluate))
    monkeypatch.setattr(actions, "to_savable", taking(1000.0, actions.to_savable))
    cfg = config(
        tmp_path / "run",
        "train.steps=12",
        "train.log_every=3",
        "train.eval_every=6",
        "checkpoint.every=4",
    )
    run(cfg, progress=False, log=quiet)
    logged = {r["step"]: r for r in records(tmp_path / "run")}
    assert sorted(logged) == [3, 6, 9, 12]
    tokens_per_sec = {step: r["tokens_per_sec"] for step, r in logged.items()}
    assert tokens_per_sec == {step: pytest.approx(8 * 32) for step in logged}  # 8 x 32 a second
    # MFU: the model's FLOPs per token times tokens/s over the machine's peak (the loop's own),
    # of the model as the run settled it (its vocabulary the tokenizer's)
    settled = load_config(tmp_path / "run" / "config.yaml").model
    mfu = training_flops_per_token(settled, cfg.data.seq_len) * 8 * 32 / loop.peak_flops()
    assert {step: r["mfu"] for step, r in logged.items()} == {
        step: pytest.approx(mfu, rel=1e-6) for step in logged
    }


def test_metrics_writer_records_missing_values_as_null(tmp_path):
    # The first logged step after compiling (train.steps=1, log_every=1, a resume whose first
    # step is logged) has no throughput yet.
    writer = MetricsWriter(tmp_path)
    writer.write(1, {"loss": 1.5, "tokens_per_sec": None, "mfu": float("nan"), "note": "x"})
    writer.close()
    assert read_metrics(tmp_path) == [
        {"step": 1, "loss": 1.5, "tokens_per_sec": None, "mfu": None, "note": "x"}
    ]


def test_interrupted_and_resumed_equals_uninterrupted(tmp_path):
    # Every step logged, an evaluation and a checkpoint every 2 steps: resumed at step 4, the
    # run trains steps 5 and 6 on the uninterrupted run's batches and evaluates at 6 as it does.
    often = ["train.log_every=1", "train.eval_every=2", "checkpoint.every=2"]
    run(config(tmp_path / "straight", "train.steps=6", *often), progress=False, log=quiet)
    run(config(tmp_path / "resumed", "train.steps=4", *often), progress=False, log=quiet)
    run(config(tmp_path / "resumed", "train.steps=6", *often), progress=False, log=quiet)
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")

    jax.tree.map(
        np.testing.assert_array_equal,
        checkpointed_state(tmp_path / "resumed", 6),
        checkpointed_state(tmp_path / "straight", 6),
    )
    evals = [
        [r.get("eval_loss") for r in records(tmp_path / name) if "eval_loss" in r]
        for name in ("straight", "resumed")
    ]
    assert evals[0] == evals[1]


def test_changed_config_is_refused_unless_forced_and_fresh_moves_the_run_aside(
    trained_runs, tmp_path
):
    run_dir = tmp_path / "run"
    shutil.copytree(trained_runs("tiny"), run_dir)  # 2 steps of SHARED_RUNS["tiny"]

    def tiny(*overrides):
        return load_config(None, [f"run_dir={run_dir}", *SHARED_RUNS["tiny"], *overrides])

    with pytest.raises(ConfigError, match="model.num_heads: 4 -> 2"):
        run(tiny("train.steps=3", "model.num_heads=2"), progress=False, log=quiet)
    messages = []
    run(
        tiny("train.steps=3", "optimizer.lr=0.002"), force=True, progress=False, log=messages.append
    )
    assert any("optimizer.lr" in m for m in messages)
    assert max(losses(run_dir)) == 3
    run(tiny("train.steps=1", "model.num_heads=2"), fresh=True, progress=False, log=quiet)
    assert (tmp_path / "run.old1" / "checkpoints").exists()
    assert max(losses(run_dir)) == 1


def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    cfg = config(
        run_dir,
        "train.steps=40",
        "checkpoint.every=1",
        "optimizer.lr=1e30",
        "optimizer.clip_norm=none",
    )
    with pytest.raises(TrainingError, match="not finite.*last good checkpoint: step"):
        run(cfg, progress=False, log=quiet)
    with Checkpointer(run_dir / "checkpoints", keep=3) as checkpointer:
        assert checkpointer.latest_step() is not None
    skipping = config(
        tmp_path / "skip",
        "train.steps=6",
        "optimizer.lr=1e30",
        "optimizer.clip_norm=none",
        "train.skip_nonfinite=true",
    )
    messages = []
    run(skipping, progress=False, log=messages.append)
    assert any("not finite" in m and "skipped" in m for m in messages)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train.step=3"], "did you mean 'train.steps'"),
        (["train.steps=many"], "train.steps must be an integer"),
        (["--config", "/nonexistent/x.yaml"], "cannot read config file /nonexistent/x.yaml"),
        (["data.source=text", "data.path=/nonexistent/*.txt"], "/nonexistent"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, message):
    assert train_main([f"run_dir={tmp_path / 'run'}", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_plot_subcommand(tmp_path, capsys):
    run(config(tmp_path / "run", "train.steps=5"), progress=False, log=quiet)
    (tmp_path / "run" / "plots" / "loss.png").unlink()
    assert main(["plot", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "plots" / "loss.png").exists()
    (tmp_path / "run" / "plots" / "loss.png").unlink()
    assert main(["plot", "--run-dir", str(tmp_path / "run")]) == 0  # as the other commands
    assert (tmp_path / "run" / "plots" / "loss.png").exists()
    for neither_or_both in ([], [str(tmp_path / "run"), "--run-dir", str(tmp_path / "run")]):
        with pytest.raises(SystemExit) as exit_:
            main(["plot", *neither_or_both])
        assert exit_.value.code == 2
        assert "name the run directory once" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "nothing")]) == 2
    assert "no metrics file" in capsys.readouterr().err


def start_training(run_dir, *overrides):
    """``train.py`` on one CPU device in a subprocess."""
    return subprocess.Popen(
        [
            sys.executable,
            str(REPO / "train.py"),
            "--no-progress",
            f"run_dir={run_dir}",
            *QUICK,
            *overrides,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(1),
        cwd=REPO,
    )


def wait_for(condition, process, timeout=300):
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"training exited early: {process.communicate()}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("training made no progress")
        time.sleep(0.2)


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits(tmp_path):
    run_dir = tmp_path / "run"
    process = start_training(run_dir, "train.steps=100000", "checkpoint.every=100000")
    wait_for(
        lambda: (
            (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip()
        ),
        process,
    )
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM at step" in err
    step = int(err.split("SIGTERM at step ")[1].split(":")[0])
    with Checkpointer(run_dir / "checkpoints", keep=3) as checkpointer:
        assert checkpointer.latest_step() == step


@pytest.mark.slow
def test_kill_9_resumes_from_the_last_finished_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    process = start_training(run_dir, "train.steps=100000", "checkpoint.every=3")
    checkpoints = run_dir / "checkpoints"

    def two_checkpoints():
        return (
            checkpoints.exists()
            and len([p for p in checkpoints.iterdir() if p.name.isdigit()]) >= 2
        )

    wait_for(two_checkpoints, process)
    process.kill()
    process.wait()
    with Checkpointer(checkpoints, keep=3) as checkpointer:
        last = checkpointer.latest_step()
    messages = []
    run(
        config(run_dir, f"train.steps={last + 2}", "checkpoint.every=3"),
        progress=False,
        log=messages.append,
    )
    assert f"resumed from step {last} of {checkpoints}" in messages
    assert max(losses(run_dir)) == last + 2
    assert np.all(np.diff(sorted(losses(run_dir))) > 0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset, steps, metric, target, loss_ratio",
    # Token accuracy of the digits (chance ~0.1); sentence accuracy over 3 classes (chance 1/3).
    [
        ("transformer_tiny", 100, "eval_accuracy", 0.25, 0.7),
        ("bert_tiny", 300, "eval_accuracy", 0.42, 0.9),
    ],
)
def test_tiny_presets_learn_their_tasks(
    tmp_path, full_optimization, preset, steps, metric, target, loss_ratio
):
    """The CPU presets of the encoder-decoder (number words -> digits) and the encoder
    (3-way sentiment with negation), shortened; their full runs go further. Hundreds of steps:
    compiled with XLA's optimizations, which pay here. The encoder-decoder is well past its
    target at step 100 (eval accuracy about 0.6 there); the encoder needs 300."""
    cfg = load_config(
        REPO / "configs" / f"{preset}.yaml",
        [
            f"run_dir={tmp_path / 'run'}",
            f"train.steps={steps}",
            "train.eval_every=100",
            "data.eval_size=64",
            "train.log_every=10",
            "train.decode_examples=0",  # the metric is teacher-forced; nothing decoded is read
        ],
    )
    run(cfg, progress=False, log=quiet)
    evals = [r[metric] for r in records(tmp_path / "run") if metric in r]
    assert evals[-1] > target, evals
    logged = losses(tmp_path / "run")
    # One batch's loss is noisy (32 sentences): the last three logged, against the first.
    last = np.mean([logged[step] for step in sorted(logged)[-3:]])
    assert last < loss_ratio * logged[min(logged)], logged
