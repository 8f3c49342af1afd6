"""Scaled dot-product attention, softmax(q kᵀ · scale + bias) v, with masks; its implementations.

:func:`reference_attention` is the definition, written as the formula reads. The implementations
of :func:`dot_product_attention` compute the same values faster or in less memory, and the tests
hold each of them equal to it:

  ``"xla"``      the reference optimised (:func:`xla_attention`): blocks of queries against only
                 the keys they can see, query heads grouped under their key/value head instead of
                 repeated keys and values, and the softmax normalised after the value product;
                 O(T·S) memory.
  ``"chunked"``  memory-efficient online-softmax attention (:func:`chunked_attention`); O(T)
                 memory in the forward and backward pass.
  ``"cudnn"``    cuDNN flash attention through ``jax.nn.dot_product_attention`` (GPU only).
  ``"pallas"``   jax's Pallas flash attention kernels on TPU and GPU (:mod:`.pallas_attention`);
                 inputs they cannot run fall back on the automatic choice, the reason logged.
  ``None``       the best one that supports the backend, shapes and features (on TPU
                 "pallas"); the reason for the choice is logged (logger
                 ``flaxformer_lite.ops.attention``, at trace time).

Each is a :class:`~.attention_choice.Backend` of :mod:`.attention_choice`, which says what each
can run and makes the choice; ``ops.register_attention`` adds a user's own, run where named.

Shapes (letters as in :mod:`flaxformer_lite.ops`): query ``[B, T, H, Dh]``, key ``[B, S, Hk, Dh]``,
value ``[B, S, Hk, Dv]``, output ``[B, T, H, Dv]``. ``bias`` (additive, float) and ``mask`` (bool,
True = may attend) broadcast to ``[B, H, T, S]``; ``mask`` may also be an
:class:`~.attention_mask.AttentionMask`, which holds the causal flag, window, global tokens and
segment ids as well (and a query offset, for a KV cache). Grouped-query attention: ``H`` is a
multiple of ``Hk`` and query head ``n`` uses key/value head ``n // G``, ``G = H // Hk``;
``Hk == 1`` is multi-query attention.

Numerics: logits, softmax and accumulation are float32 whatever the input dtype; the output has
the query's dtype. A query row whose keys are all masked returns zeros, never NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxformer_lite.choices import ATTENTION
from flaxformer_lite.ops import attention_choice
from flaxformer_lite.ops.attention_inputs import (
    MASK_VALUE,
    default_scale,
    validated_call,
)
from flaxformer_lite.ops.attention_mask import AttentionMask
from flaxformer_lite.ops.xla_attention import xla_weights


def reference_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | AttentionMask | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    local_window: tuple[int, int] | None = None,
    global_tokens: int = 0,
) -> jax.Array:
    """Attention as the formula reads: the definition the implementations are tested against.

    Arguments, shapes and result as :func:`dot_product_attention`, without dropout. Memory is
    O(B·H·T·S): for reading, testing and small inputs.
    """
    mask = AttentionMask.of(mask, is_causal, local_window, global_tokens)
    call = validated_call(query, key, value, bias, mask)
    query, key, value, bias = call.query, call.key, call.value, call.bias
    group = query.shape[2] // key.shape[2]  # G query heads share each key/value head
    key = jnp.repeat(key, group, axis=2)  # [B, S, H, Dh]
    value = jnp.repeat(value, group, axis=2)  # [B, S, H, Dv]
    logits = jnp.einsum("bthd,bshd->bhts", query, key, preferred_element_type=jnp.float32)
    logits = logits * default_scale(query, scale)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    mask = call.mask.dense(query.shape[1], key.shape[1])  # bool, broadcastable to [B, H, T, S]
    if mask is not None:
        logits = jnp.where(mask, logits, MASK_VALUE)  # finite: a fully masked row stays NaN-free
    weights = jax.nn.softmax(logits, axis=-1)  # float32 [B, H, T, S]
    if mask is not None:
        weights = jnp.where(mask, weights, 0.0)  # rows without a visible key become zeros
    out = jnp.einsum(
        "bhts,bshd->bthd", weights.astype(value.dtype), value, preferred_element_type=jnp.float32
    )
    return out.astype(query.dtype)


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | AttentionMask | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    local_window: tuple[int, int] | None = None,
    global_tokens: int = 0,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    implementation: str | None = None,
    segment_ids: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Multi-head scaled dot-product attention.

    Args:
      query: ``[B, T, H, Dh]``.
      key: ``[B, S, Hk, Dh]`` with ``H % Hk == 0``.
      value: ``[B, S, Hk, Dv]``.
      bias: optional additive float bias broadcastable to ``[B, H, T, S]`` (relative
        positions, ALiBi). Use ``mask`` rather than ``-inf`` biases to forbid positions.
      mask: optional bool, broadcastable to ``[B, H, T, S]``, True = may attend; or an
        :class:`~.attention_mask.AttentionMask` holding every piece of the mask (then
        ``is_causal``, ``local_window``, ``global_tokens`` and ``segment_ids`` stay unset).
      scale: multiplier of the logits; defaults to ``1 / sqrt(Dh)``.
      is_causal: query ``i`` attends keys ``j <= i + (S - T)``: with ``T != S`` the last
        query is aligned with the last key, as when decoding against a KV cache.
      local_window: ``(left, right)``: each query attends only keys at most ``left`` positions
        before and ``right`` after its own position (positions aligned as for ``is_causal``).
      global_tokens: G, with ``local_window`` (Longformer, BigBird): the first G positions
        attend to and are attended by every position, within causality when ``is_causal``.
        "xla" and "chunked" only: "pallas" falls back, the reason logged; cuDNN is not chosen.
      dropout_rate: dropout probability on the attention weights ("xla" and "chunked").
      dropout_rng: PRNG key, required when ``dropout_rate > 0``.
      implementation: ``"xla"``, ``"chunked"``, ``"cudnn"``, ``"pallas"`` or ``None``
        (automatic). The dropout keep-mask drawn from one ``dropout_rng`` differs between
        implementations. "chunked" has a custom VJP (see the conventions in
        :mod:`flaxformer_lite.ops`).
      segment_ids: optional int ``(q [B, T], kv [B, S])``, a mask by segment (packing): a query
        sees only keys with its id. The Pallas TPU kernel and "chunked" take them as they are
        (no ``[T, S]`` mask of them is built).

    Returns:
      ``[B, T, H, Dv]`` in the query's dtype.

    Raises:
      ValueError: on wrong ranks, mismatched shapes, ``H % Hk != 0``, masks or biases that do
        not broadcast, a non-boolean mask, or an implementation that cannot run these inputs.
    """
    mask = AttentionMask.of(mask, is_causal, local_window, global_tokens, segment_ids)
    dropout = dict(dropout_rate=dropout_rate, dropout_rng=dropout_rng)
    call = validated_call(query, key, value, bias, mask, scale=scale, **dropout)
    return attention_choice.run(call, implementation)


def attention_weights(
    query: jax.Array,
    key: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | AttentionMask | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    local_window: tuple[int, int] | None = None,
    global_tokens: int = 0,
    implementation: str | None = None,
) -> jax.Array:
    """The attention probabilities softmax(q kᵀ · scale + bias), for inspection and plots; those
    of a registered ``implementation``'s ``weights`` (``ops.register_attention``) if named.

    Args: as :func:`dot_product_attention` (query ``[B, T, H, Dh]``, key ``[B, S, Hk, Dh]``).

    Returns:
      float32 ``[B, H, T, S]``; softmax's rows sum to 1, or are all zeros if fully masked.

    Raises:
      ValueError: an ``implementation`` registered without ``weights``.
    """
    mask = AttentionMask.of(mask, is_causal, local_window, global_tokens)
    call = validated_call(query, key, key, bias, mask, scale=scale).positions_folded()
    if implementation is None or implementation in attention_choice.IMPLEMENTATIONS:
        return xla_weights(call)  # each built-in implementation computes softmax's
    backend = ATTENTION.resolve(attention_choice.choose(call, implementation).backend)
    if backend.weights is None:
        how = (
            "give the function a `weights` attribute"
            if ":" in implementation  # an import path: nothing was registered by hand
            else "register it with weights="
        )
        raise ValueError(
            f"attention implementation {implementation!r} has no attention weights to show: "
            f"{how} (weights(call) -> float32 [B, H, T, S])"
        )
    return backend.weights(call)
