"""Scaled dot-product attention, softmax(q kᵀ · scale + bias) v, with masks; its implementations.

:func:`reference_attention` is the definition, written as the formula reads. The implementations
of :func:`dot_product_attention` compute the same values faster or in less memory, and the tests
hold each of them equal to it:

  ``"xla"``      the reference optimised (:func:`xla_attention`): blocks of queries against only
                 the keys they can see, query heads grouped under their key/value head instead of
                 repeated keys and values, and the softmax normalised after the value product;
                 O(T·S) memory.
  ``"chunked"``  memory-efficient online-softmax attention (:func:`chunked_attention`); O(T)
                 memory in the forward and backward pass.
  ``"cudnn"``    cuDNN flash attention through ``jax.nn.dot_product_attention`` (GPU only).
  ``"pallas"``   jax's Pallas flash attention kernels on TPU and GPU (:mod:`.pallas_attention`);
                 inputs they cannot run fall back on the automatic choice, the reason logged.
  ``None``       the best one that supports the backend, shapes and features (on TPU
                 "pallas"); the reason for the choice is logged (logger
                 ``flaxformer_lite.ops.attention``, at trace time).

Shapes (letters as in :mod:`flaxformer_lite.ops`): query ``[B, T, H, Dh]``, key ``[B, S, Hk, Dh]``,
value ``[B, S, Hk, Dv]``, output ``[B, T, H, Dv]``. ``bias`` (additive, float) and ``mask`` (bool,
True = may attend) broadcast to ``[B, H, T, S]``. Grouped-query attention: ``H`` is a multiple of
``Hk`` and query head ``n`` uses key/value head ``n // G``, ``G = H // Hk``; ``Hk == 1`` is
multi-query attention.

Numerics: logits, softmax and accumulation are float32 whatever the input dtype; the output has
the query's dtype. A query row whose keys are all masked returns zeros, never NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flaxformer_lite.ops.attention_choice import (
    GLOBAL_TOKENS_UNSUPPORTED,
    cudnn_unsupported_reason,
    log_once,
    select_implementation,
)
from flaxformer_lite.ops.attention_inputs import (
    MASK_VALUE,
    as_rank4,
    attention_logits_shape,
    default_scale,
    dropout_keep,
    structural_mask,
    validated_attention_inputs,
    validated_segment_ids,
)
from flaxformer_lite.ops.chunked_attention import chunked_attention
from flaxformer_lite.ops.masks import combine_masks, segment_mask
from flaxformer_lite.ops.pallas_attention import (
    pallas_attention,
    pallas_unsupported_reason,
    target_platform,
)

IMPLEMENTATIONS = ("xla", "chunked", "cudnn", "pallas")


def reference_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    local_window: tuple[int, int] | None = None,
    global_tokens: int = 0,
) -> jax.Array:
    """Attention as the formula reads: the definition the implementations are tested against.

    Arguments, shapes and result as :func:`dot_product_attention`, without dropout. Memory is
    O(B·H·T·S): for reading, testing and small inputs.
    """
    query, key, value, bias, mask = validated_attention_inputs(
        query, key, value, bias, mask, local_window, 0.0, None, global_tokens
    )
    group = query.shape[2] // key.shape[2]  # G query heads share each key/value head
    key = jnp.repeat(key, group, axis=2)  # [B, S, H, Dh]
    value = jnp.repeat(value, group, axis=2)  # [B, S, H, Dv]
    logits = jnp.einsum("bthd,bshd->bhts", query, key, preferred_element_type=jnp.float32)
    logits = logits * default_scale(query, scale)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    structural = structural_mask(
        query.shape[1], key.shape[1], is_causal, local_window, global_tokens
    )
    mask = combine_masks(mask, structural)  # bool, broadcastable to [B, H, T, S]
    if mask is not None:
        logits = jnp.where(mask, logits, MASK_VALUE)  # finite: a fully masked row stays NaN-free
    weights = jax.nn.softmax(logits, axis=-1)  # float32 [B, H, T, S]
    if mask is not None:
        weights = jnp.where(mask, weights, 0.0)  # rows without a visible key become zeros
    out = jnp.einsum(
        "bhts,bshd->bthd", weights.astype(value.dtype), value, preferred_element_type=jnp.float32
    )
    return out.astype(query.dtype)


# With a causal or windowed mask, "xla" splits more queries than this into blocks of this many
# rows, each against only the keys its rows can see, and so skips most hidden logits. Longer
# queries use larger blocks, at most MAX_QUERY_BLOCKS, as each block is its own pair of matmuls.
QUERY_BLOCK_ROWS = 128
MAX_QUERY_BLOCKS = 8


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    local_window: tuple[int, int] | None = None,
    global_tokens: int = 0,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    implementation: str | None = None,
    segment_ids: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Multi-head scaled dot-product attention.

    Args:
      query: ``[B, T, H, Dh]``.
      key: ``[B, S, Hk, Dh]`` with ``H % Hk == 0``.
      value: ``[B, S, Hk, Dv]``.
      bias: optional additive float bias broadcastable to ``[B, H, T, S]`` (relative
        positions, ALiBi). Use ``mask`` rather than ``-inf`` biases to forbid positions.
      mask: optional bool, broadcastable to ``[B, H, T, S]``, True = may attend.
      scale: multiplier of the logits; defaults to ``1 / sqrt(Dh)``.
      is_causal: query ``i`` attends keys ``j <= i + (S - T)``: with ``T != S`` the last
        query is aligned with the last key, as when decoding against a KV cache.
      local_window: ``(left, right)``: each query attends only keys at most ``left`` positions
        before and ``right`` after its own position (positions aligned as for ``is_causal``).
      global_tokens: G, with ``local_window`` (Longformer, BigBird): the first G positions
        attend to and are attended by every position, within causality when ``is_causal``.
        "xla" and "chunked" only: "pallas" falls back, the reason logged; cuDNN is not chosen.
      dropout_rate: dropout probability on the attention weights ("xla" and "chunked").
      dropout_rng: PRNG key, required when ``dropout_rate > 0``.
      implementation: ``"xla"``, ``"chunked"``, ``"cudnn"``, ``"pallas"`` or ``None``
        (automatic). The dropout keep-mask drawn from one ``dropout_rng`` differs between
        implementations. "chunked" has a custom VJP (see the conventions in
        :mod:`flaxformer_lite.ops`).
      segment_ids: optional int ``(q [B, T], kv [B, S])``, a mask by segment (packing): a query
        sees only keys with its id. The Pallas TPU kernel takes them as they are.

    Returns:
      ``[B, T, H, Dv]`` in the query's dtype.

    Raises:
      ValueError: on wrong ranks, mismatched shapes, ``H % Hk != 0``, masks or biases that do
        not broadcast, a non-boolean mask, or an implementation that cannot run these inputs.
    """
    query, key, value, bias, mask = validated_attention_inputs(
        query, key, value, bias, mask, local_window, dropout_rate, dropout_rng, global_tokens
    )
    # Without a window every key is visible already: global tokens change nothing.
    global_tokens = int(global_tokens) if local_window is not None else 0
    geometry = dict(
        scale=scale, is_causal=is_causal, local_window=local_window, global_tokens=global_tokens
    )
    dropout = dict(dropout_rate=dropout_rate, dropout_rng=dropout_rng)
    features = dict(is_causal=is_causal, local_window=local_window, dropout_rate=dropout_rate)
    mask = as_rank4("mask", mask, attention_logits_shape(query, key))
    segment_ids = validated_segment_ids(segment_ids, query, key)
    choice = dict(**features, segment_ids=segment_ids, global_tokens=global_tokens)
    if implementation is None:
        implementation = select_implementation(query, key, value, bias, mask, **choice)
    elif implementation == "pallas":
        reason = GLOBAL_TOKENS_UNSUPPORTED if global_tokens else ""
        reason = reason or pallas_unsupported_reason(
            query,
            key,
            value,
            bias,
            mask,
            **features,
            segment_ids=segment_ids,
            platform=target_platform(),
        )
        if reason:
            log_once(f'attention: implementation="pallas" falls back ({reason})')
            implementation = select_implementation(query, key, value, bias, mask, **choice)
    if implementation == "pallas":
        return pallas_attention(
            query,
            key,
            value,
            mask,
            scale=default_scale(query, scale),
            is_causal=is_causal,
            segment_ids=segment_ids,
            platform=target_platform(),
        )
    if segment_ids is not None:
        mask = combine_masks(mask, segment_mask(*segment_ids))
    if implementation == "xla":
        return xla_attention(query, key, value, bias, mask, **geometry, **dropout)
    if implementation == "chunked":
        return chunked_attention(query, key, value, bias, mask, **geometry, **dropout)
    if implementation == "cudnn":
        reason = cudnn_unsupported_reason(
            query, key, value, bias, mask, **features, global_tokens=global_tokens
        )
        if reason:
            raise ValueError(f'implementation="cudnn" cannot run these inputs: {reason}')
        return jax_nn_attention(
            query,
            key,
            value,
            bias,
            mask,
            scale=scale,
            is_causal=is_causal,
            local_window=local_window,
            implementation="cudnn",
        )
    raise ValueError(
        f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}"
    )


def attention_weights(
    query: jax.Array,
    key: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    local_window: tuple[int, int] | None = None,
    global_tokens: int = 0,
) -> jax.Array:
    """The attention probabilities softmax(q kᵀ · scale + bias), for inspection and plots.

    Args: as :func:`dot_product_attention` (query ``[B, T, H, Dh]``, key ``[B, S, Hk, Dh]``).

    Returns:
      float32 ``[B, H, T, S]``; each row sums to 1, or is all zeros if fully masked.
    """
    query, key, _, bias, mask = validated_attention_inputs(
        query, key, key, bias, mask, local_window, 0.0, None, global_tokens
    )
    bias = as_rank4("bias", bias, attention_logits_shape(query, key))
    full_mask = _full_mask(query, key, mask, is_causal, local_window, global_tokens)

    def softmax(q, bias, mask):
        return _softmax(q, key, bias, mask, default_scale(query, scale))

    probs = _per_query_group(softmax, query, key.shape[2], 2, bias, full_mask)
    return probs if full_mask is None else jnp.where(full_mask, probs, 0.0)


def xla_attention(
    query,
    key,
    value,
    bias,
    mask,
    *,
    scale,
    is_causal,
    local_window,
    dropout_rate,
    dropout_rng,
    global_tokens=0,
):
    """:func:`reference_attention` optimised, on validated inputs, with dropout.

    The same values in another order of operations: causal or windowed masks split the queries
    into blocks, each against only the keys it can see (:func:`_query_blocks`); the G query heads
    of each key/value head are vmapped over rather than the keys and values repeated G times
    (:func:`_per_query_group`); and the softmax is divided out after the value product, on
    ``[.., T, Dv]`` instead of the ``[.., T, S]`` weights (:func:`_unnormalized_softmax`).
    """
    b, t, h, _ = query.shape
    s = key.shape[1]
    bias = as_rank4("bias", bias, attention_logits_shape(query, key))
    full_mask = _full_mask(query, key, mask, is_causal, local_window, global_tokens)
    keep = None
    if dropout_rate > 0.0:
        keep = dropout_keep(dropout_rng, dropout_rate, (b, h, t, s))
    scale = default_scale(query, scale)

    def attend(q, bias, mask, keep, *, key, value):
        weights, normalizer = _unnormalized_softmax(q, key, bias, mask, scale)
        if keep is not None:
            weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
        out = _float32_product("bhts,bhsd->bhtd", weights.astype(value.dtype), value.swapaxes(1, 2))
        return (out / normalizer).swapaxes(1, 2)

    outs = []
    for (q0, q1), key_ranges in _query_blocks(t, s, is_causal, local_window, global_tokens):
        logit_blocks = [_logit_block(x, q0, q1, key_ranges) for x in (bias, full_mask, keep)]
        block_key, block_value = (_key_block(x, key_ranges) for x in (key, value))
        attend_block = functools.partial(attend, key=block_key, value=block_value)
        outs.append(_per_query_group(attend_block, query[:, q0:q1], key.shape[2], 3, *logit_blocks))
    out = jnp.concatenate(outs, axis=1)
    # Only a user mask, or a causal/window mask with more queries than keys, can leave a row
    # without any visible key. Such rows are zeroed on the output, which is cheaper than on the
    # [T, S] weights and blocks their gradient just the same.
    if full_mask is not None and (mask is not None or t > s):
        row_has_key = jnp.moveaxis(jnp.any(full_mask, axis=-1), 1, 2)[..., None]  # [B, T, H, 1]
        out = jnp.where(row_has_key, out, 0.0)
    return out.astype(query.dtype)


def _query_blocks(t, s, is_causal, local_window, global_tokens=0):
    """``[((q0, q1), key_ranges), ...]``: blocks of query rows and the ranges of keys each sees.

    One block (all T queries, all S keys) unless a causal or sliding-window mask hides keys and
    there are more than ``QUERY_BLOCK_ROWS`` queries; else blocks of ``QUERY_BLOCK_ROWS`` rows, or
    ``MAX_QUERY_BLOCKS`` equal blocks if that makes them larger. Positions are aligned as in
    :func:`structural_mask`: query ``i`` sits at ``i + S - T``. ``key_ranges`` is
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


def _full_mask(query, key, mask, is_causal, local_window, global_tokens=0):
    """The user's mask combined with the causal / window mask: rank-4 bool, or ``None``."""
    structural = structural_mask(
        query.shape[1], key.shape[1], is_causal, local_window, global_tokens
    )
    mask = combine_masks(mask, structural)
    return as_rank4("mask", mask, attention_logits_shape(query, key))


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


def _per_query_group(fn, query, num_kv_heads, out_axis, *logit_shaped):
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


def jax_nn_attention(
    query, key, value, bias, mask, *, scale, is_causal, local_window, implementation
):
    """Delegates to ``jax.nn.dot_product_attention`` with our conventions.

    ``jax.nn`` aligns causal and window masks top-left; callers pass ``T == S`` for those
    (see :func:`cudnn_unsupported_reason`). cuDNN takes biases and masks only at full
    ``[.., T, S]`` size and the bias in the input dtype, so both are broadcast and cast here.
    Rows whose keys are all masked are zeroed, since cuDNN leaves them undefined.
    """
    target = attention_logits_shape(query, key)

    def full_size(name, x):
        x = as_rank4(name, x, target)
        return None if x is None else jnp.broadcast_to(x, x.shape[:2] + target[2:])

    bias = full_size("bias", bias)
    out = jax.nn.dot_product_attention(
        query,
        key,
        value,
        None if bias is None else bias.astype(query.dtype),
        full_size("mask", mask),
        scale=default_scale(query, scale),
        is_causal=is_causal,
        local_window_size=local_window,
        implementation=implementation,
    )
    if mask is not None:
        row_has_key = jnp.any(_full_mask(query, key, mask, is_causal, local_window), axis=-1)
        out = jnp.where(jnp.moveaxis(row_has_key, 1, 2)[..., None], out, 0)
    return out
