"""Normalization functions: LayerNorm and RMSNorm over the last (feature) axis.

Both compute their statistics in float32 whatever the input dtype: a bfloat16 mean or variance
loses most of its digits (8 mantissa bits), which matters most exactly when activations are large.
The result is cast back to the input dtype so the surrounding computation keeps its precision
policy. Parameters (`scale`, `bias`) are applied in float32 before that cast.
"""

import jax
import jax.numpy as jnp


def _check_feature_param(name: str, param: jax.Array, x: jax.Array) -> None:
    """Raises ValueError unless `param` has shape `[x.shape[-1]]`."""
    if jnp.shape(param) != (x.shape[-1],):
        raise ValueError(
            f"{name} must have shape ({x.shape[-1]},) to match the last axis of x "
            f"with shape {x.shape}; got {name} with shape {jnp.shape(param)}"
        )


def layer_norm(
    x: jax.Array,
    scale: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    eps: float = 1e-5,
) -> jax.Array:
    """Layer normalization (Ba et al., 2016) over the last axis.

    `y = (x - mean) / sqrt(var + eps) * scale + bias`, with mean and (biased) variance taken over
    the last axis in float32.

    Args:
      x: `[..., D]` input, any float dtype.
      scale: optional `[D]` multiplicative parameter (any float dtype); omitted means 1.
      bias: optional `[D]` additive parameter (any float dtype); omitted means 0.
      eps: small constant added to the variance; keeps constant rows finite (they map to 0, or to
        `bias`).

    Returns:
      `[..., D]` array with the dtype of `x`.

    Raises:
      ValueError: if `scale` or `bias` is not of shape `[D]`.
    """
    x = jnp.asarray(x)
    if scale is not None:
        _check_feature_param("scale", scale, x)
    if bias is not None:
        _check_feature_param("bias", bias, x)
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    centered = x32 - mean
    # Two-pass variance, E[(x - mean)^2]: the one-pass E[x^2] - mean^2 cancels catastrophically when
    # |mean| >> std (e.g. 1000 + noise loses every digit of the variance in float32).
    var = jnp.mean(jnp.square(centered), axis=-1, keepdims=True)
    y = centered * jax.lax.rsqrt(var + eps)
    if scale is not None:
        y = y * jnp.asarray(scale, jnp.float32)
    if bias is not None:
        y = y + jnp.asarray(bias, jnp.float32)
    return y.astype(x.dtype)


def rms_norm(
    x: jax.Array,
    scale: jax.Array | None = None,
    *,
    eps: float = 1e-6,
) -> jax.Array:
    """Root-mean-square normalization (Zhang & Sennrich, 2019), as in T5 and LLaMA.

    `y = x / sqrt(mean(x^2) + eps) * scale`, with no mean subtraction and no bias.

    Precision: the statistic, the division and the multiplication by `scale` all happen in float32
    and only the final result is cast to `x.dtype`. Hugging Face's `LlamaRMSNorm` instead casts the
    normalized activations back to the input dtype first and multiplies by the weight afterwards;
    for bfloat16 inputs the two differ by one bfloat16 rounding (about 2^-8 relative).

    Args:
      x: `[..., D]` input, any float dtype.
      scale: optional `[D]` multiplicative parameter (any float dtype); omitted means 1.
      eps: small constant added to the mean square; keeps all-zero rows finite (they map to 0).

    Returns:
      `[..., D]` array with the dtype of `x`.

    Raises:
      ValueError: if `scale` is not of shape `[D]`.
    """
    x = jnp.asarray(x)
    if scale is not None:
        _check_feature_param("scale", scale, x)
    x32 = x.astype(jnp.float32)
    mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    y = x32 * jax.lax.rsqrt(mean_square + eps)
    if scale is not None:
        y = y * jnp.asarray(scale, jnp.float32)
    return y.astype(x.dtype)
