"""The training tasks as objects (data/tasks.py): each one's batch is what its rows are, an
unknown name is refused, and what each task decides (packing, records, metric unit, perplexity,
decoding, export) is as documented."""

import numpy as np
import pytest

from flaxformer_lite.data import synthetic
from flaxformer_lite.data.batches import Layout, TrainBatches, eval_batches
from flaxformer_lite.data.documents import (
    LABELLED_RECORDS,
    PAIR_RECORDS,
    TEXT_RECORDS,
    from_ids,
)
from flaxformer_lite.data.features import truncation
from flaxformer_lite.data.tasks import TASKS, Classify, task_named
from flaxformer_lite.train.decode_eval import decodable

SOS, EOS, T, B = 1, 2, 10, 4
RNG = np.random.default_rng(0)
LENGTHS = [1, T - 3, T - 2, T - 1, T, 2 * T, 3, 5]  # around what a row keeps, and longer
TEXTS = [RNG.integers(4, 50, n) for n in LENGTHS]
DOCUMENTS = from_ids(
    {"text": TEXTS, "source": TEXTS[::-1], "target": TEXTS},
    np.arange(len(TEXTS)),
    labels=RNG.integers(0, 3, len(TEXTS)),
    dtype=np.uint16,
)
IDS = np.arange(len(TEXTS))


def layout(name: str, rows: str) -> Layout:
    return Layout(
        task=task_named(name),
        rows=rows,
        seq_len=T,
        batch_size=B,
        process_index=0,
        process_count=1,
        sos_id=SOS,
        eos_id=EOS,
        vocab_size=50,
        mlm_probability=0.3,
        seed=0,
    )


def shapes(batch):
    return {key: (value.shape, value.dtype) for key, value in batch.items()}


@pytest.mark.parametrize(
    "name, rows",
    [("lm", "documents"), ("lm", "single"), ("seq2seq", "single")]
    + [("mlm", "single"), ("classify", "single")],
)
def test_train_and_eval_batches_are_the_tasks_description(name, rows):
    task = task_named(name)
    wanted = task.batch_shapes(packed=rows != "single", batch_size=B, seq_len=T)
    assert shapes(TrainBatches(DOCUMENTS, IDS, layout(name, rows))(0)) == wanted
    for batch in eval_batches(DOCUMENTS, IDS, layout(name, rows)):
        assert shapes(batch) == wanted


def test_an_unknown_task_is_refused_with_the_known_ones():
    with pytest.raises(
        ValueError, match="task must be one of lm, seq2seq, mlm, classify, got 'translate'"
    ):
        task_named("translate")
    assert {name: task.name for name, task in TASKS.items()} == {name: name for name in TASKS}


def test_only_lm_packs_and_by_default():
    assert [task.is_packed(None) for task in TASKS.values()] == [True, False, False, False]
    assert not task_named("lm").is_packed(False) and task_named("lm").is_packed(True)
    for name in ("seq2seq", "mlm", "classify"):
        with pytest.raises(
            ValueError, match=f"data.packing=true applies to task 'lm' only.*{name}"
        ):
            task_named(name).is_packed(True)


def test_each_task_trains_on_its_records_only():
    accepted = {
        name: [r for r in (TEXT_RECORDS, PAIR_RECORDS, LABELLED_RECORDS) if r in task.records]
        for name, task in TASKS.items()
    }
    assert accepted == {
        "lm": [TEXT_RECORDS, LABELLED_RECORDS],
        "seq2seq": [PAIR_RECORDS],
        "mlm": [TEXT_RECORDS, LABELLED_RECORDS],
        "classify": [LABELLED_RECORDS],
    }
    with pytest.raises(ValueError, match="task 'classify' cannot train on X: it needs labelled"):
        task_named("classify").check_records(TEXT_RECORDS, "X")
    task_named("classify").check_records(LABELLED_RECORDS, "X")


def test_metric_units_perplexity_and_loss_kinds():
    described = {name: (task.unit, task.perplexity, task.per_token) for name, task in TASKS.items()}
    assert described == {
        "lm": ("tokens", True, True),
        "seq2seq": ("tokens", True, True),
        "mlm": ("masked tokens", False, True),
        "classify": ("examples", False, False),
    }
    batch = {"labels": np.zeros(2, np.int32)}  # a classify batch may leave out its weights
    labels, weights = Classify().targets(batch)
    assert labels is batch["labels"] and weights is None


def test_which_tasks_decode_which_examples():
    prompts = synthetic.make_generator("arithmetic", size=4)
    pairs = synthetic.make_generator("number_words", size=4)
    labelled = synthetic.make_generator("sentiment", size=4)
    plain = [{"text": "a text with no answer"}]
    lm, seq2seq = task_named("lm"), task_named("seq2seq")
    assert decodable(lm, prompts) and not decodable(lm, plain) and not decodable(lm, labelled)
    assert decodable(seq2seq, pairs) and decodable(seq2seq, [{"source": "a", "target": "b"}])
    assert not any(decodable(task_named(name), plain) for name in ("mlm", "classify"))
    assert [task.continues for task in TASKS.values()] == [True, False, False, False]


def test_export_templates_and_inputs():
    templates = {name: task.template("S", "E") for name, task in TASKS.items()}
    assert templates == {
        "lm": ["S", "$A"],
        "seq2seq": ["$A", "E"],
        "mlm": ["S", "$A", "E"],
        "classify": ["S", "$A", "E"],
    }
    with_types = [name for name, task in TASKS.items() if "token_type_ids" in task.hf_inputs]
    assert with_types == ["mlm", "classify"]
    assert [name for name, task in TASKS.items() if task.mask_token] == ["mlm"]


@pytest.mark.parametrize("name", ["seq2seq", "mlm", "classify"])
def test_what_truncation_counts_cut_is_what_the_rows_leave_out(name):
    task = task_named(name)
    rows = task.document_rows(layout(name, "single"), DOCUMENTS, IDS, IDS, 0)
    # The tokens of each field a row shows: ids >= 4 (the specials are below), where it counts.
    arrays = {
        "seq2seq": {"source": ("src", "src_mask"), "target": ("targets", "weights")},
        "mlm": {"text": ("targets", "mask")},
        "classify": {"text": ("inputs", "mask")},
    }[name]
    regular = {field: (rows[ids] >= 4) & (rows[mask] > 0) for field, (ids, mask) in arrays.items()}
    lengths = {field: DOCUMENTS.lengths(field)[IDS] for field in regular}
    shown = {field: kept.sum(1) for field, kept in regular.items()}
    cut = sum(lengths[field] - shown[field] for field in regular)
    total = sum(int(lengths[field].sum()) for field in regular)
    assert truncation(DOCUMENTS, IDS, task.kept(T)) == ((cut > 0).sum(), cut.sum(), total)
    assert 0 < (cut > 0).sum() < len(IDS)


def test_target_tokens_are_the_eval_weights_of_token_tasks():
    for name in ("lm", "seq2seq"):
        rows = "documents" if name == "lm" else "single"
        weights = sum(b["weights"].sum() for b in eval_batches(DOCUMENTS, IDS, layout(name, rows)))
        assert task_named(name).target_tokens(DOCUMENTS, IDS, T) == weights
    assert task_named("mlm").target_tokens(DOCUMENTS, IDS, T) is None
