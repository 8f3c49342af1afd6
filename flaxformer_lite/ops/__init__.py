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

from flaxformer_lite.lazy import lazy_names

# Each name's module, imported when the name is first read (flaxformer_lite.lazy).
_HOMES = {
    "flaxformer_lite.ops.attention": (
        "attention_weights",
        "dot_product_attention",
        "reference_attention",
    ),
    "flaxformer_lite.ops.attention_choice": ("register_attention",),
    "flaxformer_lite.ops.attention_free": ("aft",),
    "flaxformer_lite.ops.attention_inputs": ("AttentionCall",),
    "flaxformer_lite.ops.attention_mask": ("AttentionMask",),
    "flaxformer_lite.ops.chunked": ("chunked_attention",),
    "flaxformer_lite.ops.losses": (
        "chunked_cross_entropy",
        "chunked_token_log_likelihood",
        "cross_entropy",
        "token_log_likelihood",
    ),
    "flaxformer_lite.ops.masks": (
        "causal_mask",
        "combine_masks",
        "global_tokens_mask",
        "local_window_mask",
        "padding_mask",
        "segment_mask",
    ),
    "flaxformer_lite.ops.norms": ("layer_norm", "rms_norm"),
    "flaxformer_lite.ops.positions": (
        "alibi_bias",
        "alibi_slopes",
        "relative_position_buckets",
        "sinusoidal_positions",
    ),
    "flaxformer_lite.ops.projection": ("project",),
    "flaxformer_lite.ops.rope": ("RopeScaling", "apply_rope", "rope_frequencies"),
}
__getattr__, __dir__ = lazy_names(__name__, _HOMES)
__all__ = [name for names in _HOMES.values() for name in names]
