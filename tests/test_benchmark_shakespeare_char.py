"""benchmarks/shakespeare_char.py at a tiny size (ours, ours over two seeds, and Hugging Face's
when torch and transformers are installed: the table, the JSON, the same held-out targets), and
its reading of nanoGPT's log and held-out windows."""

import json
import statistics

import numpy as np
import pytest
from benchmark_scripts import hf_available, load_benchmark
from subprocess_env import subprocess_env

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

# The recipe's settings at a tiny size; batch 8: the loop splits it over conftest.py's 8 devices.
TINY = """\
seed: 0
model:
  preset: gpt2-tiny
  vocab_size: 128
  d_model: 32
  num_heads: 2
  d_ff: 64
  num_decoder_layers: 1
  max_length: 16
  embedding_dropout: 0.0
  attention_dropout: 0.0
  residual_dropout: 0.0
  qkv_bias: false
  attention_out_bias: false
  mlp_bias: false
  norm_bias: false
data:
  source: text
  path: {path}
  text_documents: file
  tokenizer: char
  seq_len: 16
  lm_rows: windows
  validation_fraction: 0.1
optimizer:
  warmup_steps: 1
  b2: 0.99
  weight_decay: 0.1
  decay_embeddings: true
train:
  batch_size: 8
  log_every: 2
  eval_every: 4
  eval_batches: 1000
  decode_examples: 0
checkpoint:
  every: 4
"""

NANOGPT_OUTPUT = """\
step 0: train loss 4.1700, val loss 4.1649
iter 0: loss 4.1600, time 900.00ms, mfu -100.00%
iter 1: loss 4.0000, time 10.00ms, mfu -100.00%
iter 2: loss 3.9000, time 20.00ms, mfu -100.00%
iter 3: loss 3.8000, time 30.00ms, mfu -100.00%
step 4: train loss 3.7000, val loss 3.7500
saving checkpoint to out
iter 4: loss 3.7000, time 500.00ms, mfu 1.00%
iter 5: loss 3.6000, time 40.00ms, mfu 1.00%
"""


@pytest.mark.slow
def test_the_benchmark_at_a_tiny_size(tmp_path, monkeypatch, capsys):
    benchmark = load_benchmark("shakespeare_char")
    monkeypatch.setattr(benchmark, "STEP_WINDOW", 4)
    # Its train.py and sweep subprocesses inherit this process's environment: subprocess_env's,
    # on the 8 devices of the step it is paired with, compiled as that step is (backend
    # optimizations off) and through the session's compilation cache.
    for name, value in subprocess_env(8).items():
        monkeypatch.setenv(name, value)
    text = "".join(f"Line {i}: to be, or not to be {i % 7}.\n" for i in range(120))
    (tmp_path / "text.txt").write_text(text)
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY.format(path=tmp_path / "text.txt"))
    argv = ["--steps", "6", "--seeds", "2", "--config", str(config)]
    argv += [] if hf_available() else ["--skip-torch"]
    summary = benchmark.main(argv)
    out = capsys.readouterr().out.strip().splitlines()

    assert json.loads(out[-1]) == json.loads(json.dumps(summary))
    ours = summary["ours"]
    # Logs at steps 2, 4 and 6; the first window (the compiling step) is left out.
    assert len(ours["logged_tokens_per_sec"]) == 3
    assert ours["tokens_per_sec"] == pytest.approx(np.median(ours["logged_tokens_per_sec"][1:]))
    assert ours["eval_loss_checkpoint"] == pytest.approx(ours["eval_loss"], rel=1e-5)
    # Every held-out character is a target, and the <eos> after them.
    assert len(text) // 10 <= ours["eval_targets"] <= len(text) // 10 + 2
    assert len(ours["step_seconds"]) == 2 and ours["wall_seconds"] > 0
    share = ours["tokens_per_sec"] * sum(ours["step_seconds"]) / 2 / (8 * 16)
    assert ours["share"] == pytest.approx(share)
    seeds = summary["seeds"]
    assert list(seeds["members"]) == ["seed=0", "seed=1"] and seeds["eval_loss"]["n"] == 2
    losses = list(seeds["members"].values())
    assert seeds["eval_loss"]["mean"] == pytest.approx(statistics.fmean(losses))
    assert seeds["eval_loss"]["std"] == pytest.approx(statistics.stdev(losses))
    # Its seed 0 is train.py's run, stepped in the sweep's program.
    assert seeds["members"]["seed=0"] == pytest.approx(ours["eval_loss"], rel=1e-4)
    assert seeds["eval_targets"] == ours["eval_targets"] and seeds["tokens_per_sec"] > 0
    table = [line for line in out if line.startswith("|")]
    assert table[2].startswith(f"| flaxformer_lite train.py (JAX) | {ours['parameters']:,} | ")
    mean, std = seeds["eval_loss"]["mean"], seeds["eval_loss"]["std"]
    cells = f"{ours['parameters']:,} | {mean:.4f} ± {std:.4f} |"
    assert table[3].startswith(f"| flaxformer_lite sweep, 2 seeds (JAX) | {cells}")
    assert table[4].startswith("| flaxformer_lite train step alone (JAX) | - |")
    checks = [line for line in out if line.startswith(("PASS", "FAIL"))]
    assert len(checks) == 1 and "train step alone" in checks[0]
    assert summary["nanogpt"] is None
    hf = summary["hf"]
    if not hf_available():
        assert hf == {"skipped": "--skip-torch"} and len(table) == 5
        return
    assert hf["skipped"] is None and len(table) == 6
    assert table[5].startswith("| Hugging Face GPT2LMHeadModel (PyTorch eager) | ")
    assert hf["eval_targets"] == ours["eval_targets"]  # the same held-out batches
    assert list(hf["eval_losses"]) == ["4", "6"] and hf["eval_loss"] == hf["eval_losses"]["6"]
    assert len(hf["window_tokens_per_sec"]) == 3 and hf["wall_seconds"] > 0
    assert hf["parameters"] == ours["parameters"]  # no bias in either


def test_nanogpt_steady_state_leaves_out_the_evaluating_iterations():
    benchmark = load_benchmark("shakespeare_char")
    seconds, val_losses = benchmark.nanogpt_log(NANOGPT_OUTPUT, steps=4)  # eval_interval 4
    assert seconds == pytest.approx({1: 0.01, 2: 0.02, 3: 0.03, 5: 0.04})
    assert val_losses == {"0": 4.1649, "4": 3.75}
    rates = benchmark.window_tokens_per_sec(seconds, 10, window=4)
    assert rates == pytest.approx([30 / 0.06, 10 / 0.04])
    assert benchmark.steady(rates) == rates[1] and benchmark.steady(rates[:1]) == rates[0]


def test_nanogpt_runs_the_readme_command_and_saves_after_the_last_update(tmp_path):
    benchmark = load_benchmark("shakespeare_char")
    arguments = benchmark.nanogpt_arguments(2000, tmp_path)
    assert arguments[:2] == ["train.py", "config/train_shakespeare_char.py"]
    assert "--max_iters=2000" in arguments and "--lr_decay_iters=2000" in arguments
    assert not [a for a in arguments if a.startswith("--eval_interval")]
    assert "--eval_interval=300" in benchmark.nanogpt_arguments(300, tmp_path)


@pytest.mark.parametrize("length", [129, 140, 2])
def test_nanogpt_held_out_windows_make_every_id_but_the_first_a_target_once(length):
    benchmark = load_benchmark("shakespeare_char")
    ids = np.arange(length)
    batches = benchmark.held_out_windows(ids, block=8, rows=3)
    targets = np.concatenate([rows[:, 1:].ravel() for rows in batches])
    np.testing.assert_array_equal(targets, ids[1:])
    for rows in batches:  # each input window starts where its targets' context starts
        assert rows.shape[1] <= 9
        np.testing.assert_array_equal(rows[:, 1:], rows[:, :-1] + 1)
