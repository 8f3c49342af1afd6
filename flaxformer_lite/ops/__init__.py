"""Pure, jit-, vmap- and grad-safe functions: the math of the library, written once.

Shape letters, used in every docstring and tensor name (shapes are written ``[B, T, H, Dh]``):

  B    batch
  T    sequence length; the query length where queries and keys differ (alias Tq)
  S    key/value length (alias Tk)
  D    d_model, the model width (never the head dimension)
  H    query heads (alias Hq)
  Hk   key/value heads; H is a multiple of Hk (grouped-query attention when Hk < H)
  Dh   head dimension
  Dv   value head dimension, where it may differ from Dh (attention only)
  F    MLP width (d_ff)
  V    vocabulary size
  L    layers

Conventions:

* Queries, keys and values are laid out ``[B, T, H, Dh]``, as in ``jax.nn.dot_product_attention``.
* Masks are boolean, True = may attend, broadcastable to ``[B, H, T, S]``. A query row whose keys
  are all masked yields zeros, never NaN.
* Softmax, normalization statistics and the loss compute in float32 whatever the input dtype;
  results come back in the input dtype (the loss as float32).
* ``project``, ``layer_norm`` and ``chunked_attention`` (so also ``dot_product_attention`` when it
  runs "chunked") have custom VJPs, so forward-mode autodiff (``jax.jvp``, ``jax.jacfwd``) does
  not go through them; reverse mode, ``jit`` and ``vmap`` do.
"""

from flaxformer_lite.ops.attention import (
    attention_weights,
    dot_product_attention,
    reference_attention,
)
from flaxformer_lite.ops.attention_choice import register_attention
from flaxformer_lite.ops.attention_free import aft
from flaxformer_lite.ops.attention_inputs import AttentionCall
from flaxformer_lite.ops.attention_mask import AttentionMask
from flaxformer_lite.ops.chunked_attention import chunked_attention
from flaxformer_lite.ops.losses import (
    chunked_cross_entropy,
    chunked_token_log_likelihood,
    cross_entropy,
    token_log_likelihood,
)
from flaxformer_lite.ops.masks import (
    causal_mask,
    combine_masks,
    global_tokens_mask,
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
    "AttentionCall",
    "AttentionMask",
    "RopeScaling",
    "aft",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "attention_weights",
    "causal_mask",
    "chunked_attention",
    "chunked_cross_entropy",
    "chunked_token_log_likelihood",
    "combine_masks",
    "cross_entropy",
    "dot_product_attention",
    "layer_norm",
    "global_tokens_mask",
    "local_window_mask",
    "padding_mask",
    "project",
    "reference_attention",
    "register_attention",
    "relative_position_buckets",
    "rms_norm",
    "rope_frequencies",
    "segment_mask",
    "sinusoidal_positions",
    "token_log_likelihood",
]
