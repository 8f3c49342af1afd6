"""Choosing the next token from logits: greedy, temperature, top-k and nucleus (top-p) sampling.

The order follows Hugging Face's logits processors: divide by the temperature, keep the ``top_k``
largest, then keep the smallest set of tokens whose probability reaches ``top_p``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_sampling(temperature: float, top_k: int | None, top_p: float | None, rng) -> None:
    """Raises ``ValueError`` naming the argument that is out of range."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature > 0 and rng is None:
        raise ValueError("sampling (temperature > 0) needs rng=jax.random.key(...)")


def filter_logits(
    logits: jax.Array, *, top_k: int | None = None, top_p: float | None = None
) -> jax.Array:
    """``logits [..., V]`` with the tokens outside the top-k / top-p set at ``-inf``.

    ``top_p`` keeps, in order of probability, every token whose preceding tokens' probabilities
    sum to less than ``p``: the smallest set reaching ``p`` (at least one token).
    """
    logits = logits.astype(jnp.float32)
    if top_k is not None and top_k < logits.shape[-1]:
        kth_largest = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    if top_p is not None and top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
        before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = before < top_p
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
        logits = jnp.where(keep, logits, -jnp.inf)
    return logits


def next_token(
    rng,
    logits: jax.Array,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> jax.Array:
    """``logits [B, V]`` -> int32 ``[B]``: the argmax when ``temperature == 0``, else a sample
    from ``softmax(filter_logits(logits / temperature))`` drawn with ``rng``."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits.astype(jnp.float32) / temperature
    filtered = filter_logits(scaled, top_k=top_k, top_p=top_p)
    return jax.random.categorical(rng, filtered, axis=-1).astype(jnp.int32)
