"""Normalization functions: LayerNorm and RMSNorm over the last (feature) axis.

Both compute their statistics in float32 whatever the input dtype: a bfloat16 mean or variance
loses most of its digits (8 mantissa bits), which matters most exactly when activations are large.
The result is cast back to the input dtype so the surrounding computation keeps its precision
policy. Parameters (``scale``, ``bias``) are applied in float32 before that cast.
"""

import functools

import jax
import jax.numpy as jnp


def _check_feature_param(name: str, param: jax.Array, x: jax.Array) -> None:
    """Raises ValueError unless ``param`` has shape ``[x.shape[-1]]``."""
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

    ``y = (x - mean) / sqrt(var + eps) * scale + bias``, with mean and (biased) variance taken
    over the last axis in float32. The gradient is the closed form (``_layer_norm_backward``), a
    custom VJP (see the conventions in :mod:`flaxformer_lite.ops`).

    Args:
      x: ``[..., D]`` input, any float dtype.
      scale: optional ``[D]`` multiplicative parameter (any float dtype); omitted means 1.
      bias: optional ``[D]`` additive parameter (any float dtype); omitted means 0.
      eps: small constant added to the variance; keeps constant rows finite (they map to 0, or to
        ``bias``).

    Returns:
      ``[..., D]`` array with the dtype of ``x``.

    Raises:
      ValueError: if ``scale`` or ``bias`` is not of shape ``[D]``.
    """
    x = jnp.asarray(x)
    if scale is not None:
        _check_feature_param("scale", scale, x)
        scale = jnp.asarray(scale)
    if bias is not None:
        _check_feature_param("bias", bias, x)
        bias = jnp.asarray(bias)
    return _layer_norm(x, scale, bias, eps)


def _layer_norm_forward(x, scale, bias, eps):
    """The output and the residuals of the backward pass: ``x`` and float32 ``mean``, ``rstd``
    ``[..., 1]``."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    centered = x32 - mean
    # Two-pass variance, E[(x - mean)^2]: the one-pass E[x^2] - mean^2 cancels catastrophically
    # when |mean| >> std (1000 + noise loses every digit of the variance in float32).
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(centered), axis=-1, keepdims=True) + eps)
    y = centered * rstd
    if scale is not None:
        y = y * scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype), (x, mean, rstd, scale, bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm(x, scale, bias, eps):
    return _layer_norm_forward(x, scale, bias, eps)[0]


def _layer_norm_backward(eps, residuals, g):
    """The closed-form gradient, with ``x̂ = (x - mean) * rstd`` and ``ĝ = g * scale``:

        dx = rstd * (ĝ - mean(ĝ) - x̂ * mean(ĝ * x̂)),  dscale = Σ g * x̂,  dbias = Σ g.

    Autodiff reaches the same values through the two-pass variance's chain of means and
    differences. XLA recomputes a pre-LN Transformer's residual gradient inside each consumer,
    with every later layer's LayerNorm backward in it, so the shorter formula's saving counts many
    times over.
    """
    x, mean, rstd, scale, bias = residuals
    g32 = g.astype(jnp.float32)
    x_hat = (x.astype(jnp.float32) - mean) * rstd
    g_hat = g32 if scale is None else g32 * scale.astype(jnp.float32)
    dx = rstd * (
        g_hat
        - jnp.mean(g_hat, axis=-1, keepdims=True)
        - x_hat * jnp.mean(g_hat * x_hat, axis=-1, keepdims=True)
    )
    tokens = tuple(range(x.ndim - 1))
    dscale = None if scale is None else jnp.sum(g32 * x_hat, axis=tokens).astype(scale.dtype)
    dbias = None if bias is None else jnp.sum(g32, axis=tokens).astype(bias.dtype)
    return dx.astype(x.dtype), dscale, dbias


_layer_norm.defvjp(_layer_norm_forward, _layer_norm_backward)


def rms_norm(
    x: jax.Array,
    scale: jax.Array | None = None,
    *,
    eps: float = 1e-6,
) -> jax.Array:
    """Root-mean-square normalization (Zhang & Sennrich, 2019), as in T5 and LLaMA.

    ``y = x / sqrt(mean(x^2) + eps) * scale``, with no mean subtraction and no bias.

    Precision: the statistic, the division and the multiplication by ``scale`` happen in float32
    and only the result is cast to ``x.dtype``. Hugging Face's ``LlamaRMSNorm`` casts before the
    multiplication by the weight: for bfloat16 the two differ by one rounding (2^-8 relative).

    Args:
      x: ``[..., D]`` input, any float dtype.
      scale: optional ``[D]`` multiplicative parameter (any float dtype); omitted means 1.
      eps: small constant added to the mean square; keeps all-zero rows finite (they map to 0).

    Returns:
      ``[..., D]`` array with the dtype of ``x``.

    Raises:
      ValueError: if ``scale`` is not of shape ``[D]``.
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
