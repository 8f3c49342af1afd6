"""The "xla" implementation of attention: :func:`~flaxformer_lite.ops.reference_attention`
optimised, in plain jax.

The same values in another order of operations: causal or windowed masks split the queries into
blocks, each against only the keys it can see (:func:`_query_blocks`); the G query heads of each
key/value head are vmapped over rather than the keys and values repeated G times
(:func:`per_query_group`); and the softmax is divided out after the value product, on
``[.., T, Dv]`` instead of the ``[.., T, S]`` weights (:func:`_unnormalized_softmax`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flaxformer_lite.ops.attention_inputs import (
    MASK_VALUE,
    AttentionCall,
    as_rank4,
    attention_logits_shape,
    default_scale,
    dropout_keep,
)

# With a causal or windowed mask, "xla" splits more queries than this into blocks of this many
# rows, each against only the keys its rows can see, and so skips most hidden logits. Longer
# queries use larger blocks, at most MAX_QUERY_BLOCKS, as each block is its own pair of matmuls.
QUERY_BLOCK_ROWS = 128
MAX_QUERY_BLOCKS = 8


def xla_attention(call: AttentionCall) -> jax.Array:
    """``[B, T, H, Dv]``: :func:`~flaxformer_lite.ops.reference_attention` of ``call``, optimised,
    with dropout."""
    query, key, value, mask = call.query, call.key, call.value, call.mask
    dropout_rate = call.dropout_rate
    b, t, h, _ = query.shape
    s = key.shape[1]
    bias, full_mask = _logit_shaped(call)
    keep = None
    if dropout_rate > 0.0:
        keep = dropout_keep(call.dropout_rng, dropout_rate, (b, h, t, s))
    scale = default_scale(query, call.scale)

    def attend(q, bias, mask, keep, *, key, value):
        weights, normalizer = _unnormalized_softmax(q, key, bias, mask, scale)
        if keep is not None:
            weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
        out = _float32_product("bhts,bhsd->bhtd", weights.astype(value.dtype), value.swapaxes(1, 2))
        return (out / normalizer).swapaxes(1, 2)

    outs = []
    geometry = (mask.is_causal, mask.local_window, mask.global_tokens)
    for (q0, q1), key_ranges in _query_blocks(t, s, *geometry):
        logit_blocks = [_logit_block(x, q0, q1, key_ranges) for x in (bias, full_mask, keep)]
        block_key, block_value = (_key_block(x, key_ranges) for x in (key, value))
        attend_block = functools.partial(attend, key=block_key, value=block_value)
        outs.append(per_query_group(attend_block, query[:, q0:q1], key.shape[2], 3, *logit_blocks))
    out = jnp.concatenate(outs, axis=1)
    # Only a user mask, or a causal/window mask with more queries than keys, can leave a row
    # without any visible key. Such rows are zeroed on the output, which is cheaper than on the
    # [T, S] weights and blocks their gradient just the same.
    has_given = mask.explicit is not None or mask.segment_ids is not None
    if full_mask is not None and (has_given or t > s):
        row_has_key = jnp.moveaxis(jnp.any(full_mask, axis=-1), 1, 2)[..., None]  # [B, T, H, 1]
        out = jnp.where(row_has_key, out, 0.0)
    return out.astype(query.dtype)


def xla_weights(call: AttentionCall) -> jax.Array:
    """float32 ``[B, H, T, S]``: the attention probabilities of ``call``, zeros in masked places."""
    bias, full_mask = _logit_shaped(call)
    query, key = call.query, call.key

    def softmax(q, bias, mask):
        return _softmax(q, key, bias, mask, default_scale(query, call.scale))

    probs = per_query_group(softmax, query, key.shape[2], 2, bias, full_mask)
    return probs if full_mask is None else jnp.where(full_mask, probs, 0.0)


def _logit_shaped(call: AttentionCall):
    """``(bias, mask)`` of ``call`` rank 4, the mask holding every piece, or ``None``s."""
    target = attention_logits_shape(call.query, call.key)
    full_mask = call.mask.dense(call.query.shape[1], call.key.shape[1])
    return as_rank4("bias", call.bias, target), as_rank4("mask", full_mask, target)


def _query_blocks(t, s, is_causal, local_window, global_tokens=0):
    """``[((q0, q1), key_ranges), ...]``: blocks of query rows and the ranges of keys each sees.

    One block (all T queries, all S keys) unless a causal or sliding-window mask hides keys and
    there are more than ``QUERY_BLOCK_ROWS`` queries; else blocks of ``QUERY_BLOCK_ROWS`` rows, or
    ``MAX_QUERY_BLOCKS`` equal blocks if that makes them larger. Positions are aligned as in
    :meth:`AttentionMask.positional`: query ``i`` sits at ``i + S - T``. ``key_ranges`` is
    ``((k0, k1),)``, preceded by ``(0, G')`` for the global keys left of the band; a block
    holding a global query sees every key up to its causal limit.
    """
    left, right = local_window if local_window is not None else (None, None)
    if is_causal:
        right = 0
    if (left is None and right is None) or t <= QUERY_BLOCK_ROWS:
        return [((0, t), ((0, s),))]
    offset = s - t
    rows = max(QUERY_BLOCK_ROWS, -(-t // MAX_QUERY_BLOCKS))
    blocks = []
    for q0 in range(0, t, rows):
        q1 = min(q0 + rows, t)
        k0 = 0 if left is None else max(q0 + offset - left, 0)
        k1 = s if right is None else min(q1 + offset + right, s)
        # Keys a causal mask hides stay hidden from global queries and global keys.
        reach = min(q1 + offset, s) if is_causal else s
        if q0 + offset < global_tokens:
            k0, k1 = 0, max(k1, reach)
        global_end = min(global_tokens, reach)
        if global_end >= k0:
            k0, k1 = 0, max(k1, global_end)
        # With more queries than keys a block may see no key at all: it keeps one (masked) and
        # its rows are zeroed like every row without a key.
        band = (k0, max(k1, k0 + 1))
        blocks.append(((q0, q1), ((0, global_end), band) if 0 < global_end < k0 else (band,)))
    return blocks


def _key_block(x, key_ranges):
    """The keys (or values) ``[B, S', Hk, D]`` of ``key_ranges``, concatenated."""
    return jnp.concatenate([x[:, k0:k1] for k0, k1 in key_ranges], axis=1)


def _logit_block(x, q0, q1, key_ranges):
    """Rows ``q0:q1`` and the columns of ``key_ranges`` of a rank-4 logit-shaped array
    (broadcast axes kept)."""
    if x is None:
        return None
    x = x[:, :, q0:q1] if x.shape[2] > 1 else x
    if x.shape[3] == 1:
        return x
    return jnp.concatenate([x[:, :, :, k0:k1] for k0, k1 in key_ranges], axis=3)


def _logits(query, key, bias, mask, scale):
    """float32 masked logits q kᵀ · scale + bias ``[B, Hk, T, S]`` for query ``[B, T, Hk, Dh]``.

    Masked logits get a finite fill, so a fully masked row is uniform rather than NaN; callers
    zero such rows.
    """
    # Heads moved ahead of positions, so that every (b, h) product is a GEMM on contiguous
    # operands rather than on strided ones.
    logits = _float32_product("bhtd,bhsd->bhts", query.swapaxes(1, 2), key.swapaxes(1, 2))
    logits = logits * scale
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if mask is not None:
        logits = jnp.where(mask, logits, MASK_VALUE)
    return logits


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _float32_product(spec, a, b):
    """``jnp.einsum(spec, a, b)`` accumulated and returned in float32.

    Its derivatives' products run in the operands' dtype, as in "chunked" and the flash
    attention kernels: the float32 cotangent is rounded to bf16 for bf16 operands, so that the
    backward matmuls are bf16 too rather than float32 x bf16. Float32 operands are unchanged.
    """
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


@_float32_product.defjvp
def _float32_product_jvp(spec, primals, tangents):
    (a, b), (da, db) = primals, tangents
    tangent = jnp.einsum(spec, da, b).astype(jnp.float32) + jnp.einsum(spec, a, db).astype(
        jnp.float32
    )
    return _float32_product(spec, a, b), tangent


def _softmax(query, key, bias, mask, scale):
    """float32 softmax of :func:`_logits` ``[B, Hk, T, S]``."""
    return jax.nn.softmax(_logits(query, key, bias, mask, scale), axis=-1)


def _unnormalized_softmax(query, key, bias, mask, scale):
    """``(exp(logits - max), sum)``: the softmax before its division, ``[B, Hk, T, S]``, and
    its row sums ``[B, Hk, T, 1]``.

    Dividing the ``[.., T, Dv]`` attention output by the sums instead of the ``[.., T, S]``
    weights saves a pass over the weights, and in the backward pass the broadcast quotient that
    autodiff of ``jax.nn.softmax`` materializes at ``[B, Hk, T, S]``.
    """
    logits = _logits(query, key, bias, mask, scale)
    weights = jnp.exp(logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True)))
    return weights, jnp.sum(weights, axis=-1, keepdims=True)


def per_query_group(fn, query, num_kv_heads, out_axis, *logit_shaped):
    """Runs ``fn`` once per query head of each key/value group (vmap), merging the results.

    ``fn(q [B, T, Hk, Dh], *xs)`` receives one of the G = H / Hk query heads of every key/value
    head and the matching slice of each ``[B, H, T, S]`` array in ``logit_shaped`` (arrays with
    one head and ``None`` are passed whole). Its head axis ``out_axis`` (of size Hk) becomes the
    H axis of the result. Chosen over a 5-D grouped einsum and over repeating the keys and
    values G times, both slower on CPU.
    """
    b, t, h, dh = query.shape
    group = h // num_kv_heads
    if group == 1:
        return fn(query, *logit_shaped)
    args, in_axes = [query.reshape(b, t, num_kv_heads, group, dh)], [3]
    for x in logit_shaped:
        if x is None or x.shape[1] == 1:
            args.append(x)
            in_axes.append(None)
        else:
            args.append(x.reshape(x.shape[0], num_kv_heads, group, *x.shape[2:]))
            in_axes.append(2)
    out = jax.vmap(fn, in_axes=in_axes, out_axes=out_axis)(*args)
    merged = out.shape[out_axis - 1] * out.shape[out_axis]
    return out.reshape(*out.shape[: out_axis - 1], merged, *out.shape[out_axis + 1 :])
