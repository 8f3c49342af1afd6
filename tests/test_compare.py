"""``flaxformer-lite compare``: two runs' curves in one PNG, their final metrics and the settings
in which they differ, on run directories laid out as train.py writes them and on two tiny runs
trained by it."""

import dataclasses
import json
import re

import numpy as np
import pytest
import yaml
from PIL import Image

from flaxformer_lite.cli import main
from flaxformer_lite.train.compare import comparison_figure, differing_settings, load_runs
from flaxformer_lite.train.config import TrainConfig

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


def make_run(directory, cfg: TrainConfig, records):
    """A run directory as ``train.py`` leaves it: ``config.yaml`` and ``metrics.jsonl``."""
    directory.mkdir(parents=True)
    (directory / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture
def two_runs(tmp_path):
    base = TrainConfig()
    fast = dataclasses.replace(
        base,
        optimizer=dataclasses.replace(base.optimizer, lr=0.01),
        train=dataclasses.replace(base.train, batch_size=64),
    )
    curve = [{"step": s, "loss": 2.0 / s, "learning_rate": 1e-3} for s in (10, 20, 30)]
    evals = [{"step": 30, "eval_loss": 0.5, "eval_exact_match": 0.25}]
    make_run(tmp_path / "a", base, curve + evals)
    make_run(tmp_path / "b", fast, [{**r, "loss": r["loss"] / 2} for r in curve])
    return tmp_path / "a", tmp_path / "b"


def test_compare_writes_the_figure_and_both_tables(two_runs, tmp_path, capsys):
    a, b = two_runs
    out = tmp_path / "figures" / "ab.png"
    assert main(["compare", str(a), str(b), "--metric", "loss", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    image = np.asarray(Image.open(out))
    assert image.shape[0] > 100 and image.shape[1] > 200 and image.std() > 0
    lines = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.strip()}
    assert lines["final"] == ["metrics", str(a), str(b)]
    assert lines["loss"] == ["0.06667", "0.03333"]
    assert lines["eval_exact_match"] == ["0.25", "-"]  # never logged by b
    assert lines["step"] == ["30", "30"]
    assert lines["optimizer.lr"] == ["0.003", "0.01"]
    assert lines["train.batch_size"] == ["32", "64"]
    assert "run_dir" not in lines and "seed" not in lines  # equal settings are left out
    assert f"wrote {out}" in text


def test_differing_settings_and_tokens_per_step(two_runs):
    runs = load_runs(two_runs)
    assert differing_settings(runs) == {
        "optimizer.lr": [0.003, 0.01],
        "train.batch_size": [32, 64],
    }
    assert [run.tokens_per_step for run in runs] == [32 * 64, 64 * 64]


def test_a_run_saved_with_the_old_data_task_key_compares_by_the_new_name(two_runs):
    old = yaml.safe_load((two_runs[0] / "config.yaml").read_text())
    data = old["data"]
    data["task"], data["task_options"] = data.pop("generator"), data.pop("generator_options")
    (two_runs[0] / "config.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    assert set(differing_settings(load_runs(two_runs))) == {"optimizer.lr", "train.batch_size"}


def test_several_metrics_in_one_flag_and_repeated(two_runs, tmp_path):
    a, b = two_runs
    out = tmp_path / "c.png"
    argv = ["compare", str(a), str(b), "--metric", "loss", "learning_rate"]
    assert main([*argv, "--metric", "eval_loss", "--out", str(out)]) == 0
    assert Image.open(out).size[1] > Image.open(out).size[0] / 2  # three rows of plots


def test_each_panel_is_titled_and_a_single_eval_point_is_drawn_as_a_marker(two_runs):
    """As after flaxformer-lite ablation --steps 400: each run evaluated once, at its end."""
    runs = load_runs(two_runs)
    figure = comparison_figure(runs, ["loss", "eval_loss", "eval_exact_match"])
    panels = figure.axes
    assert [ax.get_title() for ax in panels] == [
        f"{metric} by {by}"
        for metric in ("loss", "eval_loss", "eval_exact_match")
        for by in ("step", "tokens")
    ]
    tokens = "tokens (steps x batch_size x seq_len)"
    assert [ax.get_xlabel() for ax in panels[:2]] == ["step", tokens]
    assert all(ax.has_data() for ax in panels)
    (legend,) = figure.legends  # one for the figure: a run keeps its colour in every panel
    assert [text.get_text() for text in legend.get_texts()] == [str(path) for path in two_runs]
    (point,) = panels[3].lines  # eval_loss by tokens: run a's one evaluation
    assert list(point.get_xdata()) == [30 * 32 * 64] and point.get_marker() == "o"
    assert [t.get_text() for t in panels[3].texts] == ["0.5", f"not logged by {two_runs[1]}"]


def test_the_tokens_axis_has_short_labels(two_runs):
    figure = comparison_figure(load_runs(two_runs), ["loss"])
    figure.canvas.draw()
    ax = figure.axes[1]
    low, high = ax.get_xlim()
    ticks = zip(ax.get_xticks(), ax.get_xticklabels(), strict=True)
    labels = [label.get_text() for x, label in ticks if low <= x <= high]
    assert 3 <= len(labels) <= 7, labels  # in full (131072) they ran into each other
    assert all(re.fullmatch(r"\d+(\.\d+)?[kM]?", label) for label in labels), labels


def test_an_unknown_metric_or_a_directory_without_a_run_exits_2(two_runs, tmp_path, capsys):
    a, b = two_runs
    out = str(tmp_path / "x.png")
    assert main(["compare", str(a), str(b), "--metric", "los", "--out", out]) == 2
    assert "--metric los" in capsys.readouterr().err
    assert main(["compare", str(a), str(tmp_path / "nothing")]) == 2
    assert "nothing" in capsys.readouterr().err
    make_run(tmp_path / "new", TrainConfig(), [])  # started, nothing logged yet
    assert main(["compare", str(a), str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {tmp_path / 'new' / 'metrics.jsonl'}: no metrics logged yet"
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "train: [1\n",
            "not readable YAML (expected ',' or ']', but got '<stream end>' at line 2)",
        ),
        ("", "not a run's resolved config (no mapping of settings)"),
        ("!!python/object:os.system {}\n", "not readable YAML (could not determine a construct"),
        (
            "train:\n  steps: 3\ndata:\n  seq_len: 8\n",
            "not a run's resolved config (no train.batch_size)",
        ),
    ],
)
def test_a_run_with_a_bad_config_yaml_exits_2_in_one_line(two_runs, tmp_path, text, message):
    """Issue 43 item 12: YAMLError, TypeError or KeyError tracebacks."""
    a, b = two_runs
    (b / "config.yaml").write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"{b / 'config.yaml'}: {message}")) as info:
        load_runs([a, b])
    assert len(str(info.value).splitlines()) == 1


def test_a_metric_logged_as_text_is_named(two_runs, tmp_path, capsys):
    """Issue 43 item 17: it said Unknown format code 'g'."""
    a, b = two_runs
    (b / "metrics.jsonl").write_text('{"step": 10, "loss": "high"}\n')
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --metric loss: {b} logged 'high' at step 10, not a number\n"


@pytest.mark.slow
def test_compare_two_tiny_trained_runs(tmp_path, capsys):
    from flaxformer_lite.cli.train import train_main

    tiny = ["train.steps=4", "train.log_every=2", "train.eval_every=4", "train.batch_size=8"]
    tiny += ["data.seq_len=32", "train.decode_examples=4", "data.eval_size=8", "--no-progress"]
    for name, lr in (("a", "0.003"), ("b", "0.01")):
        assert train_main([f"run_dir={tmp_path / name}", f"optimizer.lr={lr}", *tiny]) == 0
    capsys.readouterr()
    out = tmp_path / "ab.png"
    argv = ["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]
    assert main([*argv, "--metric", "loss", "eval_exact_match"]) == 0
    lines = {
        line.split()[0]: line.split()[1:]
        for line in capsys.readouterr().out.splitlines()
        if line.strip()
    }
    assert lines["step"] == ["4", "4"] and len(lines["eval_loss"]) == 2
    assert lines["optimizer.lr"] == ["0.003", "0.01"]
    assert len(lines) > 10 and "model.vocab_size" not in lines  # resolved equally in both
    assert Image.open(out).size[0] > 200


def test_compare_png_in_the_current_directory_is_not_replaced_unasked(
    two_runs, tmp_path, monkeypatch, capsys
):
    """Issue 43 item 19: compare.png in the current directory was silently replaced."""
    a, b = two_runs
    monkeypatch.chdir(tmp_path)
    (tmp_path / "compare.png").write_bytes(b"mine")
    assert main(["compare", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert (
        err == "error: compare.png exists; pass --out compare.png to replace it, or another file\n"
    )
    assert (tmp_path / "compare.png").read_bytes() == b"mine"
    assert main(["compare", str(a), str(b), "--out", "compare.png"]) == 0
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
