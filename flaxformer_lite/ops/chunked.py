"""Memory-efficient attention in pure JAX: online softmax over blocks, with a custom VJP.

The forward pass walks over query blocks and, for each, over the key/value blocks it can see,
keeping a running row max, row sum and output accumulator (Rabe & Staats 2021,
"Self-attention Does Not Need O(n²) Memory"; Dao et al. 2022, FlashAttention). It saves only the
output and the row log-sum-exp, so the backward pass (FlashAttention-2, Dao 2023) recomputes each
block's probabilities instead of storing the ``[T, S]`` matrix: memory is O(T) both ways.

Blocks that a causal or sliding-window mask hides entirely are skipped: each query block loops
only over the key blocks in its visible band (and each key block over its query band in the
backward pass); with global tokens also over the global blocks, which are always kept.
Lengths need not divide by the block sizes; the tails are padded and masked.
Packed rows' segment ids are taken as ids and each block's mask is built from the block's slice
of them, like the causal and window masks: no ``[T, S]`` mask exists for them.
Attention dropout draws its keep-mask per block from ``fold_in(fold_in(rng, q_block), k_block)``
and redraws the same mask in the backward pass.

Shapes are those of :func:`flaxformer_lite.ops.dot_product_attention`; for what the custom VJP
means to callers see the conventions in :mod:`flaxformer_lite.ops`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from flaxformer_lite.ops.attention_inputs import (
    MASK_VALUE,
    as_rank4,
    attention_logits_shape,
    default_scale,
    dropout_keep,
    group_heads,
    validated_attention_inputs,
    validated_segment_ids,
)
from flaxformer_lite.ops.masks import segment_mask

DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Static facts of one call: lengths, blocks, and the visible band of keys per query.

    Query row ``i`` sits at position ``i + S - T`` (``T = q_len``, ``S = kv_len``), or at
    ``positions[i]`` when the call gives the queries' positions, key ``j`` at ``j``; the query may
    see key ``j`` iff ``position - left <= j <= position + right`` and ``j < S``, or, with
    ``global_tokens`` G, iff ``j < G`` or ``position < G`` (and ``j <= position`` when
    ``causal``). The methods take ``positions``, int ``[T']`` (padded) or ``None``.
    """

    q_len: int
    kv_len: int
    block_q: int
    block_k: int
    left: int
    right: int
    dropout_rate: float
    causal: bool = False
    global_tokens: int = 0

    @property
    def offset(self) -> int:
        return self.kv_len - self.q_len

    def row_positions(self, q_block, positions=None):
        """The lowest and highest position of query block ``q_block``'s rows."""
        first_row = q_block * self.block_q
        if positions is not None:
            block = lax.dynamic_slice_in_dim(positions, first_row, self.block_q)
            return block.min(), block.max()
        last_row = jnp.minimum(first_row + self.block_q, self.q_len) - 1
        return first_row + self.offset, last_row + self.offset

    def key_blocks(self, q_block, positions=None):
        """``[lo, hi)`` ranges of key-block indices that query block ``q_block`` can see: the
        band, preceded with global tokens by the global blocks left of it."""
        first, last = self.row_positions(q_block, positions)
        lo = jnp.maximum(first - self.left, 0)
        hi = jnp.minimum(last + self.right + 1, self.kv_len)
        if not self.global_tokens:
            return (_block_range(lo, hi, self.block_k),)
        # Keys beyond the last row's position stay hidden under causality, global or not.
        reach = jnp.minimum(last + 1, self.kv_len) if self.causal else self.kv_len
        has_global_row = first < self.global_tokens
        lo = jnp.where(has_global_row, 0, lo)
        hi = jnp.where(has_global_row, jnp.maximum(hi, reach), hi)
        first, last = _block_range(lo, hi, self.block_k)
        global_blocks = _block_range(0, jnp.minimum(self.global_tokens, reach), self.block_k)[1]
        return (0, jnp.minimum(global_blocks, first)), (first, last)

    def query_blocks(self, k_block, positions=None):
        """``[lo, hi)`` ranges of query-block indices that can see key block ``k_block``: all
        of them when the queries' positions are given (they need not be in order)."""
        if positions is not None:
            return ((0, positions.shape[0] // self.block_q),)
        first_col = k_block * self.block_k
        last_col = jnp.minimum(first_col + self.block_k, self.kv_len) - 1
        lo = jnp.maximum(first_col - self.offset - self.right, 0)
        hi = jnp.minimum(last_col - self.offset + self.left + 1, self.q_len)
        if not self.global_tokens:
            return (_block_range(lo, hi, self.block_q),)
        has_global_col = first_col < self.global_tokens
        lo = jnp.where(
            has_global_col, jnp.maximum(first_col - self.offset, 0) if self.causal else 0, lo
        )
        hi = jnp.where(has_global_col, self.q_len, hi)
        first, last = _block_range(lo, hi, self.block_q)
        # Causal global queries see only keys before them, which are global keys already.
        global_rows = (
            0 if self.causal else jnp.clip(self.global_tokens - self.offset, 0, self.q_len)
        )
        global_blocks = _block_range(0, global_rows, self.block_q)[1]
        return (0, jnp.minimum(global_blocks, first)), (first, last)

    def visible(self, first_row, first_col, positions=None):
        """bool ``[block_q, block_k]``: which (query, key) pairs of a block may attend."""
        if positions is None:
            position = first_row + jnp.arange(self.block_q)[:, None] + self.offset
        else:
            position = lax.dynamic_slice_in_dim(positions, first_row, self.block_q)[:, None]
        col = first_col + jnp.arange(self.block_k)[None, :]
        window = (col >= position - self.left) & (col <= position + self.right)
        if self.global_tokens:
            is_global = (col < self.global_tokens) | (position < self.global_tokens)
            window = window | (is_global & (col <= position) if self.causal else is_global)
        return (col < self.kv_len) & window


def _block_range(lo, hi, block):
    """Blocks of size ``block`` that overlap ``[lo, hi)``; empty when ``hi <= lo``."""
    first = lo // block
    return first, jnp.maximum(first, (hi + block - 1) // block)


def chunked_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    local_window: tuple[int, int] | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    global_tokens: int = 0,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    query_positions: jax.Array | None = None,
    segment_ids: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Memory-efficient attention: :func:`flaxformer_lite.ops.reference_attention`'s result and
    gradients in O(T) memory.

    Dropout draws its keep-mask per block, so for the same ``dropout_rng`` the dropped weights
    differ from the "xla" implementation's (and depend on the block sizes); both are exact
    dropout with rate ``dropout_rate``.

    Args:
      query: ``[B, T, H, Dh]``.
      key: ``[B, S, Hk, Dh]``.
      value: ``[B, S, Hk, Dv]``.
      bias: optional float, broadcastable to ``[B, H, T, S]``; differentiable.
      mask: optional bool, broadcastable to ``[B, H, T, S]``, True = may attend.
      scale, is_causal, local_window, dropout_rate, dropout_rng, global_tokens: as in
        :func:`flaxformer_lite.ops.dot_product_attention`.
      block_q: query rows per block, a Python int (clipped to T).
      block_k: keys per block, a Python int (clipped to S).
      query_positions: int ``[T]``, each query's position in place of ``i + S - T`` (the
        queries of a sequence split over devices); the causal, window and global-token masks
        are taken at them, block by block, and the backward pass visits every query block.
      segment_ids: optional int ``(q [B, T], kv [B, S])``: a query sees only keys with its id
        (packed rows); each block's mask is built from the block's slice of the ids.

    Returns:
      ``[B, T, H, Dv]`` in the query's dtype.
    """
    query, key, value, bias, mask = validated_attention_inputs(
        query, key, value, bias, mask, local_window, dropout_rate, dropout_rng, global_tokens
    )
    segment_ids = validated_segment_ids(segment_ids, query, key)
    if not all(isinstance(size, int) and size > 0 for size in (block_q, block_k)):
        raise ValueError(f"block sizes must be positive ints, got {block_q=}, {block_k=}")
    b, q_len, h, dh = query.shape
    kv_len, hk = key.shape[1], key.shape[2]
    unlimited = q_len + kv_len
    left, right = local_window if local_window is not None else (unlimited, unlimited)
    geometry = _Geometry(
        q_len=q_len,
        kv_len=kv_len,
        block_q=min(block_q, q_len),
        block_k=min(block_k, kv_len),
        left=left,
        right=min(right, 0) if is_causal else right,
        dropout_rate=float(dropout_rate),
        causal=is_causal,
        global_tokens=int(global_tokens) if local_window is not None else 0,
    )
    q_pad = -q_len % geometry.block_q
    kv_pad = -kv_len % geometry.block_k
    target = attention_logits_shape(query, key)
    # Scaling q outside the custom VJP lets autodiff supply the gradient of a traced scale
    # (a learned temperature), and costs O(T·Dh) instead of O(T·S) multiplies.
    scaled = (query.astype(jnp.float32) * default_scale(query, scale)).astype(query.dtype)
    q = _pad_axis(scaled, 1, q_pad).reshape(b, q_len + q_pad, hk, h // hk, dh)
    k = _pad_axis(key, 1, kv_pad)
    v = _pad_axis(value, 1, kv_pad)
    bias = _pad_logit_axes(group_heads(as_rank4("bias", bias, target), hk), q_pad, kv_pad)
    mask = _pad_logit_axes(group_heads(as_rank4("mask", mask, target), hk), q_pad, kv_pad)
    segments = None
    if segment_ids is not None:  # padded keys are hidden by the geometry, padded rows dropped
        segments = (_pad_axis(segment_ids[0], 1, q_pad), _pad_axis(segment_ids[1], 1, kv_pad))
    positions = None
    if query_positions is not None:  # padded rows repeat the last position: no wider band
        positions = jnp.pad(jnp.asarray(query_positions, jnp.int32), (0, q_pad), mode="edge")
    out = _attention(geometry, q, k, v, bias, mask, segments, positions, dropout_rng)
    return out[:, :q_len].reshape(b, q_len, h, value.shape[-1]).astype(query.dtype)


def _pad_axis(x, axis, amount):
    if amount == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, amount)
    return jnp.pad(x, widths)


def _pad_logit_axes(x, q_pad, kv_pad):
    """Pads the T and S axes of a ``[B, Hk, G, T, S]`` bias or mask where they are full size."""
    if x is None:
        return None
    x = x if x.shape[3] == 1 else _pad_axis(x, 3, q_pad)
    return x if x.shape[4] == 1 else _pad_axis(x, 4, kv_pad)


def _slice_block(x, first_row, first_col, geometry):
    """The ``[B, Hk, G, block_q, block_k]`` block (size-1 axes kept) of a bias or mask."""
    if x is None:
        return None
    if x.shape[3] > 1:
        x = lax.dynamic_slice_in_dim(x, first_row, geometry.block_q, axis=3)
    if x.shape[4] > 1:
        x = lax.dynamic_slice_in_dim(x, first_col, geometry.block_k, axis=4)
    return x


def _add_block(total, block, first_row, first_col):
    """Adds a logits-shaped block into ``total``, summing over the axes ``total`` broadcasts."""
    summed = tuple(a for a in range(5) if total.shape[a] == 1 and block.shape[a] > 1)
    block = block.sum(summed, keepdims=True)
    start = (
        0,
        0,
        0,
        first_row if total.shape[3] > 1 else 0,
        first_col if total.shape[4] > 1 else 0,
    )
    current = lax.dynamic_slice(total, start, block.shape)
    return lax.dynamic_update_slice(total, current + block, start)


def _block_segment_mask(segments, first_row, first_col, geometry):
    """bool ``[B, 1, 1, block_q, block_k]``: the segment mask of the block's slice of the ids."""
    q_ids, kv_ids = segments
    q_ids = lax.dynamic_slice_in_dim(q_ids, first_row, geometry.block_q, axis=1)
    kv_ids = lax.dynamic_slice_in_dim(kv_ids, first_col, geometry.block_k, axis=1)
    return segment_mask(q_ids, kv_ids)[:, None]


def _block_logits(
    geometry, q_block, k_block, bias, mask, segments, positions, first_row, first_col
):
    """Biased, masked float32 logits ``[B, Hk, G, bq, bk]`` of pre-scaled q, and their validity."""
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", q_block, k_block, preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + _slice_block(bias, first_row, first_col, geometry).astype(jnp.float32)
    valid = geometry.visible(first_row, first_col, positions)
    if mask is not None:
        valid = valid & _slice_block(mask, first_row, first_col, geometry)
    if segments is not None:
        valid = valid & _block_segment_mask(segments, first_row, first_col, geometry)
    return jnp.where(valid, logits, MASK_VALUE), valid


def _dropout_keep(geometry, rng, q_block, k_block, shape):
    block_rng = jax.random.fold_in(jax.random.fold_in(rng, q_block), k_block)
    return dropout_keep(block_rng, geometry.dropout_rate, shape)


def _forward(geometry, q, k, v, bias, mask, segments, positions, rng):
    """float32 output ``[B, T', Hk, G, Dv]`` and row log-sum-exp ``[B, Hk, G, T']``.

    ``T'`` is the padded query length.
    """
    b, q_len_padded, hk, g, _ = q.shape
    bq, bk, dv = geometry.block_q, geometry.block_k, v.shape[-1]

    def one_query_block(i):
        first_row = i * bq
        q_i = lax.dynamic_slice_in_dim(q, first_row, bq, axis=1)

        def one_key_block(j, carry):
            row_max, row_sum, acc = carry
            first_col = j * bk
            k_j = lax.dynamic_slice_in_dim(k, first_col, bk, axis=1)
            v_j = lax.dynamic_slice_in_dim(v, first_col, bk, axis=1)
            logits, valid = _block_logits(
                geometry, q_i, k_j, bias, mask, segments, positions, first_row, first_col
            )
            new_max = jnp.maximum(row_max, logits.max(axis=-1))
            p = jnp.where(valid, jnp.exp(logits - new_max[..., None]), 0.0)
            correction = jnp.exp(row_max - new_max)
            row_sum = correction * row_sum + p.sum(axis=-1)
            if geometry.dropout_rate > 0.0:
                keep = _dropout_keep(geometry, rng, i, j, p.shape)
                p = jnp.where(keep, p / (1.0 - geometry.dropout_rate), 0.0)
            pv = jnp.einsum(
                "bhgqk,bkhd->bhgqd", p.astype(v.dtype), v_j, preferred_element_type=jnp.float32
            )
            return new_max, row_sum, correction[..., None] * acc + pv

        init = (
            jnp.full((b, hk, g, bq), MASK_VALUE, jnp.float32),
            jnp.zeros((b, hk, g, bq), jnp.float32),
            jnp.zeros((b, hk, g, bq, dv), jnp.float32),
        )
        carry = init
        for lo, hi in geometry.key_blocks(i, positions):
            carry = lax.fori_loop(lo, hi, one_key_block, carry)
        row_max, row_sum, acc = carry
        # Rows that saw no key (fully masked) have row_sum == 0 and acc == 0: output 0, not NaN.
        safe_sum = jnp.where(row_sum > 0.0, row_sum, 1.0)
        return acc / safe_sum[..., None], row_max + jnp.log(safe_sum)

    out, lse = lax.map(one_query_block, jnp.arange(q_len_padded // bq))
    # out: [nq, B, Hk, G, bq, Dv] -> [B, T', Hk, G, Dv]; lse: [nq, B, Hk, G, bq] -> [B, Hk, G, T']
    out = jnp.moveaxis(out, (0, 4), (1, 2)).reshape(b, q_len_padded, hk, g, dv)
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, hk, g, q_len_padded)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(geometry, q, k, v, bias, mask, segments, positions, rng):
    return _forward(geometry, q, k, v, bias, mask, segments, positions, rng)[0]


def _attention_fwd(geometry, q, k, v, bias, mask, segments, positions, rng):
    out, lse = _forward(geometry, q, k, v, bias, mask, segments, positions, rng)
    return out, (q, k, v, bias, mask, segments, positions, rng, out, lse)


def _attention_bwd(geometry, residuals, d_out):
    q, k, v, bias, mask, segments, positions, rng, out, lse = residuals
    b, q_len_padded, hk, g, dh = q.shape
    bq, bk, rate = geometry.block_q, geometry.block_k, geometry.dropout_rate
    compute_dtype = q.dtype
    # delta_i = sum_d dO_i · O_i = rowsum(P ∘ dP), also with dropout (FlashAttention-2, eq. 4).
    delta = jnp.moveaxis(jnp.sum(d_out * out, axis=-1), 1, 3)  # [B, Hk, G, T']
    d_out = d_out.astype(compute_dtype)

    def one_key_block(carry, j):
        first_col = j * bk
        k_j = lax.dynamic_slice_in_dim(k, first_col, bk, axis=1)
        v_j = lax.dynamic_slice_in_dim(v, first_col, bk, axis=1)

        def one_query_block(i, inner):
            dq, dbias, dk_j, dv_j = inner
            first_row = i * bq
            q_i = lax.dynamic_slice_in_dim(q, first_row, bq, axis=1)
            do_i = lax.dynamic_slice_in_dim(d_out, first_row, bq, axis=1)
            lse_i = lax.dynamic_slice_in_dim(lse, first_row, bq, axis=3)
            delta_i = lax.dynamic_slice_in_dim(delta, first_row, bq, axis=3)
            logits, valid = _block_logits(
                geometry, q_i, k_j, bias, mask, segments, positions, first_row, first_col
            )
            p = jnp.where(valid, jnp.exp(logits - lse_i[..., None]), 0.0)
            dp = jnp.einsum("bqhgd,bkhd->bhgqk", do_i, v_j, preferred_element_type=jnp.float32)
            p_dropped = p
            if rate > 0.0:
                keep = _dropout_keep(geometry, rng, i, j, p.shape)
                p_dropped = jnp.where(keep, p / (1.0 - rate), 0.0)
                dp = jnp.where(keep, dp / (1.0 - rate), 0.0)
            dv_j = dv_j + jnp.einsum(
                "bhgqk,bqhgd->bkhd",
                p_dropped.astype(compute_dtype),
                do_i,
                preferred_element_type=jnp.float32,
            )
            d_logits = p * (dp - delta_i[..., None])
            ds = d_logits.astype(compute_dtype)
            dq_i = jnp.einsum("bhgqk,bkhd->bqhgd", ds, k_j, preferred_element_type=jnp.float32)
            dq = lax.dynamic_update_slice_in_dim(
                dq, lax.dynamic_slice_in_dim(dq, first_row, bq, axis=1) + dq_i, first_row, axis=1
            )
            dk_j = dk_j + jnp.einsum(
                "bhgqk,bqhgd->bkhd", ds, q_i, preferred_element_type=jnp.float32
            )
            if dbias is not None:
                dbias = _add_block(dbias, d_logits, first_row, first_col)
            return dq, dbias, dk_j, dv_j

        dq, dbias = carry
        inner = (dq, dbias, jnp.zeros(k_j.shape, jnp.float32), jnp.zeros(v_j.shape, jnp.float32))
        for lo, hi in geometry.query_blocks(j, positions):
            inner = lax.fori_loop(lo, hi, one_query_block, inner)
        dq, dbias, dk_j, dv_j = inner
        return (dq, dbias), (dk_j, dv_j)

    init = (
        jnp.zeros(q.shape, jnp.float32),
        None if bias is None else jnp.zeros(bias.shape, jnp.float32),
    )
    num_key_blocks = k.shape[1] // bk
    (dq, dbias), (dk, dv) = lax.scan(one_key_block, init, jnp.arange(num_key_blocks))
    dk = jnp.moveaxis(dk, 0, 1).reshape(k.shape)
    dv = jnp.moveaxis(dv, 0, 1).reshape(v.shape)
    dbias = None if bias is None else dbias.astype(bias.dtype)
    grads = dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias
    return (*grads, None, None, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)
