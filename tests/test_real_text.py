"""A user's own text, end to end: a text file trains whole (line breaks, blank lines and every
token of long documents kept), its evaluation is over every held-out token, a named validation
file is used as given, a task that must cut examples says how much, and a run prints plain
lines when its output is not a terminal."""

import contextlib
import dataclasses
import itertools
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx
from subprocess_env import subprocess_env
from tiny_models import make, tiny

from flaxformer_lite.cli import train as train_cli
from flaxformer_lite.data.config import DataConfig
from flaxformer_lite.data.pipeline import build_data
from flaxformer_lite.data.store import open_store
from flaxformer_lite.data.tasks import TASKS
from flaxformer_lite.train.actions import evaluate
from flaxformer_lite.train.console import Console
from flaxformer_lite.train.step import make_eval_step

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

REPO = pathlib.Path(__file__).resolve().parents[1]
BOOK = (
    "CHAPTER I.\n\nIt was a dark night;\n  the wind blew.\n\n\n"
    "def f(x):\n    return x  # code, indented\n\nThe end.\n"
) * 12


def text_data(tmp_path, text=BOOK, name="book.txt", **settings):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / name
    path.write_text(text)
    values = dict(source="text", path=str(path), tokenizer="char", seq_len=16) | settings
    return built(DataConfig(**values), tmp_path)


def built(cfg, tmp_path, task=TASKS["lm"], tokenizer="tok"):
    """The data of ``cfg`` for ``task``, batches of 4, its tokenizer in ``tmp_path/<tokenizer>``,
    a file source prepared in ``tmp_path/prepared``."""
    return build_data(
        cfg,
        task=task,
        seed=0,
        batch_size=4,
        directory=tmp_path / tokenizer,
        prepared=tmp_path / "prepared",
    )


def row_texts(tokenizer, batches):
    """Each row's text: its weighted positions' targets, in order (<eos> as "|")."""
    out = []
    for batch in batches:
        for targets, weights in zip(batch["targets"], batch["weights"], strict=True):
            ids = targets[weights > 0].tolist()
            out.append(
                "".join("|" if i == tokenizer.eos_id else tokenizer.decode([i]) for i in ids)
            )
    return out


def decode_rows(tokenizer, batches):
    """The text of every weighted position's target, row by row, in order (<eos> as "|")."""
    return "".join(row_texts(tokenizer, batches))


def test_a_text_file_is_one_document_with_its_line_breaks_and_its_tail_held_out(tmp_path):
    data = text_data(tmp_path, lm_rows="windows")
    with contextlib.closing(data.train):
        rows_per_epoch = -(-(int(len(BOOK) * 0.9) + 1) // 16)
        batches = [next(data.train) for _ in range(-(-rows_per_epoch // 4))]
    head = int(len(BOOK) * 0.9)  # nanoGPT's split: the first 90% of the characters train
    # An epoch's rows are the head cut into windows of 16 (the last one shorter), handed out
    # in a shuffled order.
    trained = row_texts(data.tokenizer, batches)[:rows_per_epoch]
    windows = [(BOOK[:head] + "|")[k : k + 16] for k in range(0, head + 1, 16)]
    assert len(windows) == rows_per_epoch
    assert sorted(trained) == sorted(windows) and trained != windows
    assert decode_rows(data.tokenizer, data.eval_batches()) == BOOK[head:] + "|"
    assert data.eval_tokens == len(BOOK) - head + 1


def test_paragraphs_and_lines_make_documents_as_they_say(tmp_path):
    paragraphs = text_data(tmp_path / "p", text_documents="paragraphs", validation_fraction=0.25)
    lines = text_data(tmp_path / "l", text_documents="lines", validation_fraction=0.25)
    runs = itertools.groupby(BOOK.splitlines(), key=lambda line: bool(line.strip()))
    expected = {"paragraphs": sum(1 for nonblank, _ in runs if nonblank)}
    expected["lines"] = sum(1 for line in BOOK.splitlines() if line.strip())
    for name, data in (("paragraphs", paragraphs), ("lines", lines)):
        data.train.close()
        total = data.train.get_state()["pipeline"]["train_documents"] + len(data.eval_examples)
        assert total == expected[name]
    assert any("\n" in r["text"] for r in paragraphs.eval_examples)
    assert not any("\n" in r["text"] for r in lines.eval_examples)


@pytest.mark.parametrize("settings", [{}, {"lm_rows": "windows"}, {"packing": False}])
def test_a_document_ten_rows_long_reaches_the_model_whole_in_each_layout(tmp_path, settings):
    long_line = "".join(chr(ord("a") + i % 26) for i in range(10 * 16 - 1))  # 10 rows of 16
    lines = [long_line] + [f"line {i}" for i in range(12)]
    data = text_data(tmp_path, text="\n".join(lines), text_documents="lines", **settings)
    held_out = [r["text"] for r in data.eval_examples]
    trained = [line for line in lines if line not in held_out]
    assert long_line in trained
    per_epoch = sum(len(line) + 1 for line in trained)  # every character and an <eos> each
    with contextlib.closing(data.train):
        seen = decode_rows(data.tokenizer, [next(data.train) for _ in range(12)])
    assert len(seen) >= per_epoch
    assert sorted(seen[:per_epoch]) == sorted("".join(line + "|" for line in trained))


def _tiny_lm():
    model = make(tiny("gpt2-tiny", vocab_size=128, max_length=64))
    graphdef, state = nnx.split(model)
    return model, graphdef, state


def float64_loss(model, tokenizer, texts) -> float:
    """Every validation token's loss, each document read alone in pieces of 16 positions (one
    piece a row, padded at its end: the model is causal), log-softmax and mean in float64."""
    rows, lengths = [], []
    for text in texts:
        ids = [tokenizer.sos_id, *tokenizer.encode(text), tokenizer.eos_id]
        for start in range(0, len(ids) - 1, 16):
            piece = ids[start : start + 17]  # 16 inputs and their targets
            rows.append(piece + [0] * (17 - len(piece)))
            lengths.append(len(piece) - 1)
    rows = np.array(rows)
    logits = np.asarray(model(rows[:, :16]), np.float64)
    logits -= logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    picked = np.take_along_axis(log_probs, rows[:, 1:, None], -1)[..., 0]
    valid = np.arange(16) < np.array(lengths)[:, None]
    return -picked[valid].sum() / valid.sum()


def test_the_eval_loss_is_over_every_validation_token_whatever_the_row_layout(tmp_path):
    text = "\n".join(f"line {i}: " + "xyz" * (i % 13) for i in range(60))
    model, graphdef, state = _tiny_lm()
    eval_step = make_eval_step(nnx.graphdef((model, None)), task=TASKS["lm"])
    losses = []
    for settings in ({}, {"lm_rows": "windows"}, {"packing": False}):
        data = text_data(tmp_path / str(len(losses)), text=text, text_documents="lines", **settings)
        data.train.close()
        scores = evaluate(eval_step, nnx.state((model, None)), data.eval_batches())
        assert (
            scores["eval_tokens"]
            == data.eval_tokens
            == sum(len(r["text"]) + 1 for r in data.eval_examples)
        )
        losses.append(scores["eval_loss"])
    reference = float64_loss(model, data.tokenizer, [r["text"] for r in data.eval_examples])
    np.testing.assert_allclose(losses, reference, rtol=2e-5)
    assert losses[0] == losses[1] == losses[2]
    capped = evaluate(eval_step, nnx.state((model, None)), data.eval_batches(), max_batches=1)
    assert 0 < capped["eval_tokens"] <= 4 * 16 < data.eval_tokens


def test_a_named_validation_file_is_used_as_given_and_not_split(tmp_path):
    (tmp_path / "valid.txt").write_text("held out\ntext\n")
    data = text_data(tmp_path, validation_path=str(tmp_path / "valid.txt"))
    data.train.close()
    assert [r["text"] for r in data.eval_examples] == ["held out\ntext\n"]
    assert data.eval_tokens == len("held out\ntext\n") + 1
    pipeline = data.train.get_state()["pipeline"]
    assert pipeline["train_documents"] == 1 and pipeline["train_tokens"] == len(BOOK)
    (store,) = [
        p
        for p in (tmp_path / "prepared").iterdir()
        if "book" in json.dumps(open_store(p).manifest["source"]["path"])
    ]
    assert open_store(store).manifest["source"]["documents"] == "file"


@pytest.mark.parametrize("validation", ["book.txt", "*.txt"])
def test_validation_data_that_are_training_data_too_are_refused(tmp_path, validation):
    """Issue 43 item 8: the evaluation would be on the training text, without a word."""
    (tmp_path / "more.txt").write_text("more text\n")
    with pytest.raises(ValueError, match=r"^data.validation_path=.*book.txt.* is training data"):
        text_data(tmp_path, validation_path=str(tmp_path / validation))
    assert not (tmp_path / "prepared").exists() and not (tmp_path / "tok").exists()


def test_a_task_that_must_cut_examples_says_how_much(tmp_path):
    pairs = "".join(f"{'a' * (5 + i)}\t{'b' * (20 - i)}\n" for i in range(20))
    (tmp_path / "pairs.tsv").write_text(pairs)
    cfg = DataConfig(
        source="parallel",
        path=str(tmp_path / "pairs.tsv"),
        tokenizer="char",
        seq_len=16,
        validation_fraction=0.25,
    )
    data = built(cfg, tmp_path, task=TASKS["seq2seq"])
    data.train.close()
    sources = [len(line.split("\t")[0]) for line in pairs.splitlines()]
    targets = [len(line.split("\t")[1]) for line in pairs.splitlines()]
    cut = [max(s - 15, 0) + max(t - 16, 0) for s, t in zip(sources, targets, strict=True)]
    (train_notice, valid_notice) = data.notices
    counted = [int(n.split(" cuts ")[1].split(" of")[0]) for n in data.notices]
    assert sum(counted) == sum(c > 0 for c in cut)
    tokens = [int(n.split(": ")[1].split(" of")[0].replace(",", "")) for n in data.notices]
    assert sum(tokens) == sum(cut)
    assert "training" in train_notice and "validation" in valid_notice


def test_plain_lines_name_the_step_and_what_an_evaluation_is_over():
    lines = []
    console = Console(2000, 0, bar=False, log=lines.append)
    values = {"loss": 1.5, "learning_rate": 1e-3, "tokens_per_sec": 21300.0, "accuracy": 0.5}
    console.logged(500, values)
    console.evaluated(500, {"eval_loss": 1.75, "eval_accuracy": 0.5}, "every one of 99 tokens")
    console.close()
    assert lines[0].startswith(
        "step 500/2000: loss 1.5, learning_rate 0.001, 21.3k tokens/s (positions), "
    )
    assert "elapsed" in lines[0] and "left" in lines[0]
    assert (
        lines[1] == "eval at step 500 (every one of 99 tokens): eval_loss 1.75, eval_accuracy 0.5"
    )


def test_decoded_metrics_are_said_to_be_over_the_decoded_examples():
    lines = []
    console = Console(2000, 0, bar=False, log=lines.append)
    values = {"eval_loss": 1.75, "eval_exact_match": 0.25, "eval_token_accuracy": 0.5}
    values |= {"eval_tokens": 99, "eval_decoded_examples": 256}
    console.evaluated(500, values, "every one of 99 tokens")
    assert lines == [
        "eval at step 500 (every one of 99 tokens): eval_loss 1.75; greedy decoding of 256 "
        "validation examples: eval_exact_match 0.25, eval_token_accuracy 0.5"
    ]


class _Stream:
    def __init__(self, tty):
        self.tty = tty

    def isatty(self):
        return self.tty

    def write(self, text):
        return len(text)

    def flush(self):
        pass


@pytest.mark.parametrize(
    ("flags", "tty", "bar"),
    [([], True, True), (["--no-progress"], True, False), ([], False, False)],
)
def test_the_bar_is_for_terminals_and_plain_lines_are_for_the_rest(monkeypatch, flags, tty, bar):
    seen = {}

    def fake_run(cfg, *, fresh, force, progress, log, spent):
        seen["progress"] = progress
        return {}

    monkeypatch.setattr("flaxformer_lite.train.loop.run", fake_run)
    monkeypatch.setattr(sys, "stdout", _Stream(tty))
    monkeypatch.setattr(sys, "stderr", _Stream(tty))
    monkeypatch.setattr(train_cli, "library_log_to", lambda path: None)
    assert train_cli.train_main(flags) == 0
    assert seen["progress"] is bar


@pytest.mark.slow
def test_the_shakespeare_recipe_runs_offline_and_prints_plain_lines_into_a_pipe(tmp_path):
    """The recipe, shortened, with its output piped: per-step and eval lines, and samples that
    carry their step; no carriage returns."""
    command = [
        sys.executable,
        str(REPO / "train.py"),
        "--config",
        str(REPO / "configs" / "shakespeare_char.yaml"),
        f"run_dir={tmp_path / 'run'}",
        "train.steps=20",
        "train.log_every=10",
        "train.eval_every=20",
        "train.eval_batches=3",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, env=subprocess_env(1), timeout=600, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "\r" not in out + done.stderr
    assert "step 10/20: loss " in out and "step 20/20: loss " in out
    assert "eval at step 20 (" in out and "of the 111,541 validation tokens" in out
    assert "train.eval_batches=3 of 146 batches" in out
    assert "step 20 sample 1 (prompt " in out
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert records[-1]["eval_tokens"] == 3 * 12 * 64
    assert os.path.isfile(tmp_path / "run" / "config.yaml")


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"path": "empty.txt"}, "data.path: {tmp}/empty.txt: empty file"),
        ({"path": "blank.txt"}, "data.path: {tmp}/blank.txt: empty file"),
        ({"validation_path": "blank.txt"}, "data.validation_path: {tmp}/blank.txt: empty file"),
        ({"validation_path": "."}, "data.validation_path: {tmp}: is a directory"),
    ],
)
def test_bad_text_input_is_one_line_and_exit_2_with_nothing_written(
    tmp_path, capsys, setting, message
):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n  \n\n\t\n")
    (tmp_path / "ok.txt").write_text("some text\n")
    values = {"path": "ok.txt"} | setting
    overrides = [f"data.{k}={tmp_path / v}" for k, v in values.items()]
    run_dir = tmp_path / "run"
    code = train_cli.train_main(
        ["data.source=text", "data.tokenizer=char", f"run_dir={run_dir}", *overrides]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message.format(tmp=tmp_path) in err[0]
    assert not run_dir.exists()


def test_a_prepared_store_of_another_document_setting_is_refused(tmp_path, capsys):
    from flaxformer_lite.cli.prepare import prepare_main

    (tmp_path / "book.txt").write_text(BOOK)
    store = tmp_path / "store"
    assert (
        prepare_main(
            [
                "--no-progress",
                "--out",
                str(store),
                "data.source=text",
                f"data.path={tmp_path / 'book.txt'}",
                "data.text_documents=paragraphs",
                "data.tokenizer=char",
            ]
        )
        == 0
    )
    assert open_store(store).manifest["source"]["documents"] == "paragraphs"
    run_dir = tmp_path / "run"
    code = train_cli.train_main(
        [
            "data.source=prepared",
            f"data.path={store}",
            "data.text_documents=lines",
            f"run_dir={run_dir}",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert f"{store}" in err and "data.text_documents='lines'" in err
    assert "text (paragraphs documents)" in err
    assert not run_dir.exists()


def test_a_text_run_recorded_before_the_document_setting_resumes_only_as_lines():
    from flaxformer_lite.data.inputs import setting_changes

    old = {"data": {"source": "text", "path": "a.txt"}, "files": []}
    now = {"data": {"source": "text", "path": "a.txt", "text_documents": None}, "files": []}
    # Unset is settled to what it means, a document per file (issue 43 item 14).
    assert setting_changes(old, now) == {"data.text_documents": ("lines", "file")}
    lines = {"data": {**now["data"], "text_documents": "lines"}, "files": []}
    assert setting_changes(old, lines) == {}


def test_prepare_writes_a_validation_store_with_the_training_tokenizer(tmp_path):
    """WikiText's layout: train.txt and valid.txt, prepared once, then trained from the stores;
    a validation store of another kind of data is refused, naming both."""
    from flaxformer_lite.cli.prepare import prepare_main

    (tmp_path / "train.txt").write_text(BOOK)
    (tmp_path / "valid.txt").write_text("Zebra quay!\n\nxyz\n")  # characters unseen in training
    stores = {name: tmp_path / name for name in ("train", "valid")}
    args = ["--no-progress", "--out", str(stores["train"]), "--validation-out"]
    args += [str(stores["valid"]), "data.source=text", "data.tokenizer=char"]
    args += [
        f"data.path={tmp_path / 'train.txt'}",
        f"data.validation_path={tmp_path / 'valid.txt'}",
    ]
    assert prepare_main(args) == 0
    train, valid = open_store(stores["train"]), open_store(stores["valid"])
    assert train.manifest["tokenizer"]["sha256"] == valid.manifest["tokenizer"]["sha256"]
    assert train.manifest["tokenizer"]["fitted"]["validation_fraction"] is None  # all of it
    cfg = DataConfig(
        source="prepared",
        path=str(stores["train"]),
        validation_path=str(stores["valid"]),
        seq_len=16,
    )
    data = built(cfg, tmp_path)
    data.train.close()
    assert data.train.get_state()["pipeline"]["train_tokens"] == len(BOOK)
    assert data.eval_tokens == len("Zebra quay!\n\nxyz\n") + 1
    unk = data.tokenizer.unk_id
    targets = np.concatenate([b["targets"][b["weights"] > 0] for b in data.eval_batches()])
    assert (targets == unk).sum() == sum(c not in BOOK for c in "Zebra quay!\n\nxyz\n")
    (tmp_path / "pairs.tsv").write_text("a\tb\n" * 10)
    parallel = tmp_path / "pairs"
    assert (
        prepare_main(
            [
                "--no-progress",
                "--out",
                str(parallel),
                "data.source=parallel",
                f"data.path={tmp_path / 'pairs.tsv'}",
                "data.tokenizer=char",
            ]
        )
        == 0
    )
    other = dataclasses.replace(cfg, validation_path=str(parallel))
    with pytest.raises(
        ValueError,
        match=r"holds 'parallel' data, but the training data .* are "
        r"text \(file documents\)",
    ):
        built(other, tmp_path, tokenizer="tok2")
    assert prepare_main(args[:3] + args[5:]) == 2  # validation_path without --validation-out
