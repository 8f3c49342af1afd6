"""Drawing keys from an ``nnx.Rngs`` stream, as the stream itself would, at a cost that does not
grow with what a trace already holds.

A stream's own call updates its counter as ``count[...] += 1``, and flax then compares the new
and old counts' ``getattr(x, "sharding", None)``: on a tracer that raises an AttributeError whose
message JAX builds by walking every equation traced so far, so building a model under ``jax.jit``
or ``nnx.eval_shape``, and tracing its training step (a dropout key per layer), took time
quadratic in its depth. Replacing the counter whole skips the probe.
"""

from __future__ import annotations

import jax
from flax import nnx


def next_key(stream: nnx.RngStream) -> jax.Array:
    """``stream()``: the stream's key folded with its count, which then goes up by one."""
    count = stream.count.get_value()
    stream.count.set_raw_value(count + 1)
    return jax.random.fold_in(stream.key.get_value(), count)


def fork(stream: nnx.RngStream) -> nnx.RngStream:
    """``stream.fork()``: a new stream keyed by :func:`next_key`."""
    return nnx.RngStream(next_key(stream), tag=stream.tag)


def dropout(rate: float, rngs: nnx.Rngs) -> nnx.Dropout:
    """``nnx.Dropout(rate, rngs=rngs)``: its stream forked from ``rngs["dropout"]`` by
    :func:`fork`."""
    layer = nnx.Dropout(rate)
    layer.rngs = fork(rngs["dropout"])
    return layer


def apply_dropout(layer: nnx.Dropout, x: jax.Array) -> jax.Array:
    """``layer(x)``, its key drawn by :func:`next_key` where the layer draws one (a rate
    strictly between 0 and 1, not deterministic)."""
    if layer.rate in (0.0, 1.0) or layer.deterministic:
        return layer(x)
    return layer(x, rngs=next_key(layer.rngs))
