"""Tiny models, their inputs, and the few jitted entry points every model call of the
``test_models_*.py`` files goes through.

Compiling is nearly all the cost of those tests, so:

* every model call goes through a few module-level functions jitted by :func:`jit_nodes`,
  which compiles with XLA's backend optimizations off (less compile time on CPU; the programs
  compute the same values);
* inputs share shapes (batch 2, length 8), and two models of one config have equal graph
  definitions, so they share a compiled program;
* parameters are drawn with the ``rbg`` PRNG, whose initializers compile faster than
  threefry's (the dropout test keeps the default ``nnx.Rngs(params=0, dropout=1)``).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from flaxformer_lite import ops
from flaxformer_lite.models import ModelConfig, build_model

VOCAB = 64
B, T = 2, 8  # the batch and length of most inputs
SMALL = dict(d_model=32, num_heads=4, d_ff=64, vocab_size=VOCAB, max_length=32)
NO_DROPOUT = dict(embedding_dropout=0.0, attention_dropout=0.0, residual_dropout=0.0)


def tiny(preset, **overrides):
    """A CPU-sized preset, dropout off unless overridden."""
    return ModelConfig.from_preset(preset, **{**SMALL, **NO_DROPOUT, **overrides})


def make(cfg, rngs=0, *, train=False):
    """``build_model(cfg)`` in eval mode; an int ``rngs`` seeds an rbg key."""
    if isinstance(rngs, int):
        rngs = nnx.Rngs(jax.random.key(rngs, impl="rbg"))
    model = build_model(cfg, rngs=rngs)
    if train:
        model.train()
    else:
        model.eval()
    return model


def tokens(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, shape), jnp.int32)


def lengths_mask(lengths, length):
    return jnp.asarray(np.arange(length)[None, :] < np.asarray(lengths)[:, None])


def perturb(x, index, seed=1):
    """``x`` with every row's entry ``index`` (axis 1) changed."""
    x = np.array(x)
    if x.dtype.kind in "iu":
        x[:, index] = (x[:, index] + 1 + np.arange(len(x))) % VOCAB
    else:
        x[:, index] += np.random.default_rng(seed).normal(size=x[:, index].shape)
    return jnp.asarray(x)


def assert_close(actual, expected, atol=1e-5, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), atol=atol, rtol=rtol)


def max_diff(a, b, axis=None):
    return np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max(axis=axis)


# ------------------------------------------------------------------ jitted entry points


def jit_nodes(fn=None, *, num_nodes=1):
    """Like ``nnx.jit`` for ``fn(*nodes, *arrays)``, whose first ``num_nodes`` arguments are
    NNX objects (models, optimizers); their state updates (KV caches, rng counts, parameters)
    are written back. Compiled without XLA's backend optimizations: faster to compile."""
    if fn is None:
        return functools.partial(jit_nodes, num_nodes=num_nodes)

    @functools.partial(
        jax.jit, static_argnums=0, compiler_options={"xla_backend_optimization_level": 0}
    )
    def pure(graphdef, state, args):
        nodes = nnx.merge(graphdef, state)
        out = fn(*nodes, *args)
        return out, nnx.state(nodes)

    @functools.wraps(fn)
    def call(*args):
        nodes = args[:num_nodes]
        graphdef, state = nnx.split(nodes)
        out, new_state = pure(graphdef, state, args[num_nodes:])
        nnx.update(nodes, new_state)
        return out

    return call


@jit_nodes
def lm_forward(model, inputs, positions=None, segment_ids=None, padding_mask=None):
    return model(inputs, positions=positions, segment_ids=segment_ids, padding_mask=padding_mask)


@jit_nodes
def lm_decode(model, inputs, positions=None, padding_mask=None):
    return model(inputs, positions=positions, padding_mask=padding_mask, decode=True)


@jit_nodes
def enc_forward(model, inputs, padding_mask=None):
    return model(inputs, padding_mask=padding_mask)


@jit_nodes
def enc_classify_and_encode(model, inputs, padding_mask=None):
    return (
        model.classify(inputs, padding_mask=padding_mask),
        model.encode(inputs, padding_mask=padding_mask),
    )


@jit_nodes
def ed_forward(model, src, tgt, padding_mask=None):
    return model(src, tgt, padding_mask=padding_mask)


@jit_nodes
def ed_encode(model, src, padding_mask=None):
    return model.encode(src, padding_mask=padding_mask)


@jit_nodes
def ed_decode_step(model, tgt, encoded, padding_mask=None):
    return model.decode(tgt, encoded, padding_mask=padding_mask, decode=True)


def lm_loss(model, toks):
    return ops.cross_entropy(model(toks[:, :-1]), toks[:, 1:])[0]


def lm_mse(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def ed_mse(model, src, tgt, y):
    return jnp.mean((model(src, tgt) - y) ** 2)


def train_step_for(loss_fn):
    """One optimizer step on ``loss_fn(model, *batch)``; returns the loss *before* the step."""

    @jit_nodes(num_nodes=2)
    def step(model, optimizer, *batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, *batch)
        optimizer.update(model, grads)
        return loss

    return step


lm_train_step = train_step_for(lm_loss)
MSE_STEPS = {
    "decoder": train_step_for(lm_mse),
    "encoder": train_step_for(lm_mse),
    "encoder_decoder": train_step_for(ed_mse),
}


@jit_nodes
def lm_logits_loss_and_grads(model, toks):
    def loss_fn(m):
        logits = m(toks[:, :-1])
        return ops.cross_entropy(logits, toks[:, 1:])[0], logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    return logits, loss, grads


def adam(model, lr=1e-2):
    return nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)


def check_causal(forward, inputs, positions_to_change=(2, 5)):
    """Changing input ``k`` leaves outputs ``< k`` alone and changes every output ``>= k``."""
    base = np.asarray(forward(inputs))
    for k in positions_to_change:
        changed = np.asarray(forward(perturb(inputs, k)))
        assert_close(changed[:, :k], base[:, :k], atol=1e-6, rtol=0)
        per_position = max_diff(changed[:, k:], base[:, k:], axis=(0, 2))
        assert (per_position > 1e-6).all(), f"input {k} does not reach {per_position}"
