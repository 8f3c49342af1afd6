"""Choosing the next token from logits: greedy, temperature, top-k and nucleus (top-p) sampling.

The order follows Hugging Face's logits processors: divide by the temperature, keep the ``top_k``
largest, then keep the smallest set of tokens whose probability reaches ``top_p``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_sampling(
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    rng,
    min_tokens_to_keep: int = 1,
) -> None:
    """Raises ``ValueError`` naming the argument that is out of range."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if min_tokens_to_keep < 1:
        raise ValueError(f"min_tokens_to_keep must be >= 1, got {min_tokens_to_keep}")
    if temperature > 0 and rng is None:
        raise ValueError("sampling (temperature > 0) needs rng=jax.random.key(...)")


# A running sum within this of p counts as reaching it: the float32 softmax and sum round
# (log-probabilities of 0.5 and 0.3 sum to 0.79999995, which must reach p = 0.8).
TOP_P_ROUNDING = 1e-6


def filter_logits(
    logits: jax.Array,
    *,
    top_k: int | None = None,
    top_p: float | None = None,
    min_tokens_to_keep: int = 1,
) -> jax.Array:
    """``logits [..., V]`` with the tokens outside the top-k / top-p set at ``-inf``.

    ``top_k`` keeps the ``max(top_k, min_tokens_to_keep)`` largest logits (ties at the k-th all
    stay). ``top_p`` keeps the smallest set of most likely tokens whose probability reaches ``p``:
    in order of probability, every token whose more likely tokens sum to less than
    ``p - TOP_P_ROUNDING``, and at least the ``min_tokens_to_keep`` most likely. As in Hugging
    Face's ``TopPLogitsWarper``, probabilities ``[0.3, 0.1, 0.1, 0.5]`` with ``p = 0.8`` keep
    ``{0.5, 0.3}``.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    if top_k is not None and max(top_k, min_tokens_to_keep) < vocab:
        kth_largest = jax.lax.top_k(logits, max(top_k, min_tokens_to_keep))[0][..., -1:]
        logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    if top_p is not None and top_p < 1:
        order = jnp.argsort(-logits, axis=-1)
        sorted_probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
        # The exclusive running sum, summed directly: ``cumsum - p`` rounds 0.9 - 0.1 below 0.8.
        shifted = jnp.concatenate(
            [jnp.zeros_like(sorted_probs[..., :1]), sorted_probs[..., :-1]], axis=-1
        )
        before = jnp.cumsum(shifted, axis=-1)
        rank = jnp.arange(vocab)
        keep_sorted = (before < top_p - TOP_P_ROUNDING) | (rank < min_tokens_to_keep)
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
    min_tokens_to_keep: int = 1,
) -> jax.Array:
    """``logits [B, V]`` -> int32 ``[B]``: the argmax when ``temperature == 0``, else a sample
    from ``softmax(filter_logits(logits / temperature))`` drawn with ``rng``."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits.astype(jnp.float32) / temperature
    filtered = filter_logits(
        scaled, top_k=top_k, top_p=top_p, min_tokens_to_keep=min_tokens_to_keep
    )
    return jax.random.categorical(rng, filtered, axis=-1).astype(jnp.int32)
