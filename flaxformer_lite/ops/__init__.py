"""Pure, jit-/vmap-/grad-safe functions: the math of the library, written once.

Arrays use the ``[batch, length, heads, head_dim]`` layout of ``jax.nn.dot_product_attention``;
every docstring states shapes and dtypes. Masks are boolean, True = may attend.
"""

from flaxformer_lite.ops.attention import attention_weights, dot_product_attention
from flaxformer_lite.ops.chunked_attention import chunked_attention
from flaxformer_lite.ops.losses import cross_entropy
from flaxformer_lite.ops.masks import (
    causal_mask,
    combine_masks,
    local_window_mask,
    padding_mask,
    segment_mask,
)
from flaxformer_lite.ops.norms import layer_norm, rms_norm
from flaxformer_lite.ops.positions import (
    alibi_bias,
    alibi_slopes,
    relative_position_buckets,
    sinusoidal_positions,
)
from flaxformer_lite.ops.projection import project
from flaxformer_lite.ops.rope import RopeScaling, apply_rope, rope_frequencies

__all__ = [
    "RopeScaling",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "attention_weights",
    "causal_mask",
    "chunked_attention",
    "combine_masks",
    "cross_entropy",
    "dot_product_attention",
    "layer_norm",
    "local_window_mask",
    "padding_mask",
    "project",
    "relative_position_buckets",
    "rms_norm",
    "rope_frequencies",
    "segment_mask",
    "sinusoidal_positions",
]
