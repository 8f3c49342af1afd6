"""The pipeline: the data settings' checks, each task's batches, packing, evaluation passes,
fitted tokenizers (sources' records: test_source_records.py; determinism, resumption and
sharding: test_pipeline_state.py)."""

import dataclasses
import json

import numpy as np
import pytest
from pipeline_cases import BYTES, LINES, assert_batches_equal, build, take, text_cfg, write_corpus

from flaxformer_lite.data import sentiment_words, synthetic, tasks
from flaxformer_lite.data.config import DataConfig
from flaxformer_lite.data.features import MASK_ID
from flaxformer_lite.data.pipeline import build_data
from flaxformer_lite.data.tasks import TASKS
from flaxformer_lite.data.tokenizers import EOS_ID, SOS_ID, UNK_ID

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path)


def lm_row_text(tokenizer, inputs, targets, weights):
    """Checks one unpacked lm row (shift, <sos>/<eos>, padding) and returns its text."""
    n = int(weights.sum())
    assert weights[:n].all() and not weights[n:].any()
    assert inputs[0] == SOS_ID and targets[n - 1] == EOS_ID
    np.testing.assert_array_equal(inputs[1:n], targets[: n - 1])
    assert not inputs[n:].any() and not targets[n:].any()
    return tokenizer.decode(inputs[:n])


def lm_texts(tokenizer, batch):
    rows = zip(batch["inputs"], batch["targets"], batch["weights"], strict=True)
    return [lm_row_text(tokenizer, *row) for row in rows if row[2].any()]


# --- configuration and task checks ------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"source": "csv"}, "data.source"),
        ({"generator": "chess"}, "data.generator"),
        ({"source": "text"}, "data.path"),
        ({"tokenizer": "bpe"}, "data.vocab_size"),
        ({"tokenizer": "bpe", "vocab_size": 100}, "data.vocab_size"),
        ({"tokenizer": "sentencepiece"}, "data.tokenizer_path"),
        ({"seq_len": 2}, "data.seq_len"),
        ({"validation_fraction": 1.0}, "data.validation_fraction"),
        ({"mlm_probability": 0.0}, "data.mlm_probability"),
        ({"train_size": 0}, "data.train_size"),
        ({"lm_rows": "lines"}, "data.lm_rows"),
        ({"lm_rows": "windows", "packing": False}, "data.lm_rows"),
    ],
)
def test_config_rejects_bad_values_naming_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        DataConfig(**kwargs)


@pytest.mark.parametrize(
    "cfg, task, batch_size, match",
    [
        (
            DataConfig(packing=False, source="parallel", path="x.tsv"),
            "lm",
            4,
            "task 'lm' cannot train on",
        ),
        (DataConfig(packing=False, source="text", path="x.txt"), "classify", 4, "labelled text"),
        (DataConfig(packing=False, generator="arithmetic"), "seq2seq", 4, "source/target pairs"),
        (DataConfig(generator="sentiment", packing=True), "mlm", 4, "'lm' only"),
        (DataConfig(generator="sentiment", lm_rows="windows"), "classify", 4, "'lm' only"),
        (DataConfig(packing=False), "lm", 3, "positive multiple of the process count 2"),
        (DataConfig(packing=False), "translate", 4, "task must be one of"),
    ],
)
def test_build_rejects_data_that_does_not_fit(tmp_path, cfg, task, batch_size, match):
    with pytest.raises(ValueError, match=match):
        build(cfg, tmp_path, task=task, batch_size=batch_size, process_count=2)


def test_build_names_a_missing_data_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.txt: file not found"):
        build(text_cfg(tmp_path / "nowhere.txt"), tmp_path)


# --- batch formats ---------------------------------------------------------------------------


def test_lm_batches_shift_pad_and_cover_each_epoch_in_a_new_order(corpus, tmp_path):
    data = build(text_cfg(corpus, seq_len=24), tmp_path, batch_size=3)  # 27 examples = 9 batches
    held_out = [r["text"] for r in data.eval_examples]
    assert len(held_out) == 3 and set(held_out) <= set(LINES)
    epochs = []
    for _ in range(2):
        texts = []
        for batch in take(data.train, 9):
            assert {k: (v.shape, v.dtype.name) for k, v in batch.items()} == {
                "inputs": ((3, 24), "int32"),
                "targets": ((3, 24), "int32"),
                "weights": ((3, 24), "float32"),
            }
            texts += lm_texts(data.tokenizer, batch)
        epochs.append(texts)
    train_texts = sorted(set(LINES) - set(held_out))
    assert sorted(epochs[0]) == sorted(epochs[1]) == train_texts
    assert epochs[0] != epochs[1]


def test_long_lm_examples_go_on_in_other_rows_never_cut(tmp_path):
    path = tmp_path / "long.txt"
    # 17 bytes, every line different in every piece: 18 positions, rows of 8, 8 and 2.
    lines = ["".join(chr(97 + (i + k) % 26) for k in range(16)) + str(i) for i in range(10)]
    path.write_text("".join(f"{line}\n" for line in lines))
    data = build(text_cfg(path, seq_len=8), tmp_path)
    held_out = {r["text"] for r in data.eval_examples}
    train_lines = sorted(set(lines) - held_out)
    batches = take(data.train, -(-3 * len(train_lines) // 4))  # an epoch: 3 rows per line
    rows = [
        row for b in batches for row in zip(b["inputs"], b["targets"], b["weights"], strict=True)
    ]
    found = []
    for inputs, targets, weights in rows[: 3 * len(train_lines)]:
        n = int(weights.sum())
        assert weights[:n].all() and not weights[n:].any()
        assert not inputs[n:].any() and not targets[n:].any()
        np.testing.assert_array_equal(inputs[1:n], targets[: n - 1])  # the shift
        found.append((tuple(inputs[:n].tolist()), tuple(targets[:n].tolist())))
    # Each line whole, <sos> line / line <eos>, in pieces of 8 positions from its start: the
    # shift goes on from one piece to the next, and each piece is one row of the epoch.
    expected = []
    for line in train_lines:
        inputs, targets = [SOS_ID, *BYTES.encode(line)], [*BYTES.encode(line), EOS_ID]
        expected += [(tuple(inputs[k : k + 8]), tuple(targets[k : k + 8])) for k in (0, 8, 16)]
    assert [len(i) for i, _ in expected[:3]] == [8, 8, 2]
    assert sorted(found) == sorted(expected)
    # The epoch's rows come shuffled: a line's pieces are not all in consecutive rows.
    line_of = [expected.index(piece) // 3 for piece in found]
    assert any(len(set(line_of[k : k + 3])) > 1 for k in range(0, len(line_of), 3))
    # Validation counts every position of every held-out line, also cut into rows of 8.
    assert data.eval_tokens == sum(len(line) + 1 for line in held_out)
    eval_weights = sum(float(b["weights"].sum()) for b in data.eval_batches())
    assert eval_weights == data.eval_tokens
    assert data.eval_batch_count == len(list(data.eval_batches())) == -(-3 * len(held_out) // 4)


def test_seq2seq_batches_from_two_parallel_files(tmp_path):
    src, tgt = tmp_path / "src.txt", tmp_path / "tgt.txt"
    pairs = {f"quelle {i}": f"target number {i}" for i in range(20)}
    src.write_text("\n".join(pairs) + "\n")
    tgt.write_text("\n".join(pairs.values()) + "\n")
    cfg = DataConfig(
        packing=False, source="parallel", path=f"{src},{tgt}", tokenizer="word", seq_len=8
    )
    data = build(cfg, tmp_path, task="seq2seq")
    for batch in take(data.train, 5):
        assert batch["src_mask"].dtype == bool and batch["src"].shape == (4, 8)
        for row in range(4):
            n = int(batch["src_mask"][row].sum())
            np.testing.assert_array_equal(batch["src_mask"][row], batch["src"][row] != 0)
            assert batch["src"][row, n - 1] == EOS_ID
            source = data.tokenizer.decode(batch["src"][row])
            target_side = (batch["inputs"][row], batch["targets"][row], batch["weights"][row])
            assert lm_row_text(data.tokenizer, *target_side) == pairs[source]


def test_classify_batches_carry_labels_and_pad_the_last_eval_batch(tmp_path):
    cfg = DataConfig(packing=False, generator="sentiment", seq_len=160, train_size=12, eval_size=6)
    data = build(cfg, tmp_path, task="classify")
    assert data.labels == sentiment_words.LABELS
    task = synthetic.make_generator("sentiment", size=12)
    label_of = {task[i]["text"]: task[i]["label"] for i in range(12)}
    for batch in take(data.train, 3):
        assert batch["labels"].dtype == np.int32 and batch["labels"].shape == (4,)
        np.testing.assert_array_equal(batch["mask"], batch["inputs"] != 0)
        assert (batch["inputs"][:, 0] == SOS_ID).all() and batch["weights"].all()
        texts = [data.tokenizer.decode(row) for row in batch["inputs"]]
        assert [label_of[t] for t in texts] == batch["labels"].tolist()
    first, last = data.eval_batches()
    np.testing.assert_array_equal(last["weights"], [1, 1, 0, 0])
    assert not last["mask"][2:].any() and first["mask"].any(axis=1).all()


def test_mlm_masks_15_percent_split_80_10_10_deterministically(tmp_path):
    cfg = DataConfig(packing=False, generator="sentiment", seq_len=128, train_size=2000)
    batches = take(build(cfg, tmp_path, task="mlm", batch_size=16).train, 20)
    counts = {"mask": 0, "random": 0, "kept": 0}
    for batch in batches:
        inputs, targets, weights, mask = (
            batch[k] for k in ("inputs", "targets", "weights", "mask")
        )
        np.testing.assert_array_equal(mask, targets != 0)
        picked = weights > 0
        np.testing.assert_array_equal(inputs[~picked], targets[~picked])
        regular = mask.sum(axis=1) - 2  # <sos> and <eos> are never picked
        assert not picked[:, 0].any()
        np.testing.assert_array_equal(picked.sum(axis=1), np.maximum(1, np.round(0.15 * regular)))
        counts["mask"] += int((inputs[picked] == MASK_ID).sum())
        counts["kept"] += int((inputs[picked] == targets[picked]).sum())
        counts["random"] += int(((inputs != MASK_ID) & (inputs != targets))[picked].sum())
    total = sum(counts.values())
    assert total > 2000
    assert 0.76 < counts["mask"] / total < 0.84
    assert 0.08 < counts["random"] / total < 0.12 and 0.08 < counts["kept"] / total < 0.12
    again = take(build(cfg, tmp_path, task="mlm", batch_size=16).train, 2)
    assert_batches_equal(again, batches[:2])


# --- packing ---------------------------------------------------------------------------------


def test_packed_rows_hold_each_epochs_examples_whole_once(corpus, tmp_path):
    cfg = text_cfg(corpus, seq_len=48)
    data = build(dataclasses.replace(cfg, packing=True), tmp_path)
    train_lines = sorted(set(LINES) - {r["text"] for r in data.eval_examples})
    per_epoch = sum(len(line) + 1 for line in train_lines)  # an epoch's weights
    epochs, segments, filled = [], [], 0
    while len(epochs) < 2:
        batch = next(data.train)
        assert batch["segment_ids"].dtype == np.int32 and batch["positions"].shape == (4, 48)
        for inputs, targets, weights, ids, positions in zip(
            *(batch[k] for k in ("inputs", "targets", "weights", "segment_ids", "positions")),
            strict=True,
        ):
            np.testing.assert_array_equal(weights > 0, ids > 0)
            assert not inputs[ids == 0].any() and not targets[ids == 0].any()
            row = []
            for segment in range(1, ids.max() + 1):
                where = ids == segment
                np.testing.assert_array_equal(positions[where], np.arange(where.sum()))
                row.append(lm_row_text(BYTES, inputs[where], targets[where], weights[where]))
            segments.append(tuple(row))
            filled += int(weights.sum())
            assert filled <= per_epoch  # an epoch ends at a row's end
            if filled == per_epoch:
                epochs.append(segments)
                segments, filled = [], 0
    # Each epoch's rows hold every training line once, whole, as the unpacked epoch's rows do
    # (the same documents: next-fit packs them in the epoch's order, then the rows are
    # shuffled); the next epoch packs and hands them out in another order.
    unpacked = take(build(cfg, tmp_path).train, 7)  # 27 lines, one a row: an epoch and a row
    stream = [BYTES.decode(row) for b in unpacked for row in b["inputs"]][: len(train_lines)]
    for rows in epochs:
        assert sorted(line for row in rows for line in row) == sorted(stream) == train_lines
        # Lines of 13 to 21 positions, next-fit into 48: only the last row cut holds one line.
        assert sum(len(row) == 1 for row in rows) <= 1
    assert epochs[0] != epochs[1]


def test_eval_batches_cover_the_validation_split_once_in_order(corpus, tmp_path):
    data = build(text_cfg(corpus, validation_fraction=0.3), tmp_path)  # 9 validation lines
    batches = list(data.eval_batches())
    assert len(batches) == data.eval_batch_count == 3  # unpacked: one line per row
    assert set(batches[0]) == {"inputs", "targets", "weights"}
    texts = [text for batch in batches for text in lm_texts(data.tokenizer, batch)]
    assert texts == [r["text"] for r in data.eval_examples]
    assert not batches[-1]["inputs"][1:].any() and not batches[-1]["weights"][1:].any()
    assert data.eval_tokens == sum(len(t) + 1 for t in texts)
    assert_batches_equal(list(data.eval_batches()), batches)
    # Packed, the same lines in the same order, several to a row, each its own segment.
    packed = build(text_cfg(corpus, validation_fraction=0.3, packing=True), tmp_path)
    segments = []
    for batch in packed.eval_batches():
        for inputs, targets, weights, ids, positions in zip(
            *(batch[k] for k in ("inputs", "targets", "weights", "segment_ids", "positions")),
            strict=True,
        ):
            for segment in range(1, ids.max() + 1):
                where = ids == segment
                np.testing.assert_array_equal(positions[where], np.arange(where.sum()))
                segments.append(lm_row_text(BYTES, inputs[where], targets[where], weights[where]))
    assert segments == texts
    assert packed.eval_batch_count == 1 and packed.eval_tokens == data.eval_tokens


def test_file_documents_train_on_the_head_of_each_file_and_validate_on_its_tail(tmp_path):
    texts = {
        "a.txt": "".join(f"line {i} of a\n" for i in range(20)) + "\n\nafter blank lines\n",
        "b.txt": "B: " + "short text\r\nwith CRLF\r\n" * 3,
    }
    for name, text in texts.items():
        (tmp_path / name).write_text(text, newline="")
    cfg = DataConfig(
        source="text", path=str(tmp_path / "*.txt"), seq_len=16, validation_fraction=0.25
    )
    data = build(cfg, tmp_path, batch_size=2)
    cuts = [int(len(text) * 0.75) for text in texts.values()]  # bytes: one id per character
    heads = [text[:cut] for text, cut in zip(texts.values(), cuts, strict=True)]
    tails = [text[cut:] for text, cut in zip(texts.values(), cuts, strict=True)]
    assert [r["text"] for r in data.eval_examples] == tails  # each file's tail, in file order
    # Validation: each tail cut into pieces of 16 positions, packed, in order; nothing else.
    segments = []
    for batch in data.eval_batches():
        for row in range(len(batch["weights"])):
            ids = batch["segment_ids"][row]
            for segment in range(1, ids.max() + 1):
                where = ids == segment
                np.testing.assert_array_equal(
                    batch["positions"][row][where], np.arange(16)[: where.sum()]
                )
                segments.append((batch["inputs"][row][where], batch["targets"][row][where]))
    inputs = np.concatenate([i for i, _ in segments])
    targets = np.concatenate([t for _, t in segments])
    expected = [[SOS_ID, *BYTES.encode(tail)] for tail in tails]
    np.testing.assert_array_equal(inputs, np.concatenate(expected))
    np.testing.assert_array_equal(targets, np.concatenate([[*e[1:], EOS_ID] for e in expected]))
    assert data.eval_tokens == sum(len(tail) + 1 for tail in tails) == len(targets)
    # Training: an epoch is each head whole, line breaks and blank lines kept, in pieces of 16
    # positions from its start packed next-fit in the epoch's order; its rows come shuffled.
    pieces = {}  # each head's pieces, in order
    for head in heads:
        inputs, targets = [SOS_ID, *BYTES.encode(head)], [*BYTES.encode(head), EOS_ID]
        pieces[head] = [
            (tuple(inputs[k : k + 16]), tuple(targets[k : k + 16]))
            for k in range(0, len(inputs), 16)
        ]
    epoch, filled, total = [], 0, sum(len(head) + 1 for head in heads)
    while filled < total:
        batch = next(data.train)
        for row in range(len(batch["weights"])):
            ids, segments = batch["segment_ids"][row], []
            for segment in range(1, ids.max() + 1):
                where = ids == segment
                np.testing.assert_array_equal(
                    batch["positions"][row][where], np.arange(where.sum())
                )
                inputs, targets = batch["inputs"][row][where], batch["targets"][row][where]
                segments.append((tuple(inputs.tolist()), tuple(targets.tolist())))
            if filled < total:  # the rest is the next epoch's
                epoch.append(tuple(segments))
                filled += int(batch["weights"][row].sum())
    assert filled == total  # the epoch ends at a row's end
    cut_orders = []  # the rows of each order of the two heads, as cut
    for order in (heads, heads[::-1]):
        rows, row, fill = [], [], 0
        for piece in (piece for head in order for piece in pieces[head]):
            if fill + len(piece[0]) > 16:
                rows.append(tuple(row))
                row, fill = [], 0
            row.append(piece)
            fill += len(piece[0])
        cut_orders.append([*rows, tuple(row)])
    assert sorted(epoch) in [sorted(rows) for rows in cut_orders]
    assert epoch not in cut_orders  # shuffled: not in the order the rows were cut


# --- tokenizers ------------------------------------------------------------------------------


def test_fitted_tokenizer_is_saved_once_and_reloaded(tmp_path):
    first_text, second_text = tmp_path / "a.txt", tmp_path / "b.txt"
    first_text.write_text("abc\nbcd\ncab\ndab\n" * 3)
    second_text.write_text("xyz\nzzz\n" * 5)
    first = build(text_cfg(first_text, tokenizer="char"), tmp_path)
    assert (tmp_path / "tokenizer" / "vocab.json").is_file()
    second = build(text_cfg(second_text, tokenizer="char"), tmp_path)
    assert second.tokenizer.itos == first.tokenizer.itos
    assert second.tokenizer.encode("xyz") == [UNK_ID] * 3
    with pytest.raises(ValueError, match="holds a saved 'char' tokenizer"):
        build(text_cfg(first_text, tokenizer="word"), tmp_path)
    elsewhere = tmp_path / "process_1"  # only process 0 writes the tokenizer files
    build(
        text_cfg(first_text, tokenizer="char"),
        tmp_path,
        directory=elsewhere,
        process_count=2,
        process_index=1,
    )
    assert not elsewhere.exists()


def test_bpe_is_trained_on_jsonl_text_and_saved(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"body": line}) + "\n" for line in LINES))
    cfg = DataConfig(
        packing=False, source="jsonl", path=str(path), field="body", tokenizer="bpe", vocab_size=300
    )
    data = build(cfg, tmp_path, batch_size=3)
    assert (tmp_path / "tokenizer" / "tokenizer.json").is_file()
    assert 260 < data.vocab_size <= 300
    batch = next(data.train)
    texts = lm_texts(data.tokenizer, batch)
    assert len(texts) == 3 and set(texts) <= set(LINES)


def test_packing_by_default_for_language_modelling_only(tmp_path):
    lm = build_data(DataConfig(), task=TASKS["lm"], seed=0, batch_size=4, directory=tmp_path / "a")
    assert "segment_ids" in next(lm.train)
    seq2seq = build_data(
        DataConfig(generator="number_words"),
        task=TASKS["seq2seq"],
        seed=0,
        batch_size=4,
        directory=tmp_path / "b",
    )
    assert "segment_ids" not in next(seq2seq.train)


@pytest.mark.parametrize(
    "task, generator, packing",
    [
        ("lm", "arithmetic", None),
        ("lm", "arithmetic", False),
        ("seq2seq", "number_words", None),
        ("mlm", "sentiment", None),
        ("classify", "sentiment", None),
    ],
)
def test_batches_are_as_the_tasks_description_says(tmp_path, task, generator, packing):
    cfg = DataConfig(generator=generator, packing=packing, seq_len=24, train_size=16, eval_size=6)
    data = build(cfg, tmp_path, task=task)
    described = tasks.task_named(task)
    wanted = described.batch_shapes(packed=described.is_packed(packing), batch_size=4, seq_len=24)
    for batch in (next(data.train), next(data.eval_batches())):
        assert {key: (value.shape, value.dtype) for key, value in batch.items()} == wanted
