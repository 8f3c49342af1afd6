"""Drawing keys from an ``nnx.Rngs`` stream, as the stream itself would, at a cost that does not
grow with what a trace already holds.

A stream's own call updates its counter as ``count[...] += 1``, and flax then compares the new
and old counts' ``getattr(x, "sharding", None)``: on a tracer that raises an AttributeError whose
message JAX builds by walking every equation traced so far, so building a model under ``jax.jit``
or ``nnx.eval_shape``, and tracing its training step (a dropout key per layer), took time
quadratic in its depth. Replacing the counter whole skips the probe.

A dropout layer made here has a kind (``"embedding"``, ``"residual"``); inside
:func:`dropout_rates` the layers of a kind drop at the rate given there, a traced number,
instead of their own: a train step that takes its rates as arguments (a sweep's members that
differ in them share one program).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

_RATES: contextvars.ContextVar[Mapping[str, jax.Array] | None] = contextvars.ContextVar(
    "dropout_rates", default=None
)


def next_key(stream: nnx.RngStream) -> jax.Array:
    """``stream()``: the stream's key folded with its count, which then goes up by one."""
    count = stream.count.get_value()
    stream.count.set_raw_value(count + 1)
    return jax.random.fold_in(stream.key.get_value(), count)


def fork(stream: nnx.RngStream) -> nnx.RngStream:
    """``stream.fork()``: a new stream keyed by :func:`next_key`."""
    return nnx.RngStream(next_key(stream), tag=stream.tag)


def dropout(rate: float, rngs: nnx.Rngs, kind: str) -> nnx.Dropout:
    """``nnx.Dropout(rate, rngs=rngs)`` of ``kind``: its stream forked from ``rngs["dropout"]``
    by :func:`fork`."""
    layer = nnx.Dropout(rate)
    layer.rngs = fork(rngs["dropout"])
    layer.kind = kind
    return layer


@contextlib.contextmanager
def dropout_rates(rates: Mapping[str, jax.Array]):
    """Within, the layers of each kind in ``rates`` that drop (their own rate above 0) drop at
    ``rates[kind]``, a float32 scalar (traced in a step)."""
    token = _RATES.set(rates)
    try:
        yield
    finally:
        _RATES.reset(token)


def apply_dropout(layer: nnx.Dropout, x: jax.Array) -> jax.Array:
    """``layer(x)``, its key drawn by :func:`next_key` where the layer draws one (a rate
    strictly between 0 and 1, not deterministic); at the rate of its kind inside
    :func:`dropout_rates`, by ``nnx.Dropout``'s formula."""
    if layer.rate in (0.0, 1.0) or layer.deterministic:
        return layer(x)
    rate = (_RATES.get() or {}).get(getattr(layer, "kind", None))
    if rate is None:
        return layer(x, rngs=next_key(layer.rngs))
    keep_prob = 1.0 - rate
    keep = jax.random.bernoulli(next_key(layer.rngs), p=keep_prob, shape=x.shape)
    return jax.lax.select(keep, x / keep_prob.astype(x.dtype), jnp.zeros_like(x))
