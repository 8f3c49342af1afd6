"""Pieces of a model written as a user would, outside the library: for each extension point of
``models.pieces`` one that calls the built-in piece (the same numbers) and one variant."""

import jax
import jax.numpy as jnp
from flax import nnx

from flaxformer_lite.models import pieces
from flaxformer_lite.nn import MultiHeadAttention
from flaxformer_lite.ops.xla_attention import xla_attention


def same_as_xla(call):
    return xla_attention(call)


def _plus_one_weights(call):
    """softmax with a +1 in the denominator ("attention is off by one"): a query may attend
    to nothing. float32 [B, H, T, S]."""
    group = call.query.shape[2] // call.key.shape[2]
    key = jnp.repeat(call.key, group, axis=2)
    logits = jnp.einsum("bthd,bshd->bhts", call.query, key, preferred_element_type=jnp.float32)
    logits = logits * call.logit_scale
    if call.bias is not None:
        logits = logits + call.bias
    mask = call.dense_mask()
    if mask is not None:
        logits = jnp.where(mask, logits, -jnp.inf)
    top = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), 0.0)
    exp = jnp.exp(logits - top)
    return exp / (jnp.exp(-top) + jnp.sum(exp, axis=-1, keepdims=True))


def softmax_plus_one(call):
    weights = _plus_one_weights(call)
    value = jnp.repeat(call.value, call.query.shape[2] // call.value.shape[2], axis=2)
    out = jnp.einsum("bhts,bshd->bthd", weights.astype(value.dtype), value)
    return out.astype(call.query.dtype)


softmax_plus_one.weights = _plus_one_weights


class SameAttention(MultiHeadAttention):
    """The built-in self-attention through the ``attend`` hook."""

    def __init__(self, cfg, *, num_layers, rngs):
        super().__init__(**pieces.attention_options(cfg, num_layers=num_layers), rngs=rngs)

    def attend(self, q, k, v, bias, mask):
        return super().attend(q, k, v, bias, mask)


class TalkingHeads(MultiHeadAttention):
    """Talking-heads attention (Shazeer et al. 2020): heads mix their logits before the softmax
    and their weights after it, by learned [H, H] matrices."""

    def __init__(self, cfg, *, num_layers, rngs):
        super().__init__(**pieces.attention_options(cfg, num_layers=num_layers), rngs=rngs)
        h = cfg.num_heads
        noise = 0.1 * jax.random.normal(rngs.params(), (2, h, h))
        self.mix_logits = nnx.Param(jnp.eye(h) + noise[0])
        self.mix_weights = nnx.Param(jnp.eye(h) + noise[1])

    def weights(self, q, k, bias, mask):
        k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
        logits = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(q.shape[-1])
        if bias is not None:
            logits = logits + bias
        logits = jnp.einsum("bhts,hg->bgts", logits, self.mix_logits[...])
        dense = mask.dense(q.shape[1], k.shape[1])
        if dense is not None:
            logits = jnp.where(dense, logits, -1e9)
        weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        return jnp.einsum("bhts,hg->bgts", weights, self.mix_weights[...])

    def attend(self, q, k, v, bias, mask):
        v = jnp.repeat(v, q.shape[2] // v.shape[2], axis=2)
        weights = self.weights(q, k, bias, mask)
        return jnp.einsum("bhts,bshd->bthd", weights.astype(v.dtype), v).astype(q.dtype)


def same_relative(cfg, *, bidirectional, rngs):
    return pieces.relative_bias(cfg, bidirectional=bidirectional, rngs=rngs)


class LogDistanceBias(nnx.Module):
    """A learned ``-r_h * log(1 + |i - j|)`` per head (KERPLE's logarithmic form)."""

    def __init__(self, cfg, *, bidirectional, rngs):
        self.strength = nnx.Param(jnp.ones((cfg.num_heads,)))

    def __call__(self, q_positions, k_positions):
        distance = jnp.abs(q_positions[:, None] - k_positions[None, :]).astype(jnp.float32)
        return (-self.strength[...][:, None, None] * jnp.log1p(distance))[None]


def same_layer_norm(cfg, *, rngs):
    return pieces.layer_norm_module(cfg, rngs=rngs)


class ScaleNorm(nnx.Module):
    """``g * x / ||x||`` with one learned scalar g (Nguyen and Salazar 2019)."""

    def __init__(self, cfg, *, rngs):
        self.gain = nnx.Param(jnp.full((), cfg.d_model**0.5))

    def __call__(self, x):
        norm = jnp.linalg.norm(x.astype(jnp.float32), axis=-1, keepdims=True)
        return (self.gain[...] * x / jnp.maximum(norm, 1e-5)).astype(x.dtype)


def same_mlp(cfg, *, num_layers, rngs):
    return pieces.mlp(cfg, num_layers=num_layers, rngs=rngs)


class ReluSquared(nnx.Module):
    """An MLP with the squared ReLU of Primer (So et al. 2021)."""

    def __init__(self, cfg, *, num_layers, rngs):
        self.up = nnx.Linear(cfg.d_model, cfg.d_ff, rngs=rngs)
        self.down = nnx.Linear(cfg.d_ff, cfg.d_model, rngs=rngs)

    def __call__(self, x):
        return self.down(jnp.square(jax.nn.relu(self.up(x))))


class PickyNorm(nnx.Module):
    """A layer norm that works on 8 positions only: it passes the check on small inputs and
    fails at a run's longer rows (as ``error``, raised while traced)."""

    def __init__(self, cfg, *, rngs, error=RuntimeError):
        self.norm, self.error = pieces.layer_norm_module(cfg, rngs=rngs), error

    def __call__(self, x):
        if x.shape[1] != 8:
            raise self.error("I only work on 8 positions")
        return self.norm(x)


def picky_value_norm(cfg, *, rngs):
    return PickyNorm(cfg, rngs=rngs, error=ValueError)
