"""Scaled dot-product attention, softmax(q kᵀ · scale + bias) v, with masks and three backends.

Shapes (same layout as ``jax.nn.dot_product_attention``):
  query ``[B, Tq, Hq, D]``, key ``[B, Tk, Hk, D]``, value ``[B, Tk, Hk, Dv]``, output
  ``[B, Tq, Hq, Dv]``. ``bias`` (additive, float) and ``mask`` (bool, True = may attend) broadcast
  to ``[B, Hq, Tq, Tk]``. Grouped-query attention: ``Hq`` is a multiple of ``Hk`` and query head
  ``n`` uses key/value head ``n // (Hq // Hk)``; ``Hk == 1`` is multi-query attention.

Numerics: logits, softmax and accumulation are float32 whatever the input dtype; the output has
the query's dtype. A query row whose keys are all masked returns zeros, never NaN.

Implementations:
  ``"xla"``      the reference: two einsums around a float32 softmax; O(Tq·Tk) memory.
  ``"chunked"``  memory-efficient online-softmax attention (see ``chunked_attention``); O(T)
                 memory in the forward and backward pass.
  ``"cudnn"``    cuDNN flash attention through ``jax.nn.dot_product_attention`` (GPU only).
  ``None``       the best one that supports the backend, shapes and features; the reason for
                 the choice is logged (logger ``flaxformer_lite.ops.attention``, at trace time).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from flaxformer_lite.ops.attention_inputs import (
    as_rank4,
    attention_logits_shape,
    check_attention_inputs,
    default_scale,
    dropout_keep,
    group_heads,
    structural_mask,
)
from flaxformer_lite.ops.chunked_attention import chunked_attention
from flaxformer_lite.ops.masks import combine_masks

logger = logging.getLogger(__name__)

IMPLEMENTATIONS = ("xla", "chunked", "cudnn")

# Above this many float32 logits per call ([B, Hq, Tq, Tk] elements) the automatic choice on
# CPU/TPU is "chunked": the O(T²) buffers of "xla" stop fitting in cache and memory (see
# benchmarks/attention.py for the measured crossover).
CHUNKED_MIN_LOGITS = 8 * 2048 * 2048


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
      implementation: ``"xla"``, ``"chunked"``, ``"cudnn"`` or ``None`` (automatic).

    Returns:
      ``[B, Tq, Hq, Dv]`` in the query's dtype.

    Raises:
      ValueError: on wrong ranks, mismatched shapes, ``Hq % Hk != 0``, masks or biases that do
        not broadcast, a non-boolean mask, or an implementation that cannot run these inputs.
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    bias = None if bias is None else jnp.asarray(bias)
    mask = None if mask is None else jnp.asarray(mask)
    check_attention_inputs(query, key, value, bias, mask, local_window, dropout_rate, dropout_rng)
    kwargs = dict(
        scale=scale,
        is_causal=is_causal,
        local_window=local_window,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
    )
    if implementation is None:
        implementation = select_implementation(
            query,
            key,
            value,
            is_causal=is_causal,
            local_window=local_window,
            dropout_rate=dropout_rate,
        )
    if implementation == "xla":
        return xla_attention(query, key, value, bias, mask, **kwargs)
    if implementation == "chunked":
        return chunked_attention(query, key, value, bias, mask, **kwargs)
    if implementation == "cudnn":
        reason = cudnn_unsupported_reason(query, key, value, is_causal, local_window, dropout_rate)
        if reason:
            raise ValueError(f'implementation="cudnn" cannot run these inputs: {reason}')
        kwargs.pop("dropout_rate"), kwargs.pop("dropout_rng")
        return jax_nn_attention(query, key, value, bias, mask, implementation="cudnn", **kwargs)
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
    query, key = jnp.asarray(query), jnp.asarray(key)
    bias = None if bias is None else jnp.asarray(bias)
    mask = None if mask is None else jnp.asarray(mask)
    check_attention_inputs(query, key, key, bias, mask, local_window, 0.0, None)
    probs = _grouped_probs(query, key, bias, mask, scale, is_causal, local_window)
    return probs.reshape(attention_logits_shape(query, key))


def xla_attention(
    query, key, value, bias, mask, *, scale, is_causal, local_window, dropout_rate, dropout_rng
):
    """The einsum reference implementation; inputs already validated. See module docstring."""
    probs = _grouped_probs(query, key, bias, mask, scale, is_causal, local_window)
    if dropout_rate > 0.0:
        keep = dropout_keep(dropout_rng, dropout_rate, probs.shape)
        probs = jnp.where(keep, probs / (1.0 - dropout_rate), 0.0)
    out = jnp.einsum(
        "bhgqk,bkhd->bqhgd", probs.astype(value.dtype), value, preferred_element_type=jnp.float32
    )
    b, tq, hk, g, dv = out.shape
    return out.reshape(b, tq, hk * g, dv).astype(query.dtype)


def _grouped_probs(query, key, bias, mask, scale, is_causal, local_window):
    """float32 softmax probabilities ``[B, Hk, G, Tq, Tk]`` with masked entries exactly zero."""
    b, tq, hq, d = query.shape
    tk, hk = key.shape[1], key.shape[2]
    target = attention_logits_shape(query, key)
    q = query.reshape(b, tq, hk, hq // hk, d)
    logits = jnp.einsum("bqhgd,bkhd->bhgqk", q, key, preferred_element_type=jnp.float32)
    logits = logits * default_scale(query, scale)
    if bias is not None:
        logits = logits + group_heads(as_rank4("bias", bias, target), hk).astype(jnp.float32)
    mask = combine_masks(mask, structural_mask(tq, tk, is_causal, local_window))
    if mask is None:
        return jax.nn.softmax(logits, axis=-1)
    mask = group_heads(as_rank4("mask", mask, target), hk)
    # A finite fill keeps fully masked rows NaN-free; zeroing afterwards makes them exactly 0.
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    return jnp.where(mask, jax.nn.softmax(logits, axis=-1), 0.0)


def jax_nn_attention(
    query, key, value, bias, mask, *, scale, is_causal, local_window, implementation
):
    """Delegates to ``jax.nn.dot_product_attention`` with our conventions.

    ``jax.nn`` aligns causal and window masks top-left; callers pass ``Tq == Tk`` for those
    (see :func:`cudnn_unsupported_reason`). Rows whose keys are all masked by ``mask`` are
    zeroed here, since cuDNN leaves them undefined.
    """
    out = jax.nn.dot_product_attention(
        query,
        key,
        value,
        bias,
        None if mask is None else as_rank4("mask", mask, attention_logits_shape(query, key)),
        scale=default_scale(query, scale),
        is_causal=is_causal,
        local_window_size=local_window,
        implementation=implementation,
    )
    if mask is not None:
        mask = combine_masks(
            mask, structural_mask(query.shape[1], key.shape[1], is_causal, local_window)
        )
        row_has_key = jnp.any(as_rank4("mask", mask, attention_logits_shape(query, key)), axis=-1)
        out = jnp.where(jnp.transpose(row_has_key, (0, 2, 1))[..., None], out, 0)
    return out


def cudnn_unsupported_reason(query, key, value, is_causal, local_window, dropout_rate) -> str:
    """Why cuDNN flash attention cannot run these inputs, or ``""`` if it can."""
    if jax.default_backend() != "gpu":
        return f"needs a GPU, the backend is {jax.default_backend()!r}"
    if query.dtype not in (jnp.bfloat16, jnp.float16):
        return f"needs bfloat16 or float16 inputs, got {query.dtype}"
    if not query.dtype == key.dtype == value.dtype:
        return f"needs equal dtypes, got {query.dtype}, {key.dtype}, {value.dtype}"
    if query.shape[-1] != value.shape[-1] or query.shape[-1] > 128 or query.shape[-1] % 8:
        return (
            f"needs equal head dims <= 128 divisible by 8, got {query.shape[-1]}, {value.shape[-1]}"
        )
    if dropout_rate > 0.0:
        return "attention dropout is not supported"
    if (is_causal or local_window is not None) and query.shape[1] != key.shape[1]:
        return "causal or windowed masks with Tq != Tk align differently in cuDNN"
    if local_window is not None and local_window[1] != 0 and not is_causal:
        return f"a right window needs is_causal, got local_window={local_window}"
    return ""


def select_implementation(query, key, value, *, is_causal, local_window, dropout_rate) -> str:
    """The automatic choice: cuDNN where it runs, else "chunked" for large logits, else "xla"."""
    reason = cudnn_unsupported_reason(query, key, value, is_causal, local_window, dropout_rate)
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
