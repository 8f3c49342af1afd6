"""LayerNorm and RMSNorm modules: parameters here, the math in ``ops.norms``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flaxformer_lite import ops
from flaxformer_lite.nn.dense import param


class LayerNorm(nnx.Module):
    """Layer normalization over the last axis with a learned scale and (optionally) bias.

    Args:
      features: size D of the normalized axis.
      eps: added to the variance.
      use_bias: learn an additive bias (the paper, GPT-2 and BERT do).
      dtype: output dtype; statistics are float32 whatever it is.
    """

    def __init__(
        self,
        features: int,
        *,
        eps: float = 1e-5,
        use_bias: bool = True,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.eps, self.dtype = eps, dtype
        self.scale = param(rngs, nnx.initializers.ones, (features,), ("norm",), param_dtype)
        self.bias = (
            param(rngs, nnx.initializers.zeros, (features,), ("norm",), param_dtype)
            if use_bias
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[..., D] -> [..., D]`` in ``dtype``."""
        bias = None if self.bias is None else self.bias[...]
        return ops.layer_norm(x, self.scale[...], bias, eps=self.eps).astype(self.dtype)


class RMSNorm(nnx.Module):
    """Root-mean-square normalization over the last axis with a learned scale (T5, LLaMA).

    Args:
      features: size D of the normalized axis.
      eps: added to the mean square.
      dtype: output dtype; the statistic is float32 whatever it is.
    """

    def __init__(
        self,
        features: int,
        *,
        eps: float = 1e-6,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.eps, self.dtype = eps, dtype
        self.scale = param(rngs, nnx.initializers.ones, (features,), ("norm",), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[..., D] -> [..., D]`` in ``dtype``."""
        return ops.rms_norm(x, self.scale[...], eps=self.eps).astype(self.dtype)


NORMS = {"layernorm": LayerNorm, "rmsnorm": RMSNorm}


def make_norm(
    kind: str, features: int, *, eps: float, bias: bool = True, dtype, param_dtype, rngs: nnx.Rngs
):
    """A ``LayerNorm`` (with a bias if ``bias``) or ``RMSNorm`` (never one) by name."""
    if kind not in NORMS:
        raise ValueError(f"norm must be one of {tuple(NORMS)}, got {kind!r}")
    options = {"use_bias": bias} if kind == "layernorm" else {}
    return NORMS[kind](
        features, eps=eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs, **options
    )
