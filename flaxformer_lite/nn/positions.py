"""Position-dependent attention biases shared by all layers of a stack: T5's learned relative
position buckets and ALiBi's fixed linear penalties. The math is in ``ops.positions``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flaxformer_lite import ops
from flaxformer_lite.nn.dense import XAVIER, KernelInit
from flaxformer_lite.nn.embed import Embed


class RelativePositionBias(nnx.Module):
    """T5's relative position bias: one learned scalar per (bucket of ``k - q``, head).

    Args:
      num_heads: H.
      num_buckets, max_distance: see ``ops.relative_position_buckets``.
      bidirectional: True for encoders, False for causal decoders.
    """

    def __init__(
        self,
        num_heads: int,
        *,
        num_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool,
        init: KernelInit = XAVIER,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.bidirectional = bidirectional
        self.table = Embed(
            num_buckets,
            num_heads,
            names=("relpos_buckets", "heads"),
            init=init,
            dtype=jnp.float32,
            param_dtype=param_dtype,
            rngs=rngs,
        )

    def __call__(self, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
        """Query positions ``[T]`` / ``[B, T]`` and key positions ``[S]`` / ``[B, S]`` -> bias
        ``[1 or B, H, T, S]`` float32."""
        buckets = ops.relative_position_buckets(
            q_positions,
            k_positions,
            bidirectional=self.bidirectional,
            num_buckets=self.num_buckets,
            max_distance=self.max_distance,
        )
        bias = jnp.moveaxis(self.table(buckets), -1, -3)  # [..., T, S, H] -> [..., H, T, S]
        return bias if bias.ndim == 4 else bias[None]


class ALiBi(nnx.Module):
    """ALiBi's fixed linear penalties (Press et al. 2022), a module without parameters called as
    :class:`RelativePositionBias` is: the position bias of ``positions=alibi``.

    Args:
      num_heads: H; each head has its own slope (``ops.alibi_slopes``).
    """

    def __init__(self, num_heads: int):
        self.num_heads = num_heads

    def __call__(self, q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
        """Query positions ``[T]`` and key positions ``[S]`` -> bias ``[1, H, T, S]`` float32."""
        return ops.positions.alibi_bias_at(self.num_heads, q_positions, k_positions)[None]
