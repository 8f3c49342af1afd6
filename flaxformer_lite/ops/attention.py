"""Scaled dot-product attention, softmax(q kᵀ · scale + bias) v, with masks and three backends.

Shapes (same layout as ``jax.nn.dot_product_attention``):
  query ``[B, Tq, Hq, D]``, key ``[B, Tk, Hk, D]``, value ``[B, Tk, Hk, Dv]``, output
  ``[B, Tq, Hq, Dv]``. ``bias`` (additive, float) and ``mask`` (bool, True = may attend) broadcast
  to ``[B, Hq, Tq, Tk]``. Grouped-query attention: ``Hq`` is a multiple of ``Hk`` and query head
  ``n`` uses key/value head ``n // (Hq // Hk)``; ``Hk == 1`` is multi-query attention.

Numerics: logits, softmax and accumulation are float32 whatever the input dtype; the output has
the query's dtype. A query row whose keys are all masked returns zeros, never NaN.

Implementations:
  ``"xla"``      the reference: two einsums around a float32 softmax; O(Tq·Tk) memory. Causal
                 and windowed masks are applied per block of queries against only the keys
                 the block can see (``QUERY_BLOCK_ROWS``).
  ``"chunked"``  memory-efficient online-softmax attention (see ``chunked_attention``); O(T)
                 memory in the forward and backward pass.
  ``"cudnn"``    cuDNN flash attention through ``jax.nn.dot_product_attention`` (GPU only).
  ``None``       the best one that supports the backend, shapes and features; the reason for
                 the choice is logged (logger ``flaxformer_lite.ops.attention``, at trace time).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from flaxformer_lite.ops.attention_inputs import (
    MASK_VALUE,
    as_rank4,
    attention_logits_shape,
    default_scale,
    dropout_keep,
    structural_mask,
    validated_attention_inputs,
)
from flaxformer_lite.ops.chunked_attention import chunked_attention
from flaxformer_lite.ops.masks import combine_masks

logger = logging.getLogger(__name__)

IMPLEMENTATIONS = ("xla", "chunked", "cudnn")

# Above this many float32 logits per call ([B, Hq, Tq, Tk] elements) the automatic choice on
# CPU/TPU is "chunked": the O(T²) buffers of "xla" grow past hundreds of MiB, while "chunked"
# stays O(T) for a little more time (benchmarks/attention.py, forward and backward: 1.26x
# "xla"'s time at T = 2048, 1.15x at 8192).
CHUNKED_MIN_LOGITS = 8 * 2048 * 2048

# "xla" computes causal or windowed attention over more queries than this in blocks of this many
# query rows, each against only the keys its rows can see, skipping the hidden part of the
# logits (a quarter of them for a causal mask at T = 256, nearly half at T = 1024). One pre-LN
# layer's forward and backward on CPU: 1.2x faster at T = 256, 1.35x at T = 1024; blocks of 64
# rows were slower at T = 256, 256 rows no better at T = 1024 (benchmarks/train_step.py for the
# whole step). Longer queries use larger blocks, at most MAX_QUERY_BLOCKS of them, so that the
# program (each block is its own pair of matmuls) stays small.
QUERY_BLOCK_ROWS = 128
MAX_QUERY_BLOCKS = 8


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    local_window: tuple[int, int] | None = None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    implementation: str | None = None,
):
    """Multi-head scaled dot-product attention.

    Args:
      query: ``[B, Tq, Hq, D]``.
      key: ``[B, Tk, Hk, D]`` with ``Hq % Hk == 0``.
      value: ``[B, Tk, Hk, Dv]``.
      bias: optional additive float bias broadcastable to ``[B, Hq, Tq, Tk]`` (relative
        positions, ALiBi). Use ``mask`` rather than ``-inf`` biases to forbid positions.
      mask: optional bool, broadcastable to ``[B, Hq, Tq, Tk]``, True = may attend.
      scale: multiplier of the logits; defaults to ``1 / sqrt(D)``.
      is_causal: query ``i`` attends keys ``j <= i + (Tk - Tq)``: with ``Tq != Tk`` the last
        query is aligned with the last key, as when decoding against a KV cache.
      local_window: ``(left, right)``: each query attends only keys at most ``left`` positions
        before and ``right`` after its own position (positions aligned as for ``is_causal``).
      dropout_rate: dropout probability on the attention weights ("xla" and "chunked").
      dropout_rng: PRNG key, required when ``dropout_rate > 0``.
      implementation: ``"xla"``, ``"chunked"``, ``"cudnn"`` or ``None`` (automatic). The
        dropout keep-mask drawn from one ``dropout_rng`` differs between implementations.
        "chunked" has a custom VJP: forward-mode autodiff (``jax.jvp``) needs "xla".

    Returns:
      ``[B, Tq, Hq, Dv]`` in the query's dtype.

    Raises:
      ValueError: on wrong ranks, mismatched shapes, ``Hq % Hk != 0``, masks or biases that do
        not broadcast, a non-boolean mask, or an implementation that cannot run these inputs.
    """
    query, key, value, bias, mask = validated_attention_inputs(
        query, key, value, bias, mask, local_window, dropout_rate, dropout_rng
    )
    geometry = dict(scale=scale, is_causal=is_causal, local_window=local_window)
    dropout = dict(dropout_rate=dropout_rate, dropout_rng=dropout_rng)
    if implementation is None:
        implementation = select_implementation(
            query,
            key,
            value,
            bias,
            mask,
            is_causal=is_causal,
            local_window=local_window,
            dropout_rate=dropout_rate,
        )
    if implementation == "xla":
        return xla_attention(query, key, value, bias, mask, **geometry, **dropout)
    if implementation == "chunked":
        return chunked_attention(query, key, value, bias, mask, **geometry, **dropout)
    if implementation == "cudnn":
        reason = cudnn_unsupported_reason(
            query,
            key,
            value,
            bias,
            mask,
            is_causal=is_causal,
            local_window=local_window,
            dropout_rate=dropout_rate,
        )
        if reason:
            raise ValueError(f'implementation="cudnn" cannot run these inputs: {reason}')
        return jax_nn_attention(query, key, value, bias, mask, **geometry, implementation="cudnn")
    raise ValueError(
        f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}"
    )


def attention_weights(
    query,
    key,
    bias=None,
    mask=None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    local_window: tuple[int, int] | None = None,
):
    """The attention probabilities softmax(q kᵀ · scale + bias), for inspection and plots.

    Args: as :func:`dot_product_attention` (query ``[B, Tq, Hq, D]``, key ``[B, Tk, Hk, D]``).

    Returns:
      float32 ``[B, Hq, Tq, Tk]``; each row sums to 1, or is all zeros if fully masked.
    """
    query, key, _, bias, mask = validated_attention_inputs(
        query, key, key, bias, mask, local_window, 0.0, None
    )
    bias = as_rank4("bias", bias, attention_logits_shape(query, key))
    full_mask = _full_mask(query, key, mask, is_causal, local_window)

    def softmax(q, bias, mask):
        return _softmax(q, key, bias, mask, default_scale(query, scale))

    probs = _per_query_group(softmax, query, key.shape[2], 2, bias, full_mask)
    return probs if full_mask is None else jnp.where(full_mask, probs, 0.0)


def xla_attention(
    query, key, value, bias, mask, *, scale, is_causal, local_window, dropout_rate, dropout_rng
):
    """The einsum reference implementation; inputs already validated. See module docstring."""
    b, q_len, num_heads, _ = query.shape
    kv_len = key.shape[1]
    bias = as_rank4("bias", bias, attention_logits_shape(query, key))
    full_mask = _full_mask(query, key, mask, is_causal, local_window)
    keep = None
    if dropout_rate > 0.0:
        keep = dropout_keep(dropout_rng, dropout_rate, (b, num_heads, q_len, kv_len))
    scale = default_scale(query, scale)

    def attend(q, bias, mask, keep, *, key, value):
        weights, normalizer = _unnormalized_softmax(q, key, bias, mask, scale)
        if keep is not None:
            weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
        out = jnp.einsum(
            "bhqk,bhkd->bhqd",
            weights.astype(value.dtype),
            value.swapaxes(1, 2),
            preferred_element_type=jnp.float32,
        )
        return (out / normalizer).swapaxes(1, 2)

    outs = []
    for (q0, q1), (k0, k1) in _query_blocks(q_len, kv_len, is_causal, local_window):
        logit_blocks = [_logit_block(x, q0, q1, k0, k1) for x in (bias, full_mask, keep)]
        attend_block = functools.partial(attend, key=key[:, k0:k1], value=value[:, k0:k1])
        outs.append(_per_query_group(attend_block, query[:, q0:q1], key.shape[2], 3, *logit_blocks))
    out = jnp.concatenate(outs, axis=1)
    # Only a user mask, or a causal/window mask with more queries than keys, can leave a row
    # without any visible key. Such rows are zeroed on the output, which is cheaper than on the
    # [Tq, Tk] weights and blocks their gradient just the same.
    if full_mask is not None and (mask is not None or q_len > kv_len):
        row_has_key = jnp.moveaxis(jnp.any(full_mask, axis=-1), 1, 2)[..., None]  # [b, Tq, h, 1]
        out = jnp.where(row_has_key, out, 0.0)
    return out.astype(query.dtype)


def _query_blocks(q_len, kv_len, is_causal, local_window):
    """``[((q0, q1), (k0, k1)), ...]``: blocks of query rows and the range of keys each can see.

    One block (all queries, all keys) unless a causal or sliding-window mask hides keys and
    there are more than ``QUERY_BLOCK_ROWS`` queries; else blocks of ``QUERY_BLOCK_ROWS`` rows, or
    ``MAX_QUERY_BLOCKS`` equal blocks if that makes them larger. Positions are aligned as in
    :func:`structural_mask`: query ``i`` sits at ``i + kv_len - q_len``.
    """
    left, right = local_window if local_window is not None else (None, None)
    if is_causal:
        right = 0
    if (left is None and right is None) or q_len <= QUERY_BLOCK_ROWS:
        return [((0, q_len), (0, kv_len))]
    offset = kv_len - q_len
    rows = max(QUERY_BLOCK_ROWS, -(-q_len // MAX_QUERY_BLOCKS))
    blocks = []
    for q0 in range(0, q_len, rows):
        q1 = min(q0 + rows, q_len)
        k0 = 0 if left is None else max(q0 + offset - left, 0)
        k1 = kv_len if right is None else min(q1 + offset + right, kv_len)
        # With more queries than keys a block may see no key at all: it keeps one (masked) and
        # its rows are zeroed like every row without a key.
        blocks.append(((q0, q1), (k0, max(k1, k0 + 1))))
    return blocks


def _logit_block(x, q0, q1, k0, k1):
    """Rows ``q0:q1`` and columns ``k0:k1`` of a rank-4 logit-shaped array (broadcast axes kept)."""
    if x is None:
        return None
    rows = slice(q0, q1) if x.shape[2] > 1 else slice(None)
    cols = slice(k0, k1) if x.shape[3] > 1 else slice(None)
    return x[:, :, rows, cols]


def _full_mask(query, key, mask, is_causal, local_window):
    """The user's mask combined with the causal / window mask: rank-4 bool, or ``None``."""
    structural = structural_mask(query.shape[1], key.shape[1], is_causal, local_window)
    mask = combine_masks(mask, structural)
    return as_rank4("mask", mask, attention_logits_shape(query, key))


def _logits(query, key, bias, mask, scale):
    """float32 masked logits q kᵀ · scale + bias ``[B, Hk, Tq, Tk]`` for query ``[B, Tq, Hk, D]``.

    Masked logits get a finite fill, so a fully masked row is uniform rather than NaN; callers
    zero such rows.
    """
    # Heads moved ahead of positions: every (b, h) product is then a contiguous GEMM, which on
    # CPU runs the attention forward and backward about 17% faster than strided "bqhd" operands.
    logits = jnp.einsum(
        "bhqd,bhkd->bhqk",
        query.swapaxes(1, 2),
        key.swapaxes(1, 2),
        preferred_element_type=jnp.float32,
    )
    logits = logits * scale
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    if mask is not None:
        logits = jnp.where(mask, logits, MASK_VALUE)
    return logits


def _softmax(query, key, bias, mask, scale):
    """float32 softmax of :func:`_logits` ``[B, Hk, Tq, Tk]``."""
    return jax.nn.softmax(_logits(query, key, bias, mask, scale), axis=-1)


def _unnormalized_softmax(query, key, bias, mask, scale):
    """``(exp(logits - max), sum)``: the softmax before its division, ``[B, Hk, Tq, Tk]``, and
    its row sums ``[B, Hk, Tq, 1]``.

    Dividing the ``[.., Tq, Dv]`` attention output by the sums instead of the ``[.., Tq, Tk]``
    weights saves a pass over the weights, and in the backward pass the broadcast quotient that
    autodiff of ``jax.nn.softmax`` materializes at ``[B, Hk, Tq, Tk]``.
    """
    logits = _logits(query, key, bias, mask, scale)
    weights = jnp.exp(logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True)))
    return weights, jnp.sum(weights, axis=-1, keepdims=True)


def _per_query_group(fn, query, num_kv_heads, out_axis, *logit_shaped):
    """Runs ``fn`` once per query head of each key/value group (vmap), merging the results.

    ``fn(q [B, Tq, Hk, D], *xs)`` receives one of the G = Hq / Hk query heads of every key/value
    head and the matching slice of each ``[b, h, tq, tk]`` array in ``logit_shaped`` (arrays with
    ``h == 1`` and ``None`` are passed whole). Its head axis ``out_axis`` (of size Hk) becomes the
    Hq axis of the result. Measured on CPU this beats both a 5-D grouped einsum and repeating the
    keys and values G times.
    """
    b, q_len, num_heads, head_dim = query.shape
    group = num_heads // num_kv_heads
    if group == 1:
        return fn(query, *logit_shaped)
    args, in_axes = [query.reshape(b, q_len, num_kv_heads, group, head_dim)], [3]
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

    ``jax.nn`` aligns causal and window masks top-left; callers pass ``Tq == Tk`` for those
    (see :func:`cudnn_unsupported_reason`). cuDNN takes biases and masks only at full
    ``[.., Tq, Tk]`` size and the bias in the input dtype, so both are broadcast and cast here.
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


def cudnn_unsupported_reason(
    query, key, value, bias, mask, *, is_causal, local_window, dropout_rate, backend=None
) -> str:
    """Why cuDNN flash attention cannot run these inputs, or ``""`` if it can.

    ``backend`` defaults to ``jax.default_backend()``; tests pass ``"gpu"`` to check the rules.
    """
    backend = jax.default_backend() if backend is None else backend
    head_dim, value_dim = query.shape[-1], value.shape[-1]
    if backend != "gpu":
        return f"needs a GPU, the backend is {backend!r}"
    if query.dtype not in (jnp.bfloat16, jnp.float16):
        return f"needs bfloat16 or float16 inputs, got {query.dtype}"
    if not query.dtype == key.dtype == value.dtype:
        return f"needs equal dtypes, got {query.dtype}, {key.dtype}, {value.dtype}"
    if head_dim != value_dim or head_dim > 128 or head_dim % 8:
        return f"needs equal head dims <= 128 divisible by 8, got {head_dim}, {value_dim}"
    if dropout_rate > 0.0:
        return "attention dropout is not supported"
    if (is_causal or local_window is not None) and query.shape[1] != key.shape[1]:
        return "causal or windowed masks with Tq != Tk align differently in cuDNN"
    if local_window is not None and local_window[1] != 0 and not is_causal:
        return f"a right window needs is_causal, got local_window={local_window}"
    if (bias is not None or mask is not None) and (query.shape[1] % 2 or key.shape[1] % 2):
        return f"a bias or mask needs even lengths, got Tq={query.shape[1]}, Tk={key.shape[1]}"
    return ""


def select_implementation(
    query, key, value, bias=None, mask=None, *, is_causal, local_window, dropout_rate
) -> str:
    """The automatic choice: cuDNN where it runs, else "chunked" for large logits, else "xla"."""
    reason = cudnn_unsupported_reason(
        query,
        key,
        value,
        bias,
        mask,
        is_causal=is_causal,
        local_window=local_window,
        dropout_rate=dropout_rate,
    )
    if not reason:
        logger.debug("attention: cudnn")
        return "cudnn"
    if jax.default_backend() == "gpu":
        logger.info("attention: cuDNN not used (%s)", reason)
    b, tq, hq, _ = query.shape
    num_logits = b * hq * tq * key.shape[1]
    if num_logits >= CHUNKED_MIN_LOGITS:
        logger.debug("attention: chunked (%d logits >= %d)", num_logits, CHUNKED_MIN_LOGITS)
        return "chunked"
    logger.debug("attention: xla (%d logits < %d)", num_logits, CHUNKED_MIN_LOGITS)
    return "xla"
