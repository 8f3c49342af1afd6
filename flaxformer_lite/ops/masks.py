"""Boolean attention masks.

Convention (shared with ``jax.nn.dot_product_attention``): ``True`` means *may attend*. Every
constructor returns a rank-4 boolean array broadcastable to ``[B, H, T, S]``, so masks combine
with ``&`` (or :func:`combine_masks`) and pass straight to ``dot_product_attention``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.choices import check_global_tokens, check_local_window


def causal_mask(
    q_len: int,
    kv_len: int | None = None,
    offset: int | jax.Array | None = None,
    *,
    positions: jax.Array | None = None,
) -> jax.Array:
    """Mask that lets query ``i`` see keys ``j <= i + offset``.

    Query ``i`` sits at absolute position ``offset + i`` and key ``j`` at position ``j``. With
    ``offset = kv_len - q_len`` the last query lines up with the last key, which is what decoding
    against a KV cache needs (``dot_product_attention(is_causal=True)`` does exactly that).

    Args:
      q_len: number of queries T.
      kv_len: number of keys S; defaults to ``q_len``.
      offset: position of the first query, a Python int, a scalar array or a ``[B]`` array
        (one cache index per batch row); 0 when not given. May be traced.
      positions: int ``[T]``, each query's own position in place of ``offset + i`` (the
        queries of a sequence split over devices, see
        :mod:`flaxformer_lite.nn.context_parallel`); not together with ``offset``.

    Returns:
      bool ``[1, 1, T, S]``, or ``[B, 1, T, S]`` for a per-row ``offset``.
    """
    kv_len = q_len if kv_len is None else kv_len
    q_pos = _query_positions(q_len, offset, positions)
    k_pos = jnp.arange(kv_len)[None, :]
    return k_pos <= q_pos


def local_window_mask(
    q_len: int,
    kv_len: int | None = None,
    window: tuple[int, int] = (0, 0),
    offset: int | jax.Array | None = None,
    *,
    positions: jax.Array | None = None,
) -> jax.Array:
    """Sliding-window mask: query at position ``p`` sees keys in ``[p - left, p + right]``.

    Positions follow :func:`causal_mask`: query ``i`` is at ``offset + i``, key ``j`` at ``j``.
    ``window=(left, 0)`` combined with causality is Mistral/Longformer-style local attention.

    Args:
      q_len: number of queries T.
      kv_len: number of keys S; defaults to ``q_len``.
      window: ``(left, right)`` non-negative ints, how far each query looks back and ahead.
      offset: position of the first query (int, scalar or ``[B]`` array), as for
        :func:`causal_mask`.
      positions: int ``[T]``, each query's position, as for :func:`causal_mask`.

    Returns:
      bool ``[1, 1, T, S]`` (``[B, 1, T, S]`` for a per-row ``offset``).
    """
    left, right = check_local_window(window)
    kv_len = q_len if kv_len is None else kv_len
    q_pos = _query_positions(q_len, offset, positions)
    k_pos = jnp.arange(kv_len)[None, :]
    return (k_pos >= q_pos - left) & (k_pos <= q_pos + right)


def global_tokens_mask(
    q_len: int,
    kv_len: int | None = None,
    global_tokens: int = 0,
    offset: int | jax.Array | None = None,
    *,
    positions: jax.Array | None = None,
) -> jax.Array:
    """Longformer/BigBird global tokens: the first ``global_tokens`` positions see every key and
    are seen by every query.

    Positions follow :func:`causal_mask`. Meant to be OR-ed with a :func:`local_window_mask`
    (and the result AND-ed with a causal mask, which global tokens do not lift).

    Args:
      q_len: number of queries T.
      kv_len: number of keys S; defaults to ``q_len``.
      global_tokens: G, a non-negative int.
      offset: position of the first query (int, scalar or ``[B]`` array), as for
        :func:`causal_mask`.
      positions: int ``[T]``, each query's position, as for :func:`causal_mask`.

    Returns:
      bool ``[1, 1, T, S]`` (``[B, 1, T, S]`` for a per-row ``offset``).
    """
    global_tokens = check_global_tokens(global_tokens)
    kv_len = q_len if kv_len is None else kv_len
    q_pos = _query_positions(q_len, offset, positions)
    k_pos = jnp.arange(kv_len)[None, :]
    return (k_pos < global_tokens) | (q_pos < global_tokens)


def padding_mask(
    q_valid: jax.Array,
    kv_valid: jax.Array | None = None,
    *,
    q_len: int | None = None,
    kv_len: int | None = None,
) -> jax.Array:
    """Mask that keeps only real (non-padding) queries and keys.

    Args:
      q_valid: bool ``[B, T]`` (True = real token) or int ``[B]`` lengths (then ``q_len`` is
        required; the first ``length`` positions are real).
      kv_valid: the same for keys, ``[B, S]`` or ``[B]``; defaults to ``q_valid``
        (self-attention).
      q_len: T, required when ``q_valid`` holds lengths.
      kv_len: S, required when ``kv_valid`` holds lengths (defaults to ``q_len`` for
        self-attention).

    Returns:
      bool ``[B, 1, T, S]``: True where both the query and the key are real. Padded query rows
      are fully masked, so attention returns zeros there.
    """
    if kv_valid is None:
        kv_valid, kv_len = q_valid, q_len if kv_len is None else kv_len
    q = _as_valid(q_valid, q_len, "q_valid", "q_len")
    k = _as_valid(kv_valid, kv_len, "kv_valid", "kv_len")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"padding_mask batch sizes differ: q_valid {q.shape}, kv_valid {k.shape}")
    return q[:, None, :, None] & k[:, None, None, :]


def segment_mask(q_segment_ids: jax.Array, kv_segment_ids: jax.Array | None = None) -> jax.Array:
    """Mask for packed sequences: a query sees only keys of its own segment.

    Segment ids are compared for equality only; combine with :func:`padding_mask` (or the
    ``segment_ids != 0`` convention of your data pipeline) to also drop padding.

    Args:
      q_segment_ids: int ``[B, T]``.
      kv_segment_ids: int ``[B, S]``; defaults to ``q_segment_ids``.

    Returns:
      bool ``[B, 1, T, S]``.
    """
    kv_segment_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids
    q, k = jnp.asarray(q_segment_ids), jnp.asarray(kv_segment_ids)
    if q.ndim != 2 or k.ndim != 2 or q.shape[0] != k.shape[0]:
        raise ValueError(
            f"segment ids must be [batch, length] with equal batch, got {q.shape} and {k.shape}"
        )
    return q[:, None, :, None] == k[:, None, None, :]


def combine_masks(*masks: jax.Array | None) -> jax.Array | None:
    """Logical AND of masks, skipping ``None``; returns ``None`` when all are ``None``.

    Raises:
      ValueError: if a mask is not boolean or the shapes do not broadcast together.
    """
    present = [jnp.asarray(m) for m in masks if m is not None]
    if not present:
        return None
    for m in present:
        if m.dtype != jnp.bool_:
            raise ValueError(f"masks must be boolean (True = may attend), got dtype {m.dtype}")
    try:
        np.broadcast_shapes(*(m.shape for m in present))
    except ValueError:
        shapes = ", ".join(str(m.shape) for m in present)
        raise ValueError(f"masks do not broadcast together: {shapes}") from None
    combined = present[0]
    for m in present[1:]:
        combined = combined & m
    return combined


def _query_positions(q_len, offset, positions):
    """The queries' positions as a column: ``[1, 1, T, 1]``, or ``[B, 1, T, 1]`` for a per-row
    offset; ``positions`` (``[T]``) when given, else ``offset + i`` (``offset`` ``None``: 0).

    Raises:
      ValueError: both ``offset`` and ``positions`` given, or either of the wrong shape.
    """
    if positions is not None:
        # Positions are absolute: an offset beside them would be silently dropped or, added,
        # shift them a second time.
        if offset is not None:
            raise ValueError(
                "mask offset and positions are both given: give the first query's offset or "
                "each query's positions, not both"
            )
        positions = jnp.asarray(positions)
        if positions.shape != (q_len,):
            raise ValueError(f"mask positions must be [{q_len}], got shape {positions.shape}")
        return positions.reshape(1, 1, q_len, 1)
    offset = jnp.asarray(0 if offset is None else offset)
    if offset.ndim > 1:
        raise ValueError(f"mask offset must be a scalar or [batch], got shape {offset.shape}")
    return jnp.arange(q_len)[:, None] + offset.reshape(-1, 1, 1, 1)


def _as_valid(valid, length, name, length_name):
    """``[B, T]`` bool validity from bools or from ``[B]`` lengths."""
    valid = jnp.asarray(valid)
    if valid.dtype == jnp.bool_:
        if valid.ndim != 2:
            raise ValueError(f"{name} as booleans must be [batch, length], got {valid.shape}")
        if length is not None and length != valid.shape[1]:
            raise ValueError(f"{length_name}={length} contradicts {name} of shape {valid.shape}")
        return valid
    if valid.ndim != 1 or not jnp.issubdtype(valid.dtype, jnp.integer):
        raise ValueError(
            f"{name} must be bool [batch, length] or int lengths [batch], "
            f"got {valid.dtype}{list(valid.shape)}"
        )
    if length is None:
        raise ValueError(f"{length_name} is required when {name} holds lengths")
    return jnp.arange(length)[None, :] < valid[:, None]
