"""flaxformer_lite.nn.rngs draws the keys the streams' own calls would, and building a model
under a trace draws them without probing a tracer's ``sharding``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_models import SMALL

from flaxformer_lite.models import ModelConfig, abstract_model, build_model
from flaxformer_lite.nn import attention, dense, rngs

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

# Every kind of model, every dropout on: the attention's and the Dropout layers' forks too.
DROPOUT = dict(embedding_dropout=0.1, attention_dropout=0.1, residual_dropout=0.1)
KINDS = ("gpt2-tiny", "bert-tiny", "transformer-tiny")


def _values(tree) -> list[np.ndarray]:
    """The leaves of ``tree`` as NumPy arrays, keys as their data."""
    leaves = jax.tree.leaves(tree)
    return [
        np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
        for x in leaves
    ]


def _assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(_values(a), _values(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_next_key_and_fork_draw_what_the_stream_would():
    ours, flax_own = nnx.Rngs(params=3), nnx.Rngs(params=3)
    for _ in range(3):
        _assert_same(rngs.next_key(ours.params), flax_own.params())
    _assert_same(rngs.fork(ours.params), flax_own.params.fork())
    _assert_same(nnx.state(ours), nnx.state(flax_own))


def test_dropout_is_flax_dropout_with_the_same_stream():
    ours = rngs.dropout(0.25, nnx.Rngs(params=0, dropout=5))
    flax_own = nnx.Dropout(0.25, rngs=nnx.Rngs(params=0, dropout=5))
    assert nnx.graphdef(ours) == nnx.graphdef(flax_own)
    _assert_same(nnx.state(ours), nnx.state(flax_own))
    # Without a dropout stream, both fall back to the default one.
    _assert_same(
        nnx.state(rngs.dropout(0.25, nnx.Rngs(7))), nnx.state(nnx.Dropout(0.25, rngs=nnx.Rngs(7)))
    )


def _initial_state(cfg):
    return jax.jit(lambda: nnx.state(build_model(cfg, rngs=nnx.Rngs(params=0, dropout=1))))()


@pytest.mark.parametrize("preset", KINDS)
def test_a_model_initializes_as_with_the_streams_own_draws(preset, monkeypatch):
    """Every parameter and dropout stream, bit for bit, as when each key came from the stream's
    own call (``stream()``, ``stream.fork()``)."""
    cfg = ModelConfig.from_preset(preset, **SMALL, **DROPOUT)
    ours = _initial_state(cfg)
    monkeypatch.setattr(dense, "next_key", lambda stream: stream())
    monkeypatch.setattr(rngs, "next_key", lambda stream: stream())
    monkeypatch.setattr(attention, "fork", lambda stream: stream.fork())
    monkeypatch.setattr(rngs, "fork", lambda stream: stream.fork())
    _assert_same(ours, _initial_state(cfg))


def test_building_a_model_under_a_trace_probes_no_tracer_sharding(monkeypatch):
    """A tracer's ``sharding`` raises an AttributeError whose message JAX builds by walking every
    equation traced so far: probed once per key drawn, it made building a model under
    ``jax.jit`` or ``nnx.eval_shape`` quadratic in its size."""
    probed = []
    sharding = jax.core.Tracer.sharding

    def counted(tracer):
        probed.append(tracer.aval)
        return sharding.fget(tracer)

    monkeypatch.setattr(jax.core.Tracer, "sharding", property(counted))
    for preset in KINDS:
        abstract_model(ModelConfig.from_preset(preset, **DROPOUT))
    assert not probed
