"""``flaxformer-lite prepare``: a store from the data settings of a config, one summary line,
a no-op when run again, and user errors as one line with exit status 2."""

import errno
import json
import os
import re
import sys

import pytest
import yaml

from flaxformer_lite.cli import main
from flaxformer_lite.data import store as store_module
from flaxformer_lite.data.store import open_store
from flaxformer_lite.data.tokenizers import BpeTokenizer

LINES = [f"line {i}: the quick brown fox ∑ {i * 7 % 13}" for i in range(60)]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    return path


def prepare(capsys, *argv):
    """``flaxformer-lite prepare ARGV``: (exit status, stdout lines, stderr)."""
    status = main(["prepare", *map(str, argv)])
    out, err = capsys.readouterr()
    return status, out.splitlines(), err


def test_prepare_prints_one_summary_line_and_a_second_run_does_nothing(corpus, tmp_path, capsys):
    out = tmp_path / "store"
    argv = ["--out", out, "data.source=text", f"data.path={corpus}", "data.tokenizer=char"]
    argv.append("data.text_documents=lines")  # one document per line
    status, lines, err = prepare(capsys, *argv, "--no-progress")
    assert status == 0 and err == ""
    assert len(lines) == 1
    assert re.fullmatch(rf"prepared {out}: 60 documents, [\d,]+ tokens, [\d,]+ tokens/s", lines[0])
    store = open_store(out)
    tokens = int(re.search(r"([\d,]+) tokens,", lines[0]).group(1).replace(",", ""))
    assert tokens == store.documents.tokens["text"].size == sum(map(len, LINES))
    assert store.manifest["tokenizer"]["fitted"] == {"vocab_size": None, "validation_fraction": 0.1}
    assert store.manifest["source"]["documents"] == "lines"
    mtimes = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    status, lines, _ = prepare(capsys, *argv)
    assert status == 0
    assert lines == [f"{out}: already prepared (60 documents, {tokens:,} tokens)"]
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == mtimes


def test_the_data_section_of_a_config_file_and_overrides(corpus, tmp_path, capsys):
    config = tmp_path / "run.yaml"
    data = {"source": "text", "path": str(corpus), "tokenizer": "bpe", "vocab_size": 300}
    config.write_text(yaml.safe_dump({"data": data, "train": {"steps": 3}}))
    status, _, _ = prepare(
        capsys, "--config", config, "data.validation_fraction=0.2", "--out", tmp_path / "s"
    )
    assert status == 0
    manifest = open_store(tmp_path / "s").manifest
    assert manifest["tokenizer"]["kind"] == "bpe"
    assert manifest["tokenizer"]["fitted"] == {"vocab_size": 300, "validation_fraction": 0.2}


def test_progress_bars_go_to_a_terminal_unless_turned_off(corpus, tmp_path, capsys, monkeypatch):
    """Issue 45 item 9: output to a file or a pipe (here captured) gets no bars, as train's."""
    argv = ["data.source=text", f"data.path={corpus}"]
    status, lines, err = prepare(capsys, "--out", tmp_path / "a", *argv)
    assert status == 0 and len(lines) == 1 and err == ""
    for stream in (sys.stdout, sys.stderr):
        monkeypatch.setattr(stream, "isatty", lambda: True)
    status, lines, err = prepare(capsys, "--out", tmp_path / "b", *argv)
    assert status == 0 and len(lines) == 1 and "encoding" in err
    status, lines, err = prepare(capsys, "--out", tmp_path / "c", "--no-progress", *argv)
    assert status == 0 and len(lines) == 1 and err == ""


def test_a_fine_tuning_config_prepares_with_the_checkpoints_tokenizer(corpus, tmp_path, capsys):
    checkpoint = tmp_path / "gpt2"
    checkpoint.mkdir()
    bpe = BpeTokenizer.train(LINES, vocab_size=300)
    (checkpoint / "tokenizer.json").write_text(bpe.hf_tokenizer.to_str())
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 300}
    config |= {"n_positions": 64, "n_embd": 32, "n_layer": 1, "n_head": 2, "eos_token_id": 2}
    (checkpoint / "config.json").write_text(json.dumps(config))
    argv = [f"init_from={checkpoint}", "data.source=text", f"data.path={corpus}"]
    status, _, err = prepare(capsys, "--no-progress", "--out", tmp_path / "s", *argv)
    assert status == 0, err
    store = open_store(tmp_path / "s")
    assert store.tokenizer.name == "hf"
    # The file is one document (the default), encoded whole by the checkpoint's tokenizer.
    assert store.documents.document("text", 0).tolist() == bpe.encode(corpus.read_text())


@pytest.mark.parametrize(
    "setup, argv, message",
    [
        (None, ["data.source=text", "data.path={tmp}/missing.txt"], "missing.txt: file not found"),
        (
            "bad",
            ["data.source=text", "data.path={tmp}/bad.txt"],
            "bad.txt: not valid UTF-8 at line 2",
        ),
        (
            "store",
            ["data.source=text", "data.path={corpus}", "data.tokenizer=word"],
            "holds a store of other inputs",
        ),
        ("notes", ["data.source=text", "data.path={corpus}"], "exists and is not a prepared store"),
        (None, ["data.path={corpus}"], "data.source='synthetic': prepare reads files"),
        (None, ["data.source=text", "data.paht=x"], "data.paht"),
        (
            None,
            ["data.source=text", "data.path={corpus}", "data.tokenizer=bpe"],
            "needs data.vocab_size",
        ),
        # Issue 43 item 19: checked before the training store is built, and named.
        (
            None,
            ["data.source=text", "data.path={corpus}", "data.validation_path={tmp}/v.txt"],
            "error: data.validation_path: ",
        ),
    ],
)
def test_user_errors_exit_2_with_one_line(corpus, tmp_path, capsys, setup, argv, message):
    out = tmp_path / "store"
    if setup == "bad":
        (tmp_path / "bad.txt").write_bytes(b"fine\ncaf\xe9\n")
    elif setup == "store":
        assert (
            main(
                [
                    "prepare",
                    "--no-progress",
                    "--out",
                    str(out),
                    "data.source=text",
                    f"data.path={corpus}",
                ]
            )
            == 0
        )
    elif setup == "notes":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    argv = [a.format(tmp=tmp_path, corpus=corpus) for a in argv]
    if any(a.startswith("data.validation_path") for a in argv):
        argv.append(f"--validation-out={tmp_path / 'valid'}")
    status, lines, err = prepare(capsys, "--no-progress", "--out", out, *argv)
    assert status == 2 and lines == []
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err
    assert setup is not None or not out.exists()  # nothing prepared


def test_help_describes_the_command_with_an_example(capsys):
    with pytest.raises(SystemExit) as info:
        main(["prepare", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "Tokenize the configured" in text and "example:\n  flaxformer-lite prepare --out" in text
    with pytest.raises(SystemExit) as info:
        main(["prepare", "data.source=text"])  # --out is required
    assert info.value.code == 2


@pytest.mark.parametrize("number", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_names_the_store_and_keeps_nothing(
    corpus, tmp_path, capsys, monkeypatch, number
):
    write_documents = store_module.write_documents

    def full(directory, *args, **kwargs):  # the disk fills up halfway through the tokens
        write_documents(directory, *args, **kwargs)
        raise OSError(number, os.strerror(number))

    monkeypatch.setattr(store_module, "write_documents", full)
    out = tmp_path / "store"
    argv = ["--no-progress", "--out", out, "data.source=text", f"data.path={corpus}"]
    status, lines, err = prepare(capsys, *argv)
    assert status == 2 and lines == []
    assert err.splitlines() == [
        f"error: {out}: {os.strerror(number)} while preparing the store; nothing of it was kept"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lines.txt"]


def test_out_a_link_to_an_empty_directory_prepares_the_store_there(corpus, tmp_path, capsys):
    """Issue 43 item 15: the store was renamed onto the link ([Errno 20] Not a directory)."""
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    argv = ["--out", tmp_path / "link", "data.source=text", f"data.path={corpus}"]
    status, lines, err = prepare(capsys, *argv, "--no-progress")
    assert status == 0, err
    assert lines[0].startswith(f"prepared {tmp_path / 'target'}: 1 documents")
    assert (tmp_path / "link").is_symlink() and len(open_store(tmp_path / "link").documents) == 1
