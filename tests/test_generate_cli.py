"""Decoding on trained runs: train.py's decoded evaluation (exact match, token accuracy,
perplexity, BLEU, logged samples) and the ``generate`` command / ``sample.py`` on checkpoints made
by tiny train.py runs inside the test."""

import json
import math
import pathlib
import re
import runpy
import subprocess
import sys
import types

import numpy as np
import pytest
from subprocess_env import subprocess_env
from tiny_runs import QUICK

from flaxformer_lite.cli import main
from flaxformer_lite.data import synthetic
from flaxformer_lite.data.tasks import TASKS
from flaxformer_lite.data.tokenizers import EOS_ID, SOS_ID
from flaxformer_lite.decode import beam_search, generate, right_pad, seq2seq_generate, until_eos
from flaxformer_lite.models import Encoder
from flaxformer_lite.train import trained_run
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.decode_eval import decode_eval, token_accuracy
from flaxformer_lite.train.loop import run
from flaxformer_lite.train.trained_run import load_run

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

REPO = pathlib.Path(__file__).resolve().parents[1]
# lm_run: tiny_runs.QUICK for 40 steps, evaluations every 20 with decoded examples and samples.
DECODING_RUN = [
    *QUICK,
    "train.steps=40",
    "optimizer.lr=0.003",
    "train.log_every=10",
    "train.eval_every=20",
    "train.decode_examples=6",
    "train.log_samples=2",
]


def metrics(run_dir):
    lines = (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    """The embedded default (arithmetic, gpt2-tiny), 40 steps."""
    run_dir = tmp_path_factory.mktemp("lm") / "run"
    cfg = load_config(None, [f"run_dir={run_dir}", *DECODING_RUN])
    logs = []
    run(cfg, progress=False, log=logs.append)
    return run_dir, logs


def test_lm_eval_decodes_and_scores(lm_run):
    run_dir, logs = lm_run
    evals = [r for r in metrics(run_dir) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [20, 40]
    for record in evals:
        assert 0 <= record["eval_exact_match"] <= 1
        assert 0 <= record["eval_token_accuracy"] <= 1
        assert record["eval_perplexity"] == pytest.approx(math.exp(record["eval_loss"]))
        assert "eval_bleu" not in record
    # "<eos>" and digits are learnt early: by step 40 (at step 20 all 6 prompts may still get
    # nothing right, depending on the draw of the data).
    assert evals[-1]["eval_token_accuracy"] > 0
    # Each evaluation's samples carry its step.
    samples = [line for line in logs if re.match(r"step \d+ sample ", line)]
    assert len(samples) == 2 * len(evals), logs
    assert [int(line.split()[1]) for line in samples] == [r["step"] for r in evals for _ in "ab"]
    assert "=" in samples[0] and "(reference " in samples[0]
    # the eval line says what the decoded metrics are over: train.decode_examples=6 examples
    eval_lines = [line for line in logs if line.startswith("eval at step ")]
    assert len(eval_lines) == 2 and all(r["eval_decoded_examples"] == 6 for r in evals)
    assert all(
        "; greedy decoding of 6 validation examples: eval_exact_match" in line
        for line in eval_lines
    )


def test_decode_eval_scores_agree_with_its_samples(lm_run):
    run_dir, _ = lm_run
    loaded = load_run(run_dir)
    examples = synthetic.make_generator("arithmetic", split="validation", seed=0, size=16)
    max_length = loaded.model.config.max_length
    values, samples = decode_eval(
        loaded.model,
        loaded.tokenizer,
        examples,
        task=TASKS["lm"],
        num_examples=10,
        max_length=max_length,
    )
    assert len(samples) == 10
    hits = [s.prediction.strip() == s.reference for s in samples]
    assert values["eval_exact_match"] == pytest.approx(np.mean(hits))
    # The samples are what generate() writes for the same prompts.
    prompts = [[SOS_ID, *loaded.tokenizer.encode(s.input)] for s in samples]
    batch, lengths = right_pad(prompts)
    out = np.asarray(
        generate(loaded.model, batch, max_new_tokens=12, prompt_lengths=lengths, eos_id=EOS_ID)
    )
    for sample, row, n in zip(samples, out, lengths, strict=True):
        assert loaded.tokenizer.decode(until_eos(row[n:], EOS_ID)) == sample.prediction


def test_token_accuracy_counts_positions_and_eos():
    assert token_accuracy([[5, 6, 2, 0]], [[5, 6, 2]]) == 1.0
    assert token_accuracy([[5, 7, 2]], [[5, 6, 2]]) == pytest.approx(2 / 3)
    assert token_accuracy([[6, 2], [5, 6, 7, 2]], [[5, 6, 2], [5, 6, 7, 2]]) == pytest.approx(4 / 7)


def test_generate_command_continues_prompts(lm_run, capsys):
    run_dir, _ = lm_run
    prompts = ["12+34=", "7-2="]
    argv = ["generate", "--run_dir", str(run_dir), "--max_new_tokens", "8"]
    assert main([*argv, "--prompt", prompts[0], "--prompt", prompts[1]]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    # Issue 45 item 4: samples apart, as nanoGPT's sample.py prints them.
    assert len(lines) == 3 and lines.pop(1) == "-" * 16
    loaded = load_run(run_dir)
    batch, lengths = right_pad([[SOS_ID, *loaded.tokenizer.encode(p)] for p in prompts])
    out = np.asarray(
        generate(loaded.model, batch, max_new_tokens=8, prompt_lengths=lengths, eos_id=EOS_ID)
    )
    for prompt, line, row, n in zip(prompts, lines, out, lengths, strict=True):
        assert line == prompt + loaded.tokenizer.decode(until_eos(row[n:], EOS_ID))

    sampled = [*argv, "--prompt", "5+5=", "--temperature", "1.0", "--num_samples", "4"]
    assert main([*sampled, "--seed", "3"]) == 0
    first = capsys.readouterr().out
    assert main([*sampled, "--seed", "3"]) == 0
    assert capsys.readouterr().out == first and len(first.splitlines()) == 4 + 3


def test_generate_help_shows_the_defaults(capsys):
    """Issue 45 item 4: the defaults, greedy's reason, and past-the-context in --help."""
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for said in ("default: 32 for a decoder LM", "default: 0, reproducible", "line of dashes"):
        assert said in out
    assert "last three quarters of the context" in out


def test_sample_py_entry_point(lm_run, capsys, monkeypatch):
    run_dir, _ = lm_run
    monkeypatch.setattr(
        sys,
        "argv",
        ["sample.py", "--run_dir", str(run_dir), "--prompt", "3+4=", "--max_new_tokens", "4"],
    )
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / "sample.py"), run_name="__main__")
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("3+4=")


def test_translation_eval_reports_bleu(trained_translation):
    run_dir, logs = trained_translation  # conftest.py, shared with other files
    evals = [r for r in metrics(run_dir) if "eval_loss" in r]
    for record in evals:
        assert 0 <= record["eval_bleu"] <= 100
        assert 0 <= record["eval_exact_match"] <= 1 and 0 <= record["eval_token_accuracy"] <= 1
    assert any(re.match(r"step \d+ sample ", line) and "->" in line for line in logs)


def test_generate_command_translates_with_beam_search(trained_translation, capsys):
    run_dir, _ = trained_translation
    argv = [
        "generate",
        "--run_dir",
        str(run_dir),
        "--prompt",
        "forty-two",
        "--max_new_tokens",
        "6",
        "--beam_size",
        "4",
        "--n_best",
        "3",
    ]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "forty-two" and len(lines) == 4
    scores = [float(line.split()[0]) for line in lines[1:]]
    assert scores == sorted(scores, reverse=True)
    loaded = load_run(run_dir)
    src = np.array([[*loaded.tokenizer.encode("forty-two"), EOS_ID]], np.int32)
    tokens, expected = beam_search(loaded.model, src, max_new_tokens=6, beam_size=4)
    np.testing.assert_allclose(scores, np.asarray(expected)[0, :3], atol=1e-4)

    assert (
        main(
            [
                "generate",
                "--run_dir",
                str(run_dir),
                "--prompt",
                "forty-two",
                "--max_new_tokens",
                "6",
            ]
        )
        == 0
    )
    greedy = capsys.readouterr().out.strip()
    # The library's greedy decode of the same source (after 20 steps it may be empty).
    ids = np.asarray(seq2seq_generate(loaded.model, src, max_new_tokens=6))[0]
    assert greedy == f"forty-two -> {loaded.tokenizer.decode(until_eos(ids, EOS_ID))}".strip()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--run_dir", "{missing}", "--prompt", "x"], "missing"),
        (["--run_dir", "{lm}", "--prompt", "x", "--beam_size", "2", "--n_best", "3"], "--n-best"),
        (["--run_dir", "{lm}", "--prompt", "x", "--temperature", "-1"], "temperature"),
        (["--run_dir", "{lm}", "--prompt", "x", "--beam_size", "0"], "--beam-size must be"),
        (
            ["--run_dir", "{lm}", "--prompt", "x", "--beam_size", "-2", "--n_best", "-5"],
            "--beam-size must be positive, got -2",
        ),
        (["--run_dir", "{lm}", "--prompt", "x", "--num_samples", "0"], "--num-samples must be"),
        (["--run_dir", "{lm}", "--prompt", "x", "--top_k", "0"], "--top-k must be"),
        (["--run_dir", "{lm}", "--prompt", "x", "--beam_size", "4"], "holds a decoder LM"),
        (
            ["--run_dir", "{lm}", "--prompt", "x", "--beam_size", "2", "--temperature", "1"],
            "--beam-size 2 is deterministic",
        ),
    ],
)
def test_generate_command_bad_input_exits_2(lm_run, tmp_path, capsys, args, message):
    run_dir, _ = lm_run
    args = [a.format(missing=tmp_path / "missing", lm=run_dir) for a in args]
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
        (["--top_p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["--top-p", "nan"], "--top-p must be in (0, 1], got nan"),
        (["--min-tokens-to-keep", "0"], "--min-tokens-to-keep must be positive, got 0"),
    ],
)
def test_sampling_flags_out_of_range_are_named(tmp_path, capsys, flags, message):
    """Checked before the run is read (it does not exist here): the flag, not the parameter."""
    argv = ["generate", "--run-dir", str(tmp_path), "--prompt", "x", "--temperature", "1"]
    assert main([*argv, *flags]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_sample_py_names_the_top_p_flag(tmp_path):
    command = [sys.executable, "sample.py", "--run-dir", str(tmp_path), "--prompt", "x"]
    child = subprocess.run(
        [*command, "--top-p", "1.5"],
        cwd=REPO,
        env=subprocess_env(1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (child.returncode, child.stdout) == (2, ""), child.stderr[-3000:]
    assert child.stderr.splitlines()[-1] == "error: --top-p must be in (0, 1], got 1.5"


def test_an_encoder_run_is_named_in_plain_words(tmp_path, capsys, monkeypatch):
    """Issue 43 item 19: it said "holds a Encoder"."""
    cache = types.SimpleNamespace(train=types.SimpleNamespace(compilation_cache=True))
    loaded = types.SimpleNamespace(model=Encoder.__new__(Encoder), tokenizer=None, config=cache)
    monkeypatch.setattr(trained_run, "load_run", lambda *_args, **_kwargs: loaded)
    assert main(["generate", "--run-dir", str(tmp_path), "--prompt", "x"]) == 2
    assert capsys.readouterr().err == (
        f"error: {tmp_path} holds an encoder-only model (Encoder); generate needs a DecoderLM "
        "or EncoderDecoder\n"
    )
