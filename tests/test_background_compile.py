"""The evaluation's programs compile on a thread of their own once the first train step is
dispatched: none of them compiles on the run's thread, and the evaluation gives the very values
it gives when it compiles them itself; ``compile_only`` compiles a decoding for a model of
shapes, and the call on the model's arrays finds it compiled."""

import json
import logging
import threading
import time

import jax
import numpy as np
import pytest
from decode_cases import make
from flax import nnx
from jax import monitoring
from tiny_runs import TINY

from flaxformer_lite.cli.train import train_main
from flaxformer_lite.decode import beam_search, seq2seq_generate
from flaxformer_lite.decode.generate import compile_only
from flaxformer_lite.train import loop
from flaxformer_lite.train.background_compile import BackgroundCompile
from flaxformer_lite.train.time_spent import TimeSpent

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

# d_ff of no other test: the decoding program is traced anew, not found in this process's caches.
_RUN = [
    "--no-progress",
    *TINY,
    "model.d_ff=72",
    "train.steps=2",
    "train.eval_every=2",
    "train.decode_examples=2",
]
_EVALUATION = ("eval_step", "_generate")


def _evaluations(run_dir) -> list[dict]:
    """The evaluations' values in ``run_dir/metrics.jsonl``, by step."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [
        {key: value for key, value in record.items() if key == "step" or key.startswith("eval_")}
        for record in map(json.loads, lines)
        if "eval_loss" in record
    ]


def test_the_evaluation_compiles_beside_the_first_steps_and_scores_the_same(tmp_path, monkeypatch):
    traced, dispatched = [], []

    def record_trace(event, start_time, end_time, **kwargs):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            traced.append((kwargs.get("fun_name"), threading.current_thread(), start_time))

    step_of = loop.configured_train_step

    def recorded_step(*args, **kwargs):
        step = step_of(*args, **kwargs)

        def dispatch(*args):
            out = step(*args)
            dispatched.append(time.time())
            return out

        return dispatch

    monkeypatch.setattr(loop, "configured_train_step", recorded_step)
    monitoring.register_event_time_span_listener(record_trace)
    try:
        assert train_main([*_RUN, f"run_dir={tmp_path / 'beside'}"]) == 0
    finally:
        monitoring.unregister_event_time_span_listener(record_trace)
    evaluation = [(name, thread, start) for name, thread, start in traced if name in _EVALUATION]
    assert sorted({name for name, _, _ in evaluation}) == sorted(_EVALUATION)
    assert all(thread is not threading.main_thread() for _, thread, _ in evaluation)
    assert min(start for _, _, start in evaluation) >= dispatched[0]

    monkeypatch.setattr(BackgroundCompile, "start", lambda self, compile_programs: None)
    assert train_main([*_RUN, f"run_dir={tmp_path / 'in_turn'}"]) == 0
    beside = _evaluations(tmp_path / "beside")
    assert beside and "eval_exact_match" in beside[0]
    assert beside == _evaluations(tmp_path / "in_turn")


def test_the_wait_is_compilation_and_a_failed_compile_is_warned_and_left_to_the_caller(caplog):
    spent = TimeSpent()
    compiling = BackgroundCompile(spent)
    compiling.wait()  # not started: nothing to wait for
    compiling.start(lambda: time.sleep(0.2))
    compiling.wait()
    assert spent.parts()["compilation"] == pytest.approx(0.2, abs=0.1)
    failing = BackgroundCompile(spent)
    with caplog.at_level(logging.WARNING, logger="flaxformer_lite.train.background_compile"):
        failing.start(lambda: 1 / 0)  # the program is compiled again where it is called
        failing.close()
    assert "did not compile in the background (ZeroDivisionError" in caplog.text


def test_compile_only_compiles_a_shaped_model_s_decoding_and_the_call_finds_it():
    model = make("transformer-tiny", d_ff=40)  # a width of its own: compiled here first
    graphdef, state = nnx.split(model)
    # Its arrays are on the default device, uncommitted: shapes with no sharding stand for them.
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    shaped = nnx.merge(graphdef, shapes)
    sources = np.array([[5, 6, 7, 2], [8, 9, 2, 0]], np.int32)
    decoders = [
        lambda m: seq2seq_generate(m, sources, max_new_tokens=3, src_lengths=[4, 3]),
        lambda m: beam_search(m, sources, max_new_tokens=3, beam_size=2)[0],
    ]
    compiled = []

    def record_compile(event, start_time, end_time, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(kwargs.get("fun_name"))

    monitoring.register_event_time_span_listener(record_compile)
    try:
        with compile_only():
            zeros = [decode(shaped) for decode in decoders]
        assert {"jit(_seq2seq_generate)", "jit(_beam_search)"} <= set(compiled)
        compiled.clear()
        tokens = [np.asarray(decode(model)) for decode in decoders]
    finally:
        monitoring.unregister_event_time_span_listener(record_compile)
    assert not [name for name in compiled if "seq2seq" in name or "beam" in name], compiled
    for zero, real in zip(zeros, tokens, strict=True):
        assert zero.shape == real.shape and zero.dtype == real.dtype and not zero.any()
