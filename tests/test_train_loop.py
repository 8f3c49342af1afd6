"""The training loop's schedule: the next batch is taken and placed while a step runs, a step's
results are read only when due (its finite flag one step late), and the lag changes nothing a
run records: no checkpoint of a non-finite step, the data state of the step saved, signals."""

import json
import os
import pathlib
import signal
import threading

import jax
import numpy as np
import pytest

from flaxformer_lite.train import loop
from flaxformer_lite.train.checkpoint import Checkpointer
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.loop import Interrupted, TrainingError, run

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

QUICK = [
    "train.batch_size=8",
    "data.seq_len=32",
    "optimizer.warmup_steps=0",
    "optimizer.schedule=constant",
    "train.eval_batches=1",
    "data.eval_size=8",
    "train.decode_examples=0",
]


def config(run_dir, *overrides):
    return load_config(None, [f"run_dir={run_dir}", *QUICK, *overrides])


def quiet(_message):
    pass


class _Value:
    """A metric that records when the host reads it (``bool`` / ``float`` wait for the step)."""

    def __init__(self, value, step, key, events):
        self._value, self._step, self._key, self._events = value, step, key, events

    def _read(self):
        self._events.append(("read", self._step, self._key))
        return self._value

    def __bool__(self):
        return bool(self._read())

    def __float__(self):
        return float(self._read())


class _Iterator:
    """The training iterator, recording each batch taken and the state after it."""

    def __init__(self, inner, events, states):
        self._inner, self._events, self._states = inner, events, states

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self._inner)
        self._events.append(("next",))
        self._states.append(self._inner.get_state())
        return batch

    def get_state(self):
        return self._inner.get_state()

    def set_state(self, state):
        self._inner.set_state(state)

    def place_with(self, place):
        self._inner.place_with(place)

    def close(self):
        self._inner.close()


class _Data:
    def __init__(self, data, events, states):
        self._data = data
        self.train = _Iterator(data.train, events, states)

    def __getattr__(self, name):
        return getattr(self._data, name)


@pytest.fixture
def recorded(monkeypatch):
    """Runs the loop with the steps and batches recorded: ``events`` (``("next",)``,
    ``("dispatch", s)``, ``("read", s, key)`` in order), ``states`` (the iterator state after
    each batch; index 0 is the state of the first batch of the run), ``placed_on``
    (the thread of each batch put on the devices), and ``nonfinite`` (steps
    whose ``finite`` flag the fake reports False, the real update having happened)."""
    record = type("Record", (), {})()
    record.events, record.states, record.nonfinite, record.signal_at = [], [], set(), None
    record.placed_on = []
    build_data, make_train_step = loop.DataPlan.build, loop.configured_train_step
    put_batch = loop.parallel.put_batch

    def recording_put_batch(*args, **kwargs):
        record.placed_on.append(threading.current_thread().name)
        return put_batch(*args, **kwargs)

    def recording_data(plan):
        return _Data(build_data(plan), record.events, record.states)

    def recording_step(*args, **kwargs):
        step_fn = make_train_step(*args, **kwargs)
        calls = {"n": 0}

        def step(state, batch, numbers, active):
            state, metrics, active = step_fn(state, batch, numbers, active)
            calls["n"] += 1
            # Steps counted from the run's first step (a resumed run starts at its checkpoint).
            at = calls["n"] + record.start
            record.events.append(("dispatch", at))
            if at in record.nonfinite:
                metrics = dict(metrics, finite=False, loss=float("nan"))
            if at == record.signal_at:
                os.kill(os.getpid(), signal.SIGTERM)
            return state, {k: _Value(v, at, k, record.events) for k, v in metrics.items()}, active

        return step

    monkeypatch.setattr(loop.parallel, "put_batch", recording_put_batch)
    monkeypatch.setattr(loop.DataPlan, "build", recording_data)
    monkeypatch.setattr(loop, "configured_train_step", recording_step)
    record.start = 0
    return record


def first(events, event):
    return next(i for i, e in enumerate(events) if e[: len(event)] == event)


def test_the_next_batch_is_placed_before_a_step_is_read_and_flags_are_read_one_step_late(
    tmp_path, recorded
):
    run(
        config(tmp_path / "run", "train.steps=8", "train.log_every=4", "train.eval_every=100"),
        progress=False,
        log=quiet,
    )
    events = recorded.events
    nexts = [i for i, e in enumerate(events) if e == ("next",)]
    assert len(nexts) == 8  # one per step: none fetched past the last step
    for step in range(1, 8):
        # Batch step + 1 is taken (and placed) before anything of step `step` is read.
        assert nexts[step] < first(events, ("read", step)), (step, events)
    due = {1, 4, 8}  # compiled, logged, logged + evaluated + saved
    for step in range(1, 9):
        read = first(events, ("read", step, "finite"))
        if step in due:
            assert read < first(events + [("dispatch", 9)], ("dispatch", step + 1))
        else:  # read once the next step is dispatched
            assert first(events, ("dispatch", step + 1)) < read
    assert {e[2] for e in events if e[0] == "read" and e[1] not in due} == {"finite"}
    # Every training batch is placed by the data's prefetch thread (the evaluation's elsewhere).
    assert recorded.placed_on.count("flaxformer-lite-prefetch") >= 8


def checkpoint_data_state(run_dir, step):
    """The data-iterator state stored with checkpoint ``step`` (Orbax's JSON item file)."""
    path = pathlib.Path(run_dir) / "checkpoints" / str(step) / "data_state" / "metadata"
    return json.loads(path.read_text())


def test_a_checkpoint_holds_the_data_state_of_its_own_step(tmp_path, recorded):
    run_dir = tmp_path / "run"
    run(
        config(run_dir, "train.steps=7", "checkpoint.every=3", "train.log_every=100"),
        progress=False,
        log=quiet,
    )
    for step in (3, 6, 7):
        assert checkpoint_data_state(run_dir, step) == recorded.states[step - 1], step


def _run_threads():
    """The threads a run starts: the data's prefetch, the background compile, the plots'."""
    names = ("flaxformer-lite-prefetch", "background-compile", "plots")
    return [t for t in threading.enumerate() if t.name.startswith(names)]


def test_the_run_s_threads_end_with_the_run(tmp_path):
    before = _run_threads()
    run(config(tmp_path / "run", "train.steps=2"), progress=False, log=quiet)
    assert _run_threads() == before


def test_a_step_found_non_finite_one_step_late_is_never_checkpointed(tmp_path, recorded):
    """Step 5 is not due (no log, eval or save), so its flag is read only after step 6 is
    dispatched; step 6 would be saved: the run must stop first."""
    run_dir = tmp_path / "run"
    recorded.nonfinite = {5}
    due = ["checkpoint.every=2", "train.log_every=100", "train.eval_every=100"]
    cfg = config(run_dir, "train.steps=10", *due)
    threads = _run_threads()
    with pytest.raises(TrainingError, match="^step 5: .*last good checkpoint: step 4$"):
        run(cfg, progress=False, log=quiet)
    assert _run_threads() == threads  # a run that fails leaves none of its threads behind
    assert first(recorded.events, ("dispatch", 6)) < first(recorded.events, ("read", 5, "finite"))
    with Checkpointer(run_dir / "checkpoints", keep=10) as checkpointer:
        assert checkpointer.all_steps() == [2, 4]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["step"] < 5 for r in records)


def test_a_due_non_finite_step_is_checked_before_it_is_saved(tmp_path, recorded):
    run_dir = tmp_path / "run"
    recorded.nonfinite = {4}
    cfg = config(run_dir, "train.steps=10", "checkpoint.every=2", "train.log_every=100")
    with pytest.raises(TrainingError, match="^step 4: .*last good checkpoint: step 2$"):
        run(cfg, progress=False, log=quiet)
    assert ("dispatch", 5) not in recorded.events  # stopped as soon as step 4 was read
    with Checkpointer(run_dir / "checkpoints", keep=10) as checkpointer:
        assert checkpointer.all_steps() == [2]


def test_skip_nonfinite_logs_the_step_found_late_and_goes_on(tmp_path, recorded):
    recorded.nonfinite = {3, 6}
    messages = []
    cfg = config(
        tmp_path / "run",
        "train.steps=8",
        "train.log_every=6",
        "train.eval_every=100",
        "train.skip_nonfinite=true",
    )
    run(cfg, progress=False, log=messages.append)
    skipped = [m.split(":")[0] for m in messages if "not finite" in m]
    assert skipped == ["step 3", "step 6"]


def test_a_signal_between_checkpoints_saves_that_step_and_resumes_bit_exactly(tmp_path, recorded):
    """SIGTERM during step 5 (batch 6 already taken): the checkpoint of step 5 holds the data
    state after batch 5, so the resumed run sees batches 6, 7, 8 and logs the same losses as a
    run never stopped."""
    every_step = ["train.log_every=1", "train.eval_every=100", "checkpoint.every=100"]
    run(config(tmp_path / "straight", "train.steps=8", *every_step), progress=False, log=quiet)
    recorded.states.clear()
    recorded.signal_at = 5
    stopped = config(tmp_path / "stopped", "train.steps=8", *every_step)
    with pytest.raises(Interrupted) as raised:
        run(stopped, progress=False, log=quiet)
    assert (raised.value.signum, raised.value.step) == (signal.SIGTERM, 5)
    assert len(recorded.states) == 6  # batch 6 was taken before the signal was seen
    assert checkpoint_data_state(tmp_path / "stopped", 5) == recorded.states[4]
    recorded.signal_at, recorded.start = None, 5
    run(stopped, progress=False, log=quiet)

    def logged(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}

    assert logged("stopped") == logged("straight")
    assert sorted(logged("straight")) == list(range(1, 9))


def test_put_batch_places_every_array_with_the_batch_sharding():
    from flaxformer_lite import parallel

    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    batch = {"inputs": np.arange(8).reshape(4, 2), "labels": np.arange(4, dtype=np.int32)}
    placed = parallel.put_batch(batch, sharding, 4)
    for key, value in batch.items():
        assert placed[key].sharding == sharding
        np.testing.assert_array_equal(np.asarray(placed[key]), value)
