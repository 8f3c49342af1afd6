"""cuDNN flash attention through ``jax.nn.dot_product_attention`` (GPU only): the inputs it
takes (:func:`cudnn_unsupported_reason`) and the translation to ``jax.nn``'s conventions."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxformer_lite.ops.attention_inputs import (
    AttentionCall,
    as_rank4,
    attention_logits_shape,
    default_scale,
)
from flaxformer_lite.ops.attention_mask import AttentionMask


def cudnn_unsupported_reason(call: AttentionCall) -> str | None:
    """Why cuDNN flash attention cannot run ``call``, or ``None`` if it can."""
    query, key, value, mask = call.query, call.key, call.value, call.mask
    head_dim, value_dim = query.shape[-1], value.shape[-1]
    windowed = mask.is_causal or mask.local_window is not None
    has_mask = mask.explicit is not None or mask.segment_ids is not None
    if call.platform != "gpu":
        return f"needs a GPU, the backend is {call.platform!r}"
    if query.dtype not in (jnp.bfloat16, jnp.float16):
        return f"needs bfloat16 or float16 inputs, got {query.dtype}"
    if not query.dtype == key.dtype == value.dtype:
        return f"needs equal dtypes, got {query.dtype}, {key.dtype}, {value.dtype}"
    if head_dim != value_dim or head_dim > 128 or head_dim % 8:
        return f"needs equal head dims <= 128 divisible by 8, got {head_dim}, {value_dim}"
    if call.dropout_rate > 0.0:
        return "attention dropout is not supported"
    if mask.global_tokens:
        return "global tokens are not supported"
    if windowed and query.shape[1] != key.shape[1]:
        return "causal or windowed masks with T != S align differently in cuDNN"
    if mask.local_window is not None and mask.local_window[1] != 0 and not mask.is_causal:
        return f"a right window needs is_causal, got local_window={mask.local_window}"
    if (call.bias is not None or has_mask) and (query.shape[1] % 2 or key.shape[1] % 2):
        return f"a bias or mask needs even lengths, got T={query.shape[1]}, S={key.shape[1]}"
    return None


def cudnn_attention(call: AttentionCall) -> jax.Array:
    """``[B, T, H, Dv]``: cuDNN's attention of a ``call`` it supports."""
    args, flags = call.arguments()
    return jax_nn_attention(*args, **flags, implementation="cudnn")


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
        pieces = AttentionMask(is_causal, local_window, explicit=mask)
        full_mask = as_rank4("mask", pieces.dense(query.shape[1], key.shape[1]), target)
        row_has_key = jnp.any(full_mask, axis=-1)
        out = jnp.where(jnp.moveaxis(row_has_key, 1, 2)[..., None], out, 0)
    return out
