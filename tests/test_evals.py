"""Downstream evaluations (flaxformer_lite.evals): task files read as lm-evaluation-harness
reads them, requests made and cut as its Hugging Face model makes them (held to lm-eval's own
code: its rolling windows, its ``_encode_pair``, HellaSwag's ``process_docs``), packed rows
scored as each request alone, the metrics by their formulas, and bad task files refused naming
the file and line. (The scores against lm-eval's Hugging Face model on our export, and the
lm-eval adapter: test_evals_lm_eval.py; in training and the ``evaluate`` command:
test_evals_runs.py.)"""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import flaxformer_lite.evals.harness  # noqa: F401  the lm-eval extra's model registers
from flaxformer_lite.data.tokenizers import ByteTokenizer, make_tokenizer
from flaxformer_lite.evals import (
    EvalsConfig,
    Request,
    Scorer,
    TaskFile,
    TaskFileError,
    Tasks,
    encode_pair,
    load_task,
    pack,
    read_task_file,
    rolling_requests,
)
from flaxformer_lite.evals.requests import text_ids
from flaxformer_lite.evals.tasks import LastWord, MultipleChoice, Text
from flaxformer_lite.models.build import build_model
from flaxformer_lite.models.config import ModelConfig
from flaxformer_lite.train.config import ConfigError, load_config

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

LINES = ["the quick brown fox jumps over the lazy dog.", "a lazy dog sleeps, the fox runs!"]


def write_jsonl(path, objects):
    path.write_text("".join(json.dumps(obj) + "\n" for obj in objects))
    return path


@pytest.fixture(scope="module")
def bpe():
    return make_tokenizer("bpe", texts=LINES * 20, vocab_size=300)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.from_preset(
        "gpt2-tiny",
        vocab_size=300,
        num_decoder_layers=1,
        embedding_dropout=0.0,
        attention_dropout=0.0,
        residual_dropout=0.0,
    )
    built = build_model(cfg, rngs=nnx.Rngs(0))
    built.eval()
    return built


@pytest.mark.parametrize(("count", "length"), [(1, 4), (7, 4), (8, 4), (9, 4), (20, 3), (5, 1)])
def test_rolling_requests_are_lm_evals_windows(count, length):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    ids = list(range(10, 10 + count))
    windows = get_rolling_token_windows(ids, prefix_token=1, max_seq_len=length, context_len=1)
    expected = [make_disjoint_window(window) for window in windows]
    got = rolling_requests(ids, 1, length)
    assert [(list(r.context), list(r.continuation)) for r in got] == expected
    assert [t for r in got for t in r.continuation] == ids  # every token scored once


def test_encode_pair_is_lm_evals(bpe):
    """lm-eval's ``TemplateLM.loglikelihood`` (``_encode_pair``, the empty context) over a
    tokenizer that starts inputs with ``<sos>`` as our export's does."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import TemplateLM

    class Recorder(TemplateLM):
        eot_token_id = bpe.eos_id
        prefix_token_id = bpe.sos_id

        def tok_encode(self, string, add_special_tokens=None, **kwargs):
            return (
                list(text_ids(bpe, string))
                if add_special_tokens is not False
                else (bpe.encode(string))
            )

        def _loglikelihood_tokens(self, requests, **kwargs):
            return [(tuple(context), tuple(continuation)) for _, context, continuation in requests]

        loglikelihood_rolling = generate_until = None

    pairs = [
        ("the quick brown", " fox"),
        ("the quick brown ", "fox"),  # the trailing space moves to the continuation
        ("a lazy", " dog sleeps, the fox runs!"),
        ("", "the lazy dog"),
        ("Question: the fox?\nAnswer:", " jumps"),
    ]
    instances = [
        Instance("loglikelihood", {}, pair, idx=0, metadata=("t", i, 1))
        for i, pair in enumerate(pairs)
    ]
    expected = Recorder().loglikelihood(instances)
    got = [encode_pair(bpe, *pair) for pair in pairs]
    assert [(r.context, r.continuation) for r in got] == expected


def test_requests_keep_their_last_tokens_and_refuse_what_a_row_cannot_score():
    request = Request(tuple(range(1, 11)), (20, 21))
    assert request.tokens(5) == (7, 8, 9, 10, 20, 21) and request.cut(5)
    assert not request.cut(11)
    with pytest.raises(ValueError, match="adds no token"):
        encode_pair(ByteTokenizer(), "context", "")
    with pytest.raises(ValueError, match="the continuation is 3 tokens, more than the 2"):
        list(pack([Request((1,), (5, 6, 7))], rows=1, length=2))
    with pytest.raises(ValueError, match="a request needs a context"):
        list(pack([Request((), (5, 6))], rows=1, length=8))


def test_a_context_of_spaces_without_sos_starts_from_sos():
    """A tokenizer whose inputs start with no <sos> (GPT-2's): a context of spaces alone
    moves them to the continuation and leaves <sos>, as an empty context does."""

    class NoBos(ByteTokenizer):
        add_bos = False

    request = encode_pair(NoBos(), "  ", "ab")
    assert request.context == (NoBos.sos_id,)
    assert request.continuation == tuple(NoBos().encode("  ab"))


def test_the_adapter_reads_lm_evals_batch_size():
    from flaxformer_lite.evals.harness import _rows

    assert [_rows(v) for v in ("16", 4, None, "auto", "auto:4")] == [16, 4, 16, 16, 16]
    with pytest.raises(ValueError, match="batch_size must be a positive number or auto"):
        _rows("many")


def _spaces(text: str) -> list[int]:
    return [k for k, c in enumerate(text) if c == " "]


def _alone(model, request: Request, length: int) -> tuple[float, bool]:
    """A request's log-likelihood and greedy flag from one unpacked row, in float64."""
    tokens = request.tokens(length)
    logits = model(jnp.asarray([tokens[:-1]]))[0]
    log_p = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32)), np.float64)
    n = len(request.continuation)
    targets = np.asarray(tokens[1:])[-n:]
    picked = log_p[-n:][np.arange(n), targets]
    return float(picked.sum()), bool((log_p[-n:].argmax(-1) == targets).all())


@pytest.mark.parametrize("loss_chunk", [None, 5])
def test_packed_rows_score_each_request_as_alone(model, bpe, loss_chunk):
    """Several requests to a row, over several batches (the last one part padding), a context
    cut from the left, an empty one: each as its own unpacked row."""
    requests = [
        encode_pair(bpe, "the quick brown", " fox jumps"),
        encode_pair(bpe, "", "a lazy dog"),
        encode_pair(bpe, " ".join(LINES * 2), " over"),  # cut to the row's 16 positions
        *rolling_requests(bpe.encode(LINES[1]), bpe.sos_id, 16),
        *(encode_pair(bpe, LINES[0][:k], LINES[0][k:]) for k in _spaces(LINES[0])),
    ]
    loglikelihood, greedy = Scorer(rows=2, length=16, loss_chunk=loss_chunk)(model, requests)
    batches = list(pack(requests, rows=2, length=16))
    assert len(batches) > 2 and sorted(i for _, idx in batches for i in idx) == list(
        range(len(requests))
    )
    for index, request in enumerate(requests):
        expected, is_greedy = _alone(model, request, 16)
        assert loglikelihood[index] == pytest.approx(expected, rel=1e-5, abs=1e-4), index
        assert greedy[index] == is_greedy


def test_packing_fills_rows_and_marks_the_continuations():
    requests = [Request((1, 2), (3,)), Request((1,), (4, 5, 6)), Request((1, 2, 3), (7, 8))]
    [(batch, indices)] = pack(requests, rows=1, length=10)
    # Longest first: 4 positions, then 3 and 2; one row of 10 holds them all.
    assert indices == [2, 1, 0]
    np.testing.assert_array_equal(batch["inputs"][0], [1, 2, 3, 7, 1, 4, 5, 1, 2, 0])
    np.testing.assert_array_equal(batch["targets"][0], [2, 3, 7, 8, 4, 5, 6, 2, 3, 0])
    np.testing.assert_array_equal(batch["weights"][0], [0, 0, 1, 1, 1, 1, 1, 0, 1, 0])
    np.testing.assert_array_equal(batch["segment_ids"][0], [1, 1, 1, 1, 2, 2, 2, 3, 3, 0])
    np.testing.assert_array_equal(batch["positions"][0], [0, 1, 2, 3, 0, 1, 2, 0, 1, 0])
    np.testing.assert_array_equal(batch["request"][0][:9], [0, 0, 0, 0, 1, 1, 1, 2, 2])


def test_multiple_choice_metrics_are_lm_evals():
    """acc: the highest log-likelihood; acc_norm: divided by the choice's characters."""
    task = MultipleChoice("t", [])
    task.examples = [
        _choice(("a", "bbbbbbbb"), answer=1),  # -2 vs -8: acc misses, acc_norm (-2 vs -1) hits
        _choice(("aa", "b", "c"), answer=0),  # -1 best by both
    ]
    loglikelihood = np.array([-2.0, -8.0, -1.0, -3.0, -2.5])
    assert task.metrics(loglikelihood, np.ones(5, bool)) == {"acc": 0.5, "acc_norm": 1.0}


def _choice(choices, answer):
    from flaxformer_lite.evals.formats import Choice

    return Choice("context", choices, answer, "f:1")


def test_last_word_and_text_metrics_are_their_formulas(bpe):
    from flaxformer_lite.evals.formats import Passage

    last = LastWord("l", [Passage("a b", "f:1"), Passage("c d", "f:2")])
    values = last.metrics(np.array([-1.0, -3.0]), np.array([True, False]))
    assert values == {"acc": 0.5, "perplexity": pytest.approx(math.exp(2.0))}
    texts = [Passage("one two  three", "f"), Passage("é four", "f:2")]
    text = Text("t", texts)
    requests = text.requests(bpe, 4)
    tokens = sum(1 + len(bpe.encode(p.text)) for p in texts)  # <sos> and the text's, as lm-eval
    assert sum(len(r.continuation) for r in requests) == tokens == text.size
    loglikelihood = -np.arange(1.0, len(requests) + 1)
    values = text.metrics(loglikelihood, np.zeros(len(requests), bool))
    nll, size = -loglikelihood.sum(), len(b"one two  three") + len("é four".encode())
    assert values["token_perplexity"] == pytest.approx(math.exp(nll / tokens))
    assert values["byte_perplexity"] == pytest.approx(math.exp(nll / size))
    assert values["bits_per_byte"] == pytest.approx(nll / size / math.log(2))
    assert values["word_perplexity"] == pytest.approx(math.exp(nll / 5))  # 3 + 2 words


HELLASWAG = {
    "ind": 4,
    "activity_label": "Removing ice from car",
    "ctx_a": "Then, the man writes over the snow covering the window of a car.",
    "ctx_b": "a woman wearing winter clothes",
    "ctx": "...",
    "endings": [", the man [title] continues.", " smiles at  the camera.", "x", "y [step] z"],
    "label": "3",
    "split": "val",
}


def test_hellaswag_is_read_as_lm_evals_process_docs(tmp_path):
    datasets = pytest.importorskip("datasets")
    from lm_eval.tasks.hellaswag.utils import process_docs

    path = write_jsonl(tmp_path / "hellaswag_val.jsonl", [HELLASWAG, {**HELLASWAG, "label": 1}])
    [doc, _] = process_docs(datasets.Dataset.from_list([{**HELLASWAG, "label": "3"}] * 2))
    [first, second] = read_task_file(path, "hellaswag")
    assert (first.context, list(first.choices), first.answer) == (
        doc["query"],
        doc["choices"],
        doc["gold"],
    )
    assert second.answer == 1 and first.where == f"{path}:1"


def test_arc_piqa_choice_and_lambada_formats(tmp_path):
    choices = {"text": ["red", "blue", "green"], "label": ["A", "B", "C"]}
    arc = write_jsonl(
        tmp_path / "arc.jsonl",
        [
            {"question": "Sky?", "choices": choices, "answerKey": "B"},
            {
                "question": {"stem": "Grass?", "choices": [{"text": "green", "label": "1"}]},
                "answerKey": "1",
            },
        ],
    )
    hf, release = read_task_file(arc, "arc_easy")
    assert (hf.context, hf.choices, hf.answer) == (
        "Question: Sky?\nAnswer:",
        ("red", "blue", "green"),
        1,
    )
    assert (release.context, release.answer) == ("Question: Grass?\nAnswer:", 0)
    piqa = write_jsonl(
        tmp_path / "piqa.jsonl", [{"goal": "g", "sol1": "a", "sol2": "b", "label": 1}]
    )
    [example] = read_task_file(piqa, "piqa")
    assert (example.context, example.choices, example.answer) == (
        "Question: g\nAnswer:",
        ("a", "b"),
        1,
    )
    plain = write_jsonl(
        tmp_path / "mine.jsonl", [{"context": "c", "choices": ["x"], "answer": 0}] * 5
    )
    assert len(read_task_file(plain, "choice", limit=3)) == 3
    lambada = write_jsonl(tmp_path / "lambada.jsonl", [{"text": "he said hello"}])
    task = load_task("lambada", TaskFile(path=str(lambada)))
    [request] = task.requests(ByteTokenizer(), 32)
    assert bytes(t - 4 for t in request.continuation) == b" hello"
    text = tmp_path / "book.txt"
    text.write_text("line one\n\nline two\n")
    assert [p.text for p in read_task_file(text, "text")] == ["line one\n\nline two\n"]


@pytest.mark.parametrize(
    ("content", "fmt", "message"),
    [
        (None, "choice", "no such task file"),
        ("{not json\n", "choice", ":1: not valid JSON"),
        (
            '{"context": "c", "choices": ["a"], "answer": 0}\n[1]\n',
            "choice",
            ":2: expected a JSON object",
        ),
        (
            '{"context": "c", "choices": ["a", "b"], "answer": 2}\n',
            "choice",
            ":1: the answer's index 2 is out of range for 2 choices",
        ),
        ('{"context": "c", "choices": [], "answer": 0}\n', "choice", ":1: no choices"),
        (
            '{"context": "c", "choices": ["a", ""], "answer": 0}\n',
            "choice",
            ":1: choice 1 is empty",
        ),
        ('{"context": "c", "answer": 0}\n', "choice", ":1: no field 'choices'"),
        ('{"context": "c", "choices": [1], "answer": 0}\n', "choice", ":1: choices holds int"),
        (
            '{"goal": "g", "sol1": "a", "sol2": "b", "label": "x"}\n',
            "piqa",
            "label 'x' is not an index",
        ),
        (
            '{"question": "q", "choices": {"text": ["a"], "label": ["A"]}, "answerKey": "B"}\n',
            "arc",
            "answerKey 'B' is none of",
        ),
        ('{"text": "oneword"}\n', "lambada", ":1: text must have a word before its last one"),
        ("  \n", "text", "empty file"),
    ],
)
def test_bad_task_files_name_the_file_and_line(tmp_path, content, fmt, message):
    path = tmp_path / ("task.txt" if fmt == "text" else "task.jsonl")
    if content is not None:
        path.write_text(content)
    with pytest.raises(TaskFileError) as raised:
        read_task_file(path, fmt)
    assert str(path) in str(raised.value) and message in str(raised.value)


def test_a_task_is_named_by_its_format_or_refused(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "a b"}])
    with pytest.raises(TaskFileError, match="evals.tasks.mine: unknown task format 'mine'; known"):
        load_task("mine", TaskFile(path=str(path)))
    with pytest.raises(TaskFileError, match=r"evals.tasks.x.format: unknown task format 'lamb'"):
        load_task("x", TaskFile(path=str(path), format="lamb"))


def test_a_continuation_longer_than_a_row_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"context": "c", "choices": ["x" * 40], "answer": 0}])
    with pytest.raises(TaskFileError, match=r"t.jsonl:1: choice 0: the continuation is 41 tokens"):
        Tasks([load_task("t", TaskFile(path=str(path), format="choice"))], ByteTokenizer(), 32)


def test_long_contexts_are_cut_and_said(tmp_path):
    path = write_jsonl(
        tmp_path / "t.jsonl", [{"context": "c" * k, "choices": ["x"], "answer": 0} for k in (5, 50)]
    )
    tasks = Tasks([load_task("t", TaskFile(path=str(path), format="choice"))], ByteTokenizer(), 32)
    [line] = tasks.notices()
    assert line.startswith("task t: 1 of 2 requests are longer than 33 tokens: their contexts")


def test_the_evals_section(tmp_path):
    cfg = load_config(None, ["evals.tasks.hs.path=a.jsonl", "evals.tasks.hs.format=hellaswag"])
    assert cfg.evals == EvalsConfig(tasks={"hs": TaskFile(path="a.jsonl", format="hellaswag")})
    with pytest.raises(ConfigError, match="a task's name is letters"):
        load_config(None, ["evals.tasks.a/b.path=x"])
    with pytest.raises(ConfigError, match="path is required"):
        load_config(None, ["evals.tasks.x.limit=3"])
    with pytest.raises(ConfigError, match="every must be at least 1"):
        load_config(None, ["evals.every=0"])
    with pytest.raises(ConfigError, match="evals.tasks are scored by a decoder LM"):
        load_config(None, ["model.preset=bert-tiny", "evals.tasks.x.path=y"])


def test_the_built_in_tasks_are_made_from_the_held_out_tail():
    """The shipped files are what tests/shakespeare_tasks.py makes, every line of their contexts
    and answers from the last tenth of Tiny Shakespeare (what shakespeare_char holds out)."""
    from shakespeare_tasks import make_tasks

    from flaxformer_lite.data import readers
    from flaxformer_lite.evals.formats import task_path

    text = readers.read_text(readers.builtin_text("tinyshakespeare"))
    head = text[: int(len(text) * 0.9)]
    for name, records in make_tasks(text).items():
        lines = task_path(f"builtin:{name}").read_text().splitlines()
        assert [json.loads(line) for line in lines] == records, name
        assert len(records) == 200
    tasks = {
        name: load_task(name, TaskFile(path=f"builtin:{name}"))
        for name in ("shakespeare_next_line", "shakespeare_last_word")
    }
    tail = text[len(head) :]
    for example in tasks["shakespeare_next_line"].examples:  # a speaker, then lines of its speech
        passage = example.context + " " + example.choices[example.answer]
        assert all(line in tail for line in passage.split("\n")), example
    for example in tasks["shakespeare_last_word"].examples:
        assert all(line in tail for line in example.text.split("\n")), example
    with pytest.raises(TaskFileError, match="builtin:nope: no such built-in task"):
        load_task("x", TaskFile(path="builtin:nope", format="choice"))
