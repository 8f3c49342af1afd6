"""flaxformer_lite.nn.rngs draws the keys the streams' own calls would, and building or running a
model under a trace draws them without probing a tracer's ``sharding``."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_models import SMALL, tokens

from flaxformer_lite.models import EncoderDecoder, ModelConfig, abstract_model, build_model
from flaxformer_lite.nn import attention, dense, rngs

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

# Every kind of model and every place a key is drawn: dropout on (the attention's and the
# Dropout layers' streams), a parallel block, a classifier.
DROPOUT = dict(embedding_dropout=0.1, attention_dropout=0.1, residual_dropout=0.1)
MODELS = {
    "decoder, parallel block": ("gpt2-tiny", {"parallel_block": True}),
    "encoder, pre-norm classifier": ("bert-tiny", {"num_classes": 3, "norm_position": "pre"}),
    "encoder-decoder, post-norm": ("transformer-tiny", {}),
}


def _config(name, **overrides) -> ModelConfig:
    preset, options = MODELS[name]
    return ModelConfig.from_preset(preset, **DROPOUT, **options, **overrides)


def _values(tree) -> list[np.ndarray]:
    """The leaves of ``tree`` as NumPy arrays, keys as their data."""
    return [
        np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
        for x in jax.tree.leaves(tree)
    ]


def _assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(_values(a), _values(b), strict=True):
        np.testing.assert_array_equal(x, y)


def _forward(model, x):
    return model(x, x) if isinstance(model, EncoderDecoder) else model(x)


def test_next_key_and_fork_draw_what_the_stream_would():
    ours, flax_own = nnx.Rngs(params=3), nnx.Rngs(params=3)
    for _ in range(3):
        _assert_same(rngs.next_key(ours.params), flax_own.params())
    _assert_same(rngs.fork(ours.params), flax_own.params.fork())
    _assert_same(nnx.state(ours), nnx.state(flax_own))


def test_dropout_is_flax_dropout_with_the_same_stream():
    ours = rngs.dropout(0.25, nnx.Rngs(params=0, dropout=5), "residual")
    flax_own = nnx.Dropout(0.25, rngs=nnx.Rngs(params=0, dropout=5))
    assert type(ours) is nnx.Dropout and ours.kind == "residual"
    _assert_same(nnx.state(ours), nnx.state(flax_own))
    x = jnp.ones((4, 8))
    _assert_same(rngs.apply_dropout(ours, x), flax_own(x))
    # Without a dropout stream, both fall back to the default one.
    _assert_same(
        nnx.state(rngs.dropout(0.25, nnx.Rngs(7), "embedding")),
        nnx.state(nnx.Dropout(0.25, rngs=nnx.Rngs(7))),
    )


@pytest.mark.parametrize("rate", [0.1, 0.25])
def test_a_rate_given_as_a_number_drops_as_flax_dropout_at_that_rate(rate):
    """Inside ``dropout_rates`` a layer of the kind drops at the given rate, an array (traced in
    a step), with the same key and mask as ``nnx.Dropout`` at that rate; other kinds keep their
    own."""
    x = jnp.arange(64, dtype=jnp.float32).reshape(8, 8) + 1.0
    ours = rngs.dropout(0.5, nnx.Rngs(dropout=3), "residual")
    other = rngs.dropout(0.5, nnx.Rngs(dropout=3), "embedding")
    flax_own = nnx.Dropout(rate, rngs=nnx.Rngs(dropout=3))

    def dropped(rate):
        with rngs.dropout_rates({"residual": rate}):
            return rngs.apply_dropout(ours, x), rngs.apply_dropout(other, x)

    residual, embedding = dropped(jnp.float32(rate))
    _assert_same(residual, flax_own(x))
    _assert_same(embedding, nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))(x))


@pytest.mark.parametrize("rate", [0.0, 0.25, 1.0])
@pytest.mark.parametrize("deterministic", [False, True])
def test_apply_dropout_is_the_layers_own_call(rate, deterministic):
    """The same output and the same stream after it: a key is drawn exactly where the layer
    would draw one."""
    x = jnp.ones((4, 8))
    ours, flax_own = (
        nnx.Dropout(rate, deterministic=deterministic, rngs=nnx.Rngs(5)) for _ in "ab"
    )
    _assert_same(rngs.apply_dropout(ours, x), flax_own(x))
    _assert_same(nnx.state(ours), nnx.state(flax_own))


def _build_and_train(cfg):
    """The state of a new model after a forward pass in training mode, and its output."""
    model = build_model(cfg, rngs=nnx.Rngs(params=0, dropout=1))
    model.train()
    out = _forward(model, tokens((2, 8)))
    return nnx.state(model), out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_model_initializes_and_trains_as_with_the_streams_own_draws(name, monkeypatch):
    """Every parameter, dropout stream and dropout mask, bit for bit, as when each key came from
    the stream's own call (``stream()``, ``stream.fork()``, ``nnx.Dropout.__call__``)."""
    cfg = _config(name, **SMALL)
    ours = _build_and_train(cfg)
    for module in (rngs, dense, attention):
        monkeypatch.setattr(module, "next_key", lambda stream: stream())
    _assert_same(ours, _build_and_train(cfg))


def test_building_and_training_a_model_under_a_trace_probe_no_tracer_sharding(monkeypatch):
    """A tracer's ``sharding`` raises an AttributeError whose message JAX builds by walking every
    equation traced so far: probed once per key drawn, it made building a model under
    ``jax.jit`` or ``nnx.eval_shape``, and tracing its training step, quadratic in its depth."""
    probed = []
    sharding = jax.core.Tracer.sharding

    def counted(tracer):
        probed.append(tracer.aval)
        return sharding.fget(tracer)

    monkeypatch.setattr(jax.core.Tracer, "sharding", property(counted))
    for name in MODELS:
        abstract_model(_config(name))
        jax.eval_shape(functools.partial(_build_and_train, _config(name, **SMALL)))
    assert not probed
