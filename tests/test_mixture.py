"""Weighted mixtures (issue 46, item 4): rows drawn by weight as a pure function of (seed, row),
a tokenizer fitted on the sources by weight, a validation loss per source, a bit-exact resume
after SIGTERM, and bad mixtures refused in one line before anything is written."""

import dataclasses
import json
import os
import pathlib
import re
import signal

import numpy as np
import pytest

from flaxformer_lite.cli import main
from flaxformer_lite.cli.train import train_main
from flaxformer_lite.data.config import BLOCK_ROWS, DataConfig, MixtureSource
from flaxformer_lite.data.documents import Documents
from flaxformer_lite.data.mixture import Mixture, block_counts, weighted_texts
from flaxformer_lite.data.notices import small_source_notice, unknown_notice
from flaxformer_lite.data.pipeline import build_data
from flaxformer_lite.data.store import prepare_store
from flaxformer_lite.data.tasks import TASKS
from flaxformer_lite.data.tokenizers import CharTokenizer
from flaxformer_lite.train import loop
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.loop import Interrupted, run

pytestmark = pytest.mark.fast_compile

TINY = [
    "model.num_decoder_layers=1",
    "model.d_model=32",
    "model.num_heads=2",
    "model.d_ff=64",
    "train.batch_size=8",
    "data.seq_len=16",
    "optimizer.warmup_steps=0",
    "optimizer.schedule=constant",
    "train.log_every=1",
    "train.eval_every=100",
    "train.log_samples=0",
    "train.decode_examples=0",
    "checkpoint.every=100",
]


def test_rows_come_from_each_source_by_weight_over_a_thousand_batches():
    source, _ = Mixture([3.0, 1.0], seed=0).draw(0, 1000 * 8)  # 1,000 batches of 8 rows
    assert abs(np.mean(source == 0) - 0.75) < 0.02
    counts = block_counts([3.0, 1.0])
    assert counts.tolist() == [768, 256] and counts.sum() == BLOCK_ROWS
    assert block_counts([1.0, 1.0, 1.0]).tolist() == [342, 341, 341]  # largest remainders


def test_a_row_is_a_pure_function_of_seed_and_row_and_each_source_reads_its_rows_in_order():
    mixture = Mixture([3.0, 1.0, 2.0], seed=5)
    whole = mixture.draw(0, 3000)
    # Another process makes rows [1000, 1700) on its own, with fresh caches: the same rows.
    part = Mixture([3.0, 1.0, 2.0], seed=5).draw(1000, 700)
    np.testing.assert_array_equal(part[0], whole[0][1000:1700])
    np.testing.assert_array_equal(part[1], whole[1][1000:1700])
    source, row = whole
    for index in range(3):  # each source's rows 0, 1, 2, ...: none skipped, none repeated
        np.testing.assert_array_equal(row[source == index], np.arange(np.sum(source == index)))
    other = Mixture([3.0, 1.0, 2.0], seed=6).draw(0, 3000)[0]
    assert not np.array_equal(other, source)


def test_a_fitted_tokenizer_sees_the_sources_by_weight():
    small, large = ["ab"] * 10, ["xyz"] * 100  # 20 and 300 bytes
    texts = list(weighted_texts([lambda: small, lambda: large], [20, 300], [3.0, 1.0]))
    seen_small = sum(len(t) for t in texts if t == "ab")
    seen_large = sum(len(t) for t in texts if t == "xyz")
    assert seen_small == 240 and seen_large == 81  # 320 bytes 3:1; the small source read 12 times
    assert list(weighted_texts([list, lambda: ["a"]], [0, 1], [1.0, 1.0])) == ["a"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two text files of different alphabets: ``(directory, overrides of a 3:1 mixture)``."""
    root = tmp_path_factory.mktemp("mixture")
    (root / "letters.txt").write_text("".join(f"abc def {i % 7} ghi\n" for i in range(80)))
    (root / "digits.txt").write_text("".join(f"{i * 37 % 1000} + {i} = ?\n" for i in range(80)))
    overrides = [
        *TINY,
        "data.source=text",
        "data.text_documents=lines",
        "data.tokenizer=char",
        f"data.mixture.letters.path={root / 'letters.txt'}",
        "data.mixture.letters.weight=3",
        f"data.mixture.digits.path={root / 'digits.txt'}",
    ]
    return root, overrides


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_mixture_logs_every_eval_metric_per_source_and_over_all(corpora, tmp_path):
    _, overrides = corpora
    run_dir = tmp_path / "run"
    run(
        load_config(None, [f"run_dir={run_dir}", *overrides, "train.steps=2"]),
        progress=False,
        log=_quiet,
    )
    last = _records(run_dir)[-1]
    for name in ("letters", "digits"):
        for key in ("eval_loss", "eval_accuracy", "eval_perplexity", "eval_tokens"):
            assert np.isfinite(last[f"{key}/{name}"]), (key, name, last)
    tokens = {name: last[f"eval_tokens/{name}"] for name in ("letters", "digits")}
    assert last["eval_tokens"] == sum(tokens.values())
    pooled = sum(last[f"eval_loss/{n}"] * t for n, t in tokens.items()) / last["eval_tokens"]
    assert last["eval_loss"] == pytest.approx(pooled)
    vocabulary = json.loads((run_dir / "tokenizer" / "vocab.json").read_text())["itos"]
    assert {"a", "h", "7", "+", "="} <= set(vocabulary)  # fitted on both sources
    assert sorted(p.name.split("-")[0] for p in (run_dir / "prepared").iterdir()) == ["text"] * 2


def test_a_text_file_beside_a_jsonl_corpus_trains_each_read_as_its_own_kind(corpora, tmp_path):
    """Issue 64: each part of a mixture may be its own kind of source: a text file beside a
    jsonl corpus (its own field), one tokenizer fitted on both, each evaluated on its own and
    recorded by its own reader; the same command again resumes with nothing changed."""
    root, _ = corpora
    with (tmp_path / "code.jsonl").open("w") as file:
        for i in range(60):
            file.write(json.dumps({"body": f"x = {i} * [{i % 5}]", "text": "NOT THIS"}) + "\n")
    run_dir = tmp_path / "run"
    overrides = [
        *TINY,
        f"run_dir={run_dir}",
        "data.source=text",
        "data.text_documents=lines",  # the text part's; the jsonl part's are its records
        "data.tokenizer=char",
        f"data.mixture.prose.path={root / 'letters.txt'}",
        f"data.mixture.code.path={tmp_path / 'code.jsonl'}",
        "data.mixture.code.source=jsonl",
        "data.mixture.code.field=body",
        "train.steps=2",
    ]
    run(load_config(None, overrides), progress=False, log=_quiet)
    last = _records(run_dir)[-1]
    assert np.isfinite(last["eval_loss/prose"]) and np.isfinite(last["eval_loss/code"])
    vocabulary = json.loads((run_dir / "tokenizer" / "vocab.json").read_text())["itos"]
    assert {"a", "h", "[", "*"} <= set(vocabulary) and "N" not in vocabulary  # the field's text
    stores = sorted(p.name.split("-")[0] for p in (run_dir / "prepared").iterdir())
    assert stores == ["jsonl", "text"]
    recorded = json.loads((run_dir / "inputs.json").read_text())
    assert sorted(pathlib.Path(f["path"]).name for f in recorded["files"]) == [
        "code.jsonl",
        "letters.txt",
    ]
    said = []  # the text part's kind written out is the same setting: no change to refuse
    again = [*overrides, "data.mixture.prose.source=text", "train.steps=3"]
    run(load_config(None, again), progress=False, log=said.append)
    assert not [line for line in said if "changed" in line or "differ" in line], said
    assert _records(run_dir)[-1]["step"] == 3


@pytest.mark.parametrize(
    "parts, message",
    [
        (
            ["data.mixture.store.source=prepared"],
            "data.mixture.store.source=prepared: the parts of a mixture share one tokenizer",
        ),
        (
            ["data.mixture.pairs.source=parallel"],
            "data.mixture: its parts' examples differ",
        ),
        (["data.mixture.pairs.source=csv"], "data.mixture.pairs.source must be one of"),
        (
            ["data.mixture.pairs.source=synthetic"],
            "data.mixture.pairs.source must be one of text, jsonl, parallel, prepared",
        ),
        (
            ["data.mixture.pairs.source=jsonl", "data.mixture.pairs.text_documents=lines"],
            "data.mixture.pairs: data.text_documents says how text files become documents",
        ),
    ],
)
def test_parts_of_kinds_that_cannot_mix_are_refused(tmp_path, parts, message):
    name = parts[0].split(".")[2]
    overrides = [
        "data.source=text",
        "data.mixture.prose.path=a.txt",
        f"data.mixture.{name}.path=b",
        *parts,
    ]
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(None, overrides)


def test_a_mixture_of_pairs_scores_each_sources_decoded_examples(tmp_path):
    for name, word in (("first", "abc"), ("second", "xyz")):
        pairs = "".join(f"{word} {i}\t{i} {word[::-1]}\n" for i in range(40))
        (tmp_path / f"{name}.tsv").write_text(pairs)
    run_dir = tmp_path / "run"
    overrides = [
        *TINY,
        "model.num_encoder_layers=1",
        "train.decode_examples=2",
        "data.source=parallel",
        "data.tokenizer=char",
        *(f"data.mixture.{name}.path={tmp_path / name}.tsv" for name in ("first", "second")),
    ]
    lines = []
    cfg = load_config(None, [f"run_dir={run_dir}", *overrides, "train.steps=1"])
    run(cfg, progress=False, log=lines.append)
    last = _records(run_dir)[-1]
    for name in ("first", "second"):
        for key in ("eval_loss", "eval_bleu", "eval_exact_match", "eval_token_accuracy"):
            assert f"{key}/{name}" in last, (key, name, last)
    assert "eval_loss" in last and "eval_bleu" not in last  # a corpus BLEU does not pool
    (line,) = [line for line in lines if line.startswith("eval at step 1")]
    assert "eval_tokens/first" in line  # what the source's eval_loss/first is over
    assert (
        "; greedy decoding of 4 validation examples (first 2, second 2): eval_exact_match/" in line
    )


def test_a_mixture_stopped_by_sigterm_resumes_bit_exactly(corpora, tmp_path, monkeypatch):
    _, overrides = corpora
    run(
        load_config(None, [f"run_dir={tmp_path / 'straight'}", *overrides, "train.steps=6"]),
        progress=False,
        log=_quiet,
    )
    make_train_step = loop.configured_train_step
    signal_at = {"step": 3}

    def stopping_step(*args, **kwargs):
        step_fn, calls = make_train_step(*args, **kwargs), []

        def step(*args):
            calls.append(1)
            if len(calls) == signal_at["step"]:
                os.kill(os.getpid(), signal.SIGTERM)
            return step_fn(*args)

        return step

    monkeypatch.setattr(loop, "configured_train_step", stopping_step)
    stopped = load_config(None, [f"run_dir={tmp_path / 'stopped'}", *overrides, "train.steps=6"])
    with pytest.raises(Interrupted) as raised:
        run(stopped, progress=False, log=_quiet)
    assert raised.value.step == 3
    signal_at["step"] = None
    run(stopped, progress=False, log=_quiet)

    def losses(name):
        return {r["step"]: r["loss"] for r in _records(tmp_path / name) if "loss" in r}

    assert losses("stopped") == losses("straight")
    assert sorted(losses("straight")) == list(range(1, 7))


def test_a_mixture_resumed_with_other_weights_is_refused(corpora, tmp_path, capsys):
    _, overrides = corpora
    run_dir = tmp_path / "run"
    run(
        load_config(None, [f"run_dir={run_dir}", *overrides, "train.steps=1"]),
        progress=False,
        log=_quiet,
    )
    before = sorted(p for p in run_dir.rglob("*") if p.name != "run.lock")
    args = [f"run_dir={run_dir}", *overrides, "data.mixture.letters.weight=1", "train.steps=2"]
    status = train_main([*args, "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2, err
    (line,) = err.strip().splitlines()  # one line, naming the weight once
    assert line.count("data.mixture.letters.weight: 3.0 -> 1.0") == 1, err
    assert "other weights" in line and "--force" in line and "--fresh" in line
    assert sorted(p for p in run_dir.rglob("*") if p.name != "run.lock") == before
    assert train_main([*args, "--no-progress", "--force"]) == 0  # on from the checkpoint's step
    assert "resuming with changed data (--force)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("data.mixture.digits.weight=0", "data.mixture.digits: weight must be a positive number"),
        ("data.mixture.digits.weight=-2", "data.mixture.digits: weight must be a positive number"),
        ("data.mixture.digits.weight=many", "data.mixture.digits.weight must be a number"),
        ("data.path=x.txt", "data.mixture names the training data"),
        ("model.num_encoder_layers=1", "task 'seq2seq' cannot train on data.source='text'"),
        ("data.mixture.digits.path=missing.txt", "data.mixture.digits.path: "),
        (
            "data.mixture.digits.validation_path={root}/letters.txt",
            "letters.txt is training data of data.mixture.letters too",
        ),
    ],
)
def test_a_bad_mixture_is_one_line_and_writes_nothing(corpora, tmp_path, capsys, setting, named):
    root, overrides = corpora
    run_dir = tmp_path / "run"
    setting = setting.format(root=root)
    status = train_main([f"run_dir={run_dir}", *overrides, setting, "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert named in err and len(err.strip().splitlines()) == 1, err
    assert not run_dir.exists() or not any(
        p for p in run_dir.rglob("*") if p.name not in ("run.lock", "library.log")
    )


def test_a_source_named_twice_is_refused(corpora, tmp_path, capsys):
    root, overrides = corpora
    config = tmp_path / "mixture.yaml"
    config.write_text(
        "data:\n  mixture:\n"
        f"    letters: {{path: {root / 'letters.txt'}}}\n"
        f"    letters: {{path: {root / 'digits.txt'}}}\n"
    )
    status = train_main(["--config", str(config), f"run_dir={tmp_path / 'run'}", *overrides])
    err = capsys.readouterr().err
    assert status == 2 and "the key 'letters' is given twice" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_a_mixture_of_prepared_stores_shares_their_tokenizer(corpora, tmp_path):
    root, _ = corpora
    for name, tokenizer in (("letters", "byte"), ("digits", "byte"), ("other", "char")):
        path = root / f"{'digits' if name == 'other' else name}.txt"
        prepare_store(tmp_path / name, source="text", path=str(path), tokenizer_name=tokenizer)
    mixture = {name: MixtureSource(str(tmp_path / name)) for name in ("letters", "digits")}
    cfg = DataConfig(source="prepared", mixture=mixture, seq_len=16)
    data = build_data(
        cfg, task=TASKS["lm"], seed=0, batch_size=8, directory=tmp_path / "tokenizer", prefetch=0
    )
    assert data.tokenizer.name == "byte" and set(data.sources) == {"letters", "digits"}
    assert next(data.train)["inputs"].shape == (8, 16)
    assert data.notices[0] == (
        "data.mixture (weights letters 1, digits 1): every 1,024 training rows hold letters 512 "
        "(50.0%), digits 512 (50.0%)"
    )
    mixture["digits"] = MixtureSource(str(tmp_path / "other"))  # a char store among byte ones
    with pytest.raises(ValueError, match="^data.mixture.digits: .*tokenizer"):
        build_data(
            DataConfig(source="prepared", mixture=mixture, seq_len=16),
            task=TASKS["lm"],
            seed=0,
            batch_size=8,
            directory=tmp_path / "other-run",
        )


def test_prepare_refuses_a_mixture_in_one_line(corpora, tmp_path, capsys):
    _, overrides = corpora
    data = [o for o in overrides if o.startswith("data.")]
    status = main(["prepare", "--no-progress", "--out", str(tmp_path / "store"), *data])
    err = capsys.readouterr().err
    assert status == 2 and "data.mixture: prepare makes one store" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "store").exists()


def _quiet(_message):
    pass


def test_unknown_tokens_and_a_source_too_small_for_a_row_are_said():
    """Text a tokenizer has no id for becomes <unk>, counted per split; a source whose training
    tokens do not fill a row is said to repeat."""
    tokenizer = CharTokenizer.fit(["abc"])
    texts = ["abcxyz", "aaa", "zz"]  # x, y, z: not in the vocabulary
    documents = Documents(
        tokens={"text": np.concatenate([tokenizer.encode(t) for t in texts])},
        offsets={"text": np.cumsum([0, *map(len, texts)])},
        digests=np.arange(3, dtype=np.uint64),
    )
    assert unknown_notice(tokenizer, documents, np.asarray([0, 2]), "code training") == (
        "5 of the 8 code training tokens (62.5%) are <unk>: text the char tokenizer has no id "
        "for (its vocabulary came from other text)"
    )
    assert unknown_notice(tokenizer, documents, np.asarray([1]), "code training") is None
    assert small_source_notice("tiny", 3, 32) == (
        "data.mixture.tiny: its 3 training tokens fill less than one row of data.seq_len=32: its "
        "share of the rows repeats them"
    )
    assert small_source_notice("big", 33, 32) is None


def test_each_source_s_samples_draw_their_own_key():
    """A mixture's sources are sampled at an evaluation with keys of their own: the same
    prompts under sources 0 and 1 continue differently."""
    import types

    from flax import nnx

    from flaxformer_lite.data.tasks import task_named
    from flaxformer_lite.data.tokenizers import ByteTokenizer
    from flaxformer_lite.models import build_model
    from flaxformer_lite.train.actions import decoded_eval

    cfg = load_config(None, ["data.source=text", "data.path=x.txt", "train.log_samples=2"])
    model = build_model(dataclasses.replace(cfg.model, vocab_size=260), rngs=nnx.Rngs(0))
    model.eval()
    data = types.SimpleNamespace(tokenizer=ByteTokenizer())
    examples = [{"text": "the first line of a play\n"}, {"text": "and its second line\n"}]
    logged = {0: [], 1: []}
    for source, lines in logged.items():
        decoded_eval(cfg, data, examples, task_named("lm"), model, 10, lines.append, source)
    assert len(logged[0]) == 2 and logged[0] != logged[1]
    again = []
    decoded_eval(cfg, data, examples, task_named("lm"), model, 10, again.append, 0)
    assert again == logged[0]  # a key of the seed, the step and the source: the same samples
