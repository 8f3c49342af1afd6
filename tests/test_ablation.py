"""``flaxformer-lite ablation`` at a tiny size: every config swept over two seeds, the table of
means and deviations, the figure, the JSON; a command of the installed package (issue 45 item
10), in its --help without the history of the project."""

import json
import pathlib
import statistics
import subprocess
import sys

import pytest
from subprocess_env import subprocess_env

from flaxformer_lite.cli import main
from flaxformer_lite.cli.ablation import FLAXFORMER_LITE, ablation, parser
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.metrics import read_metrics

TINY = """\
model:
  preset: gpt2-tiny
  num_decoder_layers: 1
  mixer: {mixer}
train:
  batch_size: 8
  log_every: 2
  eval_every: 4
  eval_batches: 1
  decode_examples: 4
data:
  seq_len: 32
  eval_size: 8
optimizer:
  warmup_steps: 0
"""


@pytest.mark.slow
def test_the_ablation_trains_every_config_and_compares_them(tmp_path, capsys, monkeypatch):
    # The command's sweep subprocesses inherit this process's environment: that of
    # subprocess_env (one device, XLA's backend optimizations off, the session's compilation
    # cache for every program) rather than conftest.py's 8 devices compiled with optimizations.
    for name, value in subprocess_env(1).items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)  # where the sweeps import the user's attention from
    (tmp_path / "plus_one.py").write_text("from user_pieces import softmax_plus_one\n")
    monkeypatch.setenv("PYTHONPATH", str(pathlib.Path(__file__).parent))
    configs = []
    for mixer in ("attention", "aft_simple"):
        configs.append(tmp_path / f"{mixer}.yaml")
        configs[-1].write_text(TINY.format(mixer=mixer))
    user = "  attention_implementation: plus_one:softmax_plus_one\n"  # imported: --trust-code
    configs[0].write_text(TINY.format(mixer="attention").replace("  mixer", user + "  mixer"))
    runs = tmp_path / "runs"
    argv = ["--configs", *map(str, configs), "--runs", str(runs), "--seeds", "2", "--steps", "4"]
    argv += ["--trust-code", "train.eval_every=2", "--baseline", "attention"]
    result = ablation(parser().parse_args(argv))
    printed = capsys.readouterr().out
    assert json.loads(printed.strip().splitlines()[-1]) == result
    assert result["baseline"] == "attention"
    assert "aft_simple - attention:" in printed
    assert "eval_loss: difference " in printed and "(paired t over 2 shared seeds, df 1)" in printed
    member = load_config(runs / "aft_simple" / "seed=1" / "config.yaml")
    assert member.train.eval_every == 2 and member.train.steps == 4  # the overrides, each config
    # The same command again resumes every sweep where it is: nothing trained, nothing moved.
    again = ablation(parser().parse_args(argv))
    assert [row["eval_loss"] for row in again["runs"]] == [r["eval_loss"] for r in result["runs"]]
    assert not list(tmp_path.glob("runs/*.old*"))
    assert [row["run"] for row in result["runs"]] == ["attention", "aft_simple"]
    for row in result["runs"]:
        assert row["seeds"] == 2 and not row["diverged"]
        finals = []
        for seed in (0, 1):
            records = read_metrics(runs / row["run"] / f"seed={seed}")
            assert [r["step"] for r in records if "loss" in r][-1] == 4
            finals.append([r for r in records if "eval_loss" in r][-1])
        for metric in ("eval_loss", "eval_exact_match"):
            values = [final[metric] for final in finals]
            assert row[metric]["mean"] == pytest.approx(statistics.fmean(values))
            assert row[metric]["std"] == pytest.approx(statistics.stdev(values))
            assert row[metric]["n"] == 2
        assert row["tokens_per_sec"] > 0 and row["wall_seconds"] > 0
        mean, std = row["eval_loss"]["mean"], row["eval_loss"]["std"]
        assert f"{mean:.4f} ± {std:.4f}" in printed
    assert "model.mixer" in printed  # the setting in which the configs differ
    assert (runs / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failing_run_ends_the_ablation_with_its_line_and_status(tmp_path):
    """A config the sweep refuses: its one line and its exit status 2, no traceback after them."""
    config = tmp_path / "typo.yaml"
    config.write_text(TINY.format(mixer="attention").replace("log_every", "log_evry"))
    argv = ["--configs", str(config), "--runs", str(tmp_path / "runs")]
    child = subprocess.run(
        [sys.executable, "-c", FLAXFORMER_LITE, "ablation", *argv],
        env=subprocess_env(1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 2, child.stderr[-3000:]
    lines = child.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.log_evry" in lines[0], child.stderr[-3000:]


def test_the_help_names_the_shipped_ablations_and_no_issue(capsys):
    with pytest.raises(SystemExit):
        main(["ablation", "--help"])
    text = capsys.readouterr().out
    assert "ablations/*" in text and "issue" not in text.lower()
    assert parser().parse_args([]).configs is None  # every shipped ablations/* recipe
    assert main(["ablation", "--seeds", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --seeds and --steps must be positive, got 0, None"
    )
