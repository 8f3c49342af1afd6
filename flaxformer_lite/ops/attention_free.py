"""The Attention Free Transformer (Zhai et al. 2021): a per-feature weighted average of values.

``Y_t = sigmoid(Q_t) * sum_t' exp(K_t' + w_{t,t'}) * V_t' / sum_t' exp(K_t' + w_{t,t'})``, with
``Q, K, V [B, T, D]`` and a learned pairwise position bias ``w [T, T]`` (AFT-full), ``w`` kept
only within a window ``|t - t'| < s`` and 0 outside (AFT-local), or ``w = 0`` (AFT-simple).

Every variant computes in float32 and subtracts maxima before ``exp`` (as online softmax does),
so large keys give no inf or NaN. AFT-simple needs O(T * D) memory, causal or not (a scan of
running maxima and sums over chunks of positions); AFT-full and AFT-local hold ``exp(w)`` as a
``[T, S]`` matrix and compute the sums as two matmuls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# A running maximum where no key was seen yet: finite, so that differences of two such maxima
# are 0 rather than NaN, and exp(NEG - finite) underflows to 0.
_NEG = -1e30
# float32 matmuls (no TF32 / bf16 passes on GPU and TPU): the sums are the result.
_HIGHEST = jax.lax.Precision.HIGHEST


def aft(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    pairwise_bias: jax.Array | None = None,
    *,
    is_causal: bool = False,
    local_window: int | None = None,
    mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """AFT over ``query, key, value [B, T, D]``; returns ``[B, T, D]`` in the query's dtype.

    Args:
      pairwise_bias: ``w [T, T]`` (query position, key position), or ``[B, T, T]`` (one per row,
        e.g. gathered by the positions of packed rows); None is AFT-simple (w = 0).
      is_causal: position t sums over t' <= t only.
      local_window: ``s``: AFT-local, ``w`` kept where ``|t - t'| < s`` and 0 outside (those
        keys still count, with no bias). Needs ``pairwise_bias``.
      mask: bool ``[B, T]``, True at real positions: padded positions are dropped as keys. A
        position with no key to sum over yields zeros.
      segment_ids: int ``[B, T]`` of packed rows: a position sums over keys of its own segment.

    With a bias, ``exp(w)`` and ``exp(K)`` are shifted by separate maxima: per row of ``w`` and
    per feature of ``K`` (causal: per block of keys, see :func:`causal_biased_aft`). That is
    exact unless ``w`` varies by more than ~80 (the float32 range of exp) within a row (a
    block), or, in packed rows, a segment's keys all lie ~80 below other keys of the row (of
    the block).
    """
    batch, length, _ = query.shape
    if key.shape != query.shape or value.shape != query.shape:
        raise ValueError(
            f"aft expects query, key and value of one shape [B, T, D], got {query.shape}, "
            f"{key.shape} and {value.shape}"
        )
    if mask is not None and mask.shape != (batch, length):
        raise ValueError(f"aft expects a mask [B, T] = {[batch, length]}, got {mask.shape}")
    if local_window is not None:
        if pairwise_bias is None:
            raise ValueError("aft: local_window needs a pairwise_bias")
        if local_window < 1:
            raise ValueError(f"aft: local_window must be >= 1, got {local_window}")
    if segment_ids is not None and segment_ids.shape != (batch, length):
        raise ValueError(
            f"aft expects segment_ids [B, T] = {[batch, length]}, got {segment_ids.shape}"
        )
    if pairwise_bias is None:
        if is_causal:
            return causal_aft_simple(query, key, value, mask, segment_ids)
        if segment_ids is None:
            return aft_simple(query, key, value, mask)
        pairwise_bias = jnp.zeros((length, length), jnp.float32)
    if pairwise_bias.shape[-2:] != (length, length) or pairwise_bias.ndim not in (2, 3):
        raise ValueError(
            f"aft expects a pairwise_bias [T, T] or [B, T, T] with T = {length}, got "
            f"{pairwise_bias.shape}"
        )
    if local_window is not None:
        pairwise_bias = local_bias(pairwise_bias, local_window)
    allowed = jnp.ones((1, 1, 1), jnp.bool_)
    if segment_ids is not None:
        allowed = segment_ids[:, :, None] == segment_ids[:, None, :]
    if is_causal:
        return causal_biased_aft(query, key, value, pairwise_bias, allowed=allowed, key_mask=mask)
    return biased_aft(query, key, value, pairwise_bias, allowed=allowed, key_mask=mask)


def local_bias(pairwise_bias: jax.Array, window: int) -> jax.Array:
    """``w [..., T, S]`` with entries where ``|t - t'| >= window`` set to 0 (AFT-local)."""
    rows = jnp.arange(pairwise_bias.shape[-2])[:, None]
    cols = jnp.arange(pairwise_bias.shape[-1])[None, :]
    return jnp.where(jnp.abs(rows - cols) < window, pairwise_bias, 0.0)


def aft_simple(
    query: jax.Array, key: jax.Array, value: jax.Array, mask: jax.Array | None = None
) -> jax.Array:
    """Bidirectional AFT-simple: one weighted average of the values per ``[B, D]``, gated by
    ``sigmoid(Q_t)``; O(T * D) memory."""
    k, v, valid = _float32_keys(key, value, mask)
    # The maximum only keeps exp in range; it cancels in the ratio, so no gradient through it.
    top = jax.lax.stop_gradient(jnp.max(k, axis=1, keepdims=True))
    weights = jnp.where(valid, jnp.exp(k - top), 0.0)
    numerator = jnp.sum(weights * v, axis=1, keepdims=True)
    denominator = jnp.sum(weights, axis=1, keepdims=True)
    return _gate(query, numerator, denominator)


def causal_aft_simple(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Causal AFT-simple, restarted where a segment starts; O(T * D) memory (see
    :func:`aft_simple_step`)."""
    batch, _, features = query.shape
    out, _ = aft_simple_step(
        initial_aft_state(batch, features), query, key, value, mask, segment_ids
    )
    return out


def initial_aft_state(batch: int, features: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The running state ``(max, numerator, denominator)`` before any position: each
    ``[B, D]`` float32, ``(-1e30, 0, 0)``."""
    shape = (batch, features)
    return jnp.full(shape, _NEG), jnp.zeros(shape), jnp.zeros(shape)


def aft_simple_step(
    state: tuple[jax.Array, jax.Array, jax.Array],
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    *,
    chunk: int = 16,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    """Causal AFT-simple of ``T`` new positions after those that ``state`` sums up.

    ``state`` is ``(max, numerator, denominator)``, each ``[B, D]`` float32 (see
    :func:`initial_aft_state`): the running maximum of the keys seen and the sums of
    ``exp(K - max) * V`` and ``exp(K - max)``. Returns the outputs ``[B, T, D]`` and the state
    after the new positions: O(D) per token, no cache of keys or values.

    A ``lax.scan`` runs over chunks of ``chunk`` positions (one small program to compile); in a
    chunk each position's sums come from a ``[chunk, chunk]`` causal matrix per feature, shifted
    by that position's own maximum, plus the state carried in, rescaled as online softmax
    merges blocks. With ``segment_ids`` the carried state counts only for positions of the
    segment it was summed over (segments are contiguous runs).
    """
    batch, length, features = query.shape
    k, v, valid = _float32_keys(key, value, mask)
    valid = jnp.broadcast_to(valid, k.shape[:2] + (1,))
    segments = jnp.zeros((batch, length), jnp.int32) if segment_ids is None else segment_ids
    chunk = min(chunk, length)
    padded = -length % chunk
    # Padding positions are dropped keys of the last segment: the state after them is the
    # state after the last real position.
    k, v = (jnp.pad(x, ((0, 0), (0, padded), (0, 0))) for x in (k, v))
    valid = jnp.pad(valid, ((0, 0), (0, padded), (0, 0)))
    segments = jnp.pad(segments, ((0, 0), (0, padded)), mode="edge")
    num_chunks = (length + padded) // chunk

    def chunks(x):  # [B, T', ...] -> [N, B, chunk, ...]
        return jnp.moveaxis(x.reshape(batch, num_chunks, chunk, *x.shape[2:]), 1, 0)

    causal = jnp.tril(jnp.ones((chunk, chunk), jnp.bool_))

    def step(carry, xs):
        top, numerator, denominator, carried_segment = carry
        k_c, v_c, valid_c, seg_c = xs
        # [B, i, j, 1]: key j counts for position i.
        pairs = causal[None, :, :, None] & (seg_c[:, :, None] == seg_c[:, None, :])[..., None]
        pairs = pairs & valid_c[:, None, :, :]
        logits = jnp.where(pairs, k_c[:, None, :, :], _NEG)  # [B, i, j, D]
        carried = (seg_c == carried_segment[:, None])[..., None]  # [B, i, 1]
        top_in = jnp.where(carried, top[:, None], _NEG)
        row_top = jax.lax.stop_gradient(jnp.maximum(logits.max(axis=2), top_in))
        weights = jnp.where(pairs, jnp.exp(logits - row_top[:, :, None]), 0.0)
        scale = jnp.where(carried, jnp.exp(top_in - row_top), 0.0)
        row_num = jnp.einsum("bijd,bjd->bid", weights, v_c) + scale * numerator[:, None]
        row_den = weights.sum(axis=2) + scale * denominator[:, None]
        carry = (row_top[:, -1], row_num[:, -1], row_den[:, -1], seg_c[:, -1])
        return carry, (row_num, row_den)

    carry = (*(x.astype(jnp.float32) for x in state), segments[:, 0])
    xs = (chunks(k), chunks(v), chunks(valid), chunks(segments))
    # Rematerialized: the backward pass recomputes each chunk's [B, chunk, chunk, D] weights
    # rather than keeping them for all chunks, which would be chunk times the O(T * D) memory.
    (top, numerator, denominator, _), (row_num, row_den) = jax.lax.scan(
        jax.checkpoint(step), carry, xs
    )

    def unchunk(x):  # [N, B, chunk, D] -> [B, T, D]
        return jnp.moveaxis(x, 0, 1).reshape(batch, -1, features)[:, :length]

    out = _gate(query, unchunk(row_num), unchunk(row_den))
    return out, (top, numerator, denominator)


def causal_biased_aft(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    pairwise_bias: jax.Array,
    *,
    allowed: jax.Array | None = None,
    key_mask: jax.Array | None = None,
    block: int = 16,
) -> jax.Array:
    """Causal AFT with a pairwise bias ``w [T, T]`` or ``[B, T, T]``, over blocks of positions.

    A ``lax.scan`` over query blocks. Each query block takes the key blocks before it as two
    matmuls, ``exp(w - max_block(w)) @ (exp(K - max_block(K)) * V)``, each key block with its
    own maxima (every key of an earlier block is visible, so its maximum is too), merged per
    position and feature as online softmax merges blocks; its own (diagonal) block exactly, from
    a ``[block, block, D]`` array shifted by each position's own maximum. ``allowed`` bool,
    broadcastable to ``[B, T, T]``, drops more pairs (segments); ``key_mask`` ``[B, T]`` keys.
    """
    numerator, denominator, _ = causal_biased_sums(
        key, value, pairwise_bias, allowed=allowed, key_mask=key_mask, block=block
    )
    return _gate(query, numerator, denominator)


def causal_biased_sums(
    key: jax.Array,
    value: jax.Array,
    pairwise_bias: jax.Array,
    *,
    allowed: jax.Array | None = None,
    key_mask: jax.Array | None = None,
    block: int = 16,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The sums of :func:`causal_biased_aft` before the gate: ``(numerator, denominator,
    top)``, each ``[B, T, D]``, the sums scaled by ``exp(-top)``."""
    batch, length, features = key.shape
    k, v, valid = _float32_keys(key, value, key_mask)
    valid = jnp.broadcast_to(valid, (batch, length, 1))
    pairs = jnp.broadcast_to(
        jnp.tril(jnp.ones((length, length), jnp.bool_))
        & (True if allowed is None else allowed)
        & valid[:, None, :, 0],
        (batch, length, length),
    )
    w = jnp.where(pairs, jnp.broadcast_to(pairwise_bias.astype(jnp.float32), pairs.shape), _NEG)
    block = min(block, length)
    padded = -length % block
    num_blocks = (length + padded) // block
    k, v, valid = (jnp.pad(x, ((0, 0), (0, padded), (0, 0))) for x in (k, v, valid))
    k = jnp.where(valid, k, _NEG)
    pairs = jnp.pad(pairs, ((0, 0), (0, padded), (0, padded)))
    w = jnp.pad(w, ((0, 0), (0, padded), (0, padded)), constant_values=_NEG)

    def blocks(x):  # [B, T', ...] -> [B, N, block, ...]
        return x.reshape(batch, num_blocks, block, *x.shape[2:])

    k_blocks, v_blocks = blocks(k), blocks(v)
    k_top = jax.lax.stop_gradient(k_blocks.max(axis=2))  # [B, N, D]
    key_weights = jnp.where(blocks(valid), jnp.exp(k_blocks - k_top[:, :, None]), 0.0)
    weighted_values = key_weights * v_blocks

    def rows(x):  # [B, T', T'] -> [N, B, block, N, block]
        return jnp.moveaxis(x.reshape(batch, num_blocks, block, num_blocks, block), 1, 0)

    def step(_, xs):
        index, w_rows, pair_rows = xs  # [], [B, block, N, block] twice
        w_top = jax.lax.stop_gradient(w_rows.max(axis=-1))  # [B, block, N]
        earlier = (jnp.arange(num_blocks) < index)[None, None, :, None]
        position_weights = jnp.where(pair_rows & earlier, jnp.exp(w_rows - w_top[..., None]), 0.0)
        numerators = jnp.einsum(
            "btnc,bncd->btnd", position_weights, weighted_values, precision=_HIGHEST
        )
        denominators = jnp.einsum(
            "btnc,bncd->btnd", position_weights, key_weights, precision=_HIGHEST
        )
        scales = jnp.where(earlier, w_top[..., None] + k_top[:, None], _NEG)  # [B, block, N, D]
        # The diagonal block: pairs (i, j) of this block, exactly.
        w_own = jax.lax.dynamic_index_in_dim(w_rows, index, axis=2, keepdims=False)
        own_pairs = jax.lax.dynamic_index_in_dim(pair_rows, index, axis=2, keepdims=False)
        k_own = jax.lax.dynamic_index_in_dim(k_blocks, index, axis=1, keepdims=False)
        v_own = jax.lax.dynamic_index_in_dim(v_blocks, index, axis=1, keepdims=False)
        logits = jnp.where(own_pairs[..., None], w_own[..., None] + k_own[:, None], _NEG)
        top = jax.lax.stop_gradient(jnp.maximum(logits.max(axis=2), scales.max(axis=2)))
        own_weights = jnp.where(own_pairs[..., None], jnp.exp(logits - top[:, :, None]), 0.0)
        rescale = jnp.exp(scales - top[:, :, None])
        numerator = (numerators * rescale).sum(2) + jnp.einsum("bijd,bjd->bid", own_weights, v_own)
        denominator = (denominators * rescale).sum(2) + own_weights.sum(axis=2)
        return None, (numerator, denominator, top)

    xs = (jnp.arange(num_blocks), rows(w), rows(pairs))
    # Rematerialized: the backward pass recomputes each block's weights.
    _, sums = jax.lax.scan(jax.checkpoint(step), None, xs)

    def unblock(x):  # [N, B, block, D] -> [B, T, D]
        return jnp.moveaxis(x, 0, 1).reshape(batch, -1, features)[:, :length]

    return tuple(unblock(x) for x in sums)


def biased_aft(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    pairwise_bias: jax.Array,
    *,
    allowed: jax.Array | None = None,
    key_mask: jax.Array | None = None,
) -> jax.Array:
    """AFT with a pairwise bias: ``query [B, T, D]``, ``key, value [B, S, D]``, ``w [T, S]`` or
    ``[B, T, S]``; ``allowed`` bool broadcastable to ``[B, T, S]`` (causality, segments: False
    drops the pair), ``key_mask`` bool ``[B, S]``.

    ``exp(w - max_row(w)) @ (exp(K - max(K)) * V)`` over ``exp(w - max_row(w)) @ exp(K -
    max(K))``: both maxima cancel in the ratio.
    """
    numerator, denominator, _ = biased_sums(
        key, value, pairwise_bias, allowed=allowed, key_mask=key_mask, length=query.shape[1]
    )
    return _gate(query, numerator, denominator)


def biased_sums(
    key: jax.Array,
    value: jax.Array,
    pairwise_bias: jax.Array,
    *,
    length: int,
    allowed: jax.Array | None = None,
    key_mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The sums of :func:`biased_aft` for ``length`` queries before the gate:
    ``(numerator, denominator, top)``, each ``[B, T, D]``, the sums scaled by ``exp(-top)``."""
    k, v, valid = _float32_keys(key, value, key_mask)
    shape = (key.shape[0], length, key.shape[1])
    w = jnp.broadcast_to(pairwise_bias.astype(jnp.float32), shape)
    if allowed is not None:
        w = jnp.where(allowed, w, _NEG)
    w_top = jax.lax.stop_gradient(jnp.max(w, axis=-1, keepdims=True))
    # A dropped pair has w = -1e30, so its weight underflows to 0 (unless the whole row is
    # dropped: then its max is -1e30 too, and the where gives 0).
    position_weights = jnp.exp(w - w_top)
    if allowed is not None:
        position_weights = jnp.where(allowed, position_weights, 0.0)
    k_top = jax.lax.stop_gradient(jnp.max(k, axis=1, keepdims=True))
    key_weights = jnp.where(valid, jnp.exp(k - k_top), 0.0)
    numerator = jnp.einsum("bts,bsd->btd", position_weights, key_weights * v, precision=_HIGHEST)
    denominator = jnp.einsum("bts,bsd->btd", position_weights, key_weights, precision=_HIGHEST)
    return numerator, denominator, w_top + k_top


def cached_causal_aft(
    query: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    pairwise_bias: jax.Array,
    *,
    offset: jax.Array | int,
    key_mask: jax.Array | None = None,
) -> jax.Array:
    """Causal AFT of ``T`` new positions, whose keys and values sit at slots ``[offset, offset
    + T)`` of a cache ``keys, values [B, S, D]``; ``pairwise_bias [B, T, S]`` (their rows of
    ``w``), ``key_mask [B, S]``.

    The slots before ``offset`` are visible to every new position (:func:`biased_sums`, one
    maximum per feature), the new ones to each other causally (:func:`causal_biased_sums`);
    the two sums are merged as online softmax merges blocks, so a prefill is as stable as the
    full forward.
    """
    length, slots = query.shape[1], keys.shape[1]
    key_mask = jnp.ones(keys.shape[:2], jnp.bool_) if key_mask is None else key_mask
    earlier = key_mask & (jnp.arange(slots) < offset)[None]
    before = biased_sums(keys, values, pairwise_bias, length=length, key_mask=earlier)

    def own(x, axis=1):
        return jax.lax.dynamic_slice_in_dim(x, offset, length, axis=axis)

    new = causal_biased_sums(
        own(keys), own(values), own(pairwise_bias, axis=2), key_mask=own(key_mask)
    )
    (num_a, den_a, top_a), (num_b, den_b, top_b) = before, new
    top = jnp.maximum(top_a, top_b)
    scale_a, scale_b = jnp.exp(top_a - top), jnp.exp(top_b - top)
    return _gate(query, num_a * scale_a + num_b * scale_b, den_a * scale_a + den_b * scale_b)


def _float32_keys(key, value, mask):
    """Keys and values in float32, and the validity of each key broadcastable to ``[B, S, D]``;
    dropped keys are set to -1e30 first, so that no exp of them overflows (nor its gradient)."""
    valid = jnp.ones((1, 1, 1), jnp.bool_) if mask is None else jnp.asarray(mask)[..., None]
    key = jnp.where(valid, key.astype(jnp.float32), _NEG)
    return key, value.astype(jnp.float32), valid


def _gate(query, numerator, denominator):
    """``sigmoid(Q) * numerator / denominator`` in the query's dtype; 0 where nothing was
    summed (the division guarded so that its gradient is finite too)."""
    seen = denominator > 0
    average = jnp.where(seen, numerator / jnp.where(seen, denominator, 1.0), 0.0)
    return (jax.nn.sigmoid(query.astype(jnp.float32)) * average).astype(query.dtype)
