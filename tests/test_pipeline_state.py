"""The pipeline's batches as a pure function of (seed, batch): the same seed gives the same
batches, a saved state the next batch, another pipeline's state is refused, and process shards
split each global batch (and its evaluation) whatever their number."""

import json

import numpy as np
import pytest
from pipeline_cases import assert_batches_equal, build, take, text_cfg, write_corpus


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path)


ROWS = [("lm", False), ("lm", True), ("lm", "windows"), ("mlm", False)]


@pytest.mark.parametrize("task, packing", ROWS)
def test_same_seed_same_batches_other_seed_other_batches(corpus, tmp_path, task, packing):
    cfg = text_cfg(corpus, seq_len=48, packing=packing)
    first = take(build(cfg, tmp_path, task=task).train, 3)
    assert_batches_equal(take(build(cfg, tmp_path, task=task).train, 3), first)
    other = take(build(cfg, tmp_path, task=task, seed=1).train, 3)
    assert any((a["inputs"] != b["inputs"]).any() for a, b in zip(first, other, strict=True))


@pytest.mark.parametrize("task, packing", ROWS)
def test_resume_from_saved_state_gives_the_next_batch(corpus, tmp_path, task, packing):
    cfg = text_cfg(corpus, seq_len=48, packing=packing)
    expected = take(build(cfg, tmp_path, task=task).train, 10)
    for consumed in (2, 6):  # an epoch is 27 examples: batch 7 straddles the boundary
        interrupted = build(cfg, tmp_path, task=task)
        take(interrupted.train, consumed)
        state = json.loads(json.dumps(interrupted.train.get_state()))
        resumed = build(cfg, tmp_path, task=task)
        resumed.train.set_state(state)
        assert_batches_equal(take(resumed.train, 3), expected[consumed : consumed + 3])


def test_a_state_from_another_pipeline_is_refused(corpus, tmp_path):
    packed = build(text_cfg(corpus, packing=True), tmp_path)
    next(packed.train)
    state = packed.train.get_state()
    for other in (
        build(text_cfg(corpus), tmp_path),
        build(text_cfg(corpus, packing="windows"), tmp_path),
        build(text_cfg(corpus, packing=True), tmp_path, seed=1),
        build(text_cfg(corpus, packing=True, train_size=20), tmp_path),
    ):
        with pytest.raises(ValueError, match="another pipeline"):
            other.train.set_state(state)


@pytest.mark.parametrize("packing", [False, True, "windows"])
def test_process_shards_split_each_global_batch(corpus, tmp_path, packing):
    cfg = text_cfg(corpus, seq_len=48, packing=packing, validation_fraction=0.3)
    single = build(cfg, tmp_path)
    shards = [build(cfg, tmp_path, process_index=i, process_count=2) for i in range(2)]
    for whole in take(single.train, 8):
        parts = [next(shard.train) for shard in shards]
        assert parts[0]["inputs"].shape == (2, 48)
        for key, value in whole.items():
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), value)
    state = single.train.get_state()
    assert [shard.train.get_state() for shard in shards] == [state, state]
    # The state counts global batches, so a run may resume on another number of processes.
    resumed = build(cfg, tmp_path, process_index=1, process_count=2)
    resumed.train.set_state(state)
    np.testing.assert_array_equal(next(resumed.train)["inputs"], next(single.train)["inputs"][2:])
    whole_eval = list(single.eval_batches())
    shard_eval = [list(shard.eval_batches()) for shard in shards]
    for whole, *parts in zip(whole_eval, *shard_eval, strict=True):
        np.testing.assert_array_equal(np.concatenate([p["inputs"] for p in parts]), whole["inputs"])
