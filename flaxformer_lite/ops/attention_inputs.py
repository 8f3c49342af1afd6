"""Shape checks and layout helpers shared by the attention implementations.

Every implementation sees the same validated inputs: ``query [B, T, H, Dh]``,
``key [B, S, Hk, Dh]``, ``value [B, S, Hk, Dv]`` with ``H % Hk == 0``, and ``bias`` / ``mask``
broadcastable to ``[B, H, T, S]``. Errors name the offending shapes at trace time, before XLA
reports something less readable.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import config as jax_config

from flaxformer_lite.choices import check_global_tokens, check_local_window
from flaxformer_lite.ops.attention_mask import AttentionMask

# Fill for masked logits. Finite, so that max() and exp(max_old - max_new) of a row whose keys
# are all masked stay NaN-free; implementations zero such rows explicitly.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One call of :func:`flaxformer_lite.ops.dot_product_attention` as its implementations see
    it: validated arrays (or ``jax.ShapeDtypeStruct``s, for the choice alone), the mask
    :meth:`~AttentionMask.aligned` with its ``explicit`` part rank 4, and the platform compiled
    for (:func:`target_platform`). It is the one argument of every implementation, the built-in
    ones and those registered by ``ops.register_attention``:

      ``query [B, T, H, Dh]``, ``key [B, S, Hk, Dh]``, ``value [B, S, Hk, Dv]``: after the
        projections and RoPE (``H % Hk == 0``: query head ``n`` uses key/value head ``n // G``).
      ``bias``: float ``[B | 1, H | 1, T, S]`` added to the logits (relative or ALiBi positions,
        a position bias of the user's), or ``None``.
      ``mask``: an :class:`AttentionMask`; :meth:`dense_mask` gives every piece of it (causal,
        window, global tokens, packed rows' segments, padding) as one bool array.
      ``scale``: the logits' multiplier, ``None`` for ``1 / sqrt(Dh)`` (:meth:`logit_scale`).
      ``dropout_rate``, ``dropout_rng``: dropout on the attention weights (rate 0: no key).

    Decoding with a KV cache, ``key`` and ``value`` are the whole cache (S = its length), the T
    queries sit at the cache index and the mask hides the slots after each query.
    """

    query: jax.Array
    key: jax.Array
    value: jax.Array
    bias: jax.Array | None
    mask: AttentionMask
    platform: str
    scale: float | None = None
    dropout_rate: float = 0.0
    dropout_rng: jax.Array | None = None

    def dense_mask(self) -> jax.Array | None:
        """Every piece of the mask as one bool array ``[B | 1, H | 1, T, S]`` (True = may
        attend), or ``None`` when every key is visible to every query."""
        return self.mask.dense(self.query.shape[1], self.key.shape[1])

    @property
    def logit_scale(self) -> float:
        """The multiplier of the logits: ``scale``, or ``1 / sqrt(Dh)``."""
        return default_scale(self.query, self.scale)

    def positions_folded(self) -> AttentionCall:
        """This call with the mask's ``query_positions`` folded into its explicit mask
        (:meth:`AttentionMask.folded`), for implementations that do not take them."""
        if self.mask.query_positions is None:
            return self
        folded = self.mask.folded(self.query.shape[1], self.key.shape[1])
        return dataclasses.replace(self, mask=folded)

    def arguments(self, *, takes_segment_ids: bool = False) -> tuple[tuple, dict]:
        """``(query, key, value, bias, mask)`` and the keywords ``scale``, ``is_causal`` and
        ``local_window``: the call as functions that take a mask array and flags take it. The
        segment ids are folded into the mask, or, for a function that ``takes_segment_ids``,
        left out of it and passed as the keyword ``segment_ids``."""
        mask = self.mask
        flags = dict(scale=self.scale, is_causal=mask.is_causal, local_window=mask.local_window)
        if takes_segment_ids:
            flags["segment_ids"] = mask.segment_ids
            return (self.query, self.key, self.value, self.bias, mask.explicit), flags
        return (self.query, self.key, self.value, self.bias, mask.given()), flags


def validated_call(
    query, key, value, bias, mask: AttentionMask, *, scale=None, dropout_rate=0.0, dropout_rng=None
) -> AttentionCall:
    """The :class:`AttentionCall` of these inputs, after checking that they fit together.

    Raises:
      ValueError: naming the offending shapes or values.
    """
    query, key, value, bias, explicit = validated_attention_inputs(
        query,
        key,
        value,
        bias,
        mask.explicit,
        mask.local_window,
        dropout_rate,
        dropout_rng,
        mask.global_tokens,
    )
    mask = dataclasses.replace(
        mask,
        explicit=as_rank4("mask", explicit, attention_logits_shape(query, key)),
        segment_ids=validated_segment_ids(mask.segment_ids, query, key),
    )
    mask = mask.aligned(query.shape[1], key.shape[1])
    platform = target_platform()
    return AttentionCall(query, key, value, bias, mask, platform, scale, dropout_rate, dropout_rng)


def target_platform() -> str:
    """The platform the attention compiles for, "cpu", "gpu" or "tpu": "tpu" under Pallas' TPU
    interpret mode (tests on CPU), else that of the active mesh (a compile-only topology on a
    CPU host), else the default backend."""
    # jax exposes the interpret mode's switch only as a config state; absent, it is off.
    interpret_mode = getattr(jax_config, "pallas_tpu_interpret_mode_context_manager", None)
    if interpret_mode is not None and interpret_mode.value is not None:
        return "tpu"
    mesh = jax.sharding.get_abstract_mesh()
    platform = jax.default_backend()
    if not mesh.empty and mesh.abstract_device is not None:
        platform = mesh.abstract_device.platform
    return "gpu" if platform in ("cuda", "rocm") else platform


def validated_attention_inputs(
    query, key, value, bias, mask, local_window, dropout_rate, dropout_rng, global_tokens=0
):
    """``(query, key, value, bias, mask)`` as arrays, after checking that they fit together.

    Raises:
      ValueError: naming the offending shapes or values.
    """
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    bias, mask = (None if x is None else jnp.asarray(x) for x in (bias, mask))
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must be [batch, length, heads, head_dim], got shape {tuple(x.shape)}"
            )
    (b, _, h, dh), (bk, s, hk, dhk), (bv, sv, hv, _) = query.shape, key.shape, value.shape
    if not b == bk == bv:
        raise ValueError(
            f"batch sizes differ: query {query.shape}, key {key.shape}, value {value.shape}"
        )
    if 0 in (query.shape[1], s, hk, dh):
        raise ValueError(
            "query and key need at least one position, head and feature: "
            f"query {query.shape}, key {key.shape}"
        )
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must be a floating-point array, got dtype {x.dtype}")
    if dh != dhk:
        raise ValueError(f"query and key head_dim differ: query {query.shape}, key {key.shape}")
    if (s, hk) != (sv, hv):
        raise ValueError(
            f"key and value must agree in length and heads: key {key.shape}, value {value.shape}"
        )
    if h % hk:
        raise ValueError(
            f"query heads ({h}) must be a multiple of key/value heads ({hk}) for grouped-query "
            f"attention: query {query.shape}, key {key.shape}"
        )
    if mask is not None and mask.dtype != jnp.bool_:
        raise ValueError(f"mask must be boolean (True = may attend), got dtype {mask.dtype}")
    if local_window is not None:
        check_local_window(local_window)
    check_global_tokens(global_tokens)
    check_dropout(dropout_rate, dropout_rng)
    target = attention_logits_shape(query, key)
    as_rank4("bias", bias, target)
    as_rank4("mask", mask, target)
    return query, key, value, bias, mask


def validated_segment_ids(segment_ids, query, key):
    """``(q [B, T], kv [B, S])`` int arrays of ``segment_ids`` (or ``None``), checked against the
    query ``[B, T, H, Dh]`` and key ``[B, S, Hk, Dh]``.

    Raises:
      ValueError: not a pair of integer arrays of those shapes.
    """
    if segment_ids is None:
        return None
    if not isinstance(segment_ids, tuple | list) or len(segment_ids) != 2:
        raise ValueError("segment_ids must be a pair (query ids [B, T], key ids [B, S])")
    ids = tuple(jnp.asarray(x) for x in segment_ids)
    wanted = (query.shape[:2], key.shape[:2])
    if tuple(x.shape for x in ids) != wanted or not all(
        jnp.issubdtype(x.dtype, jnp.integer) for x in ids
    ):
        raise ValueError(
            f"segment_ids must be int arrays of shapes {wanted[0]} and {wanted[1]} [B, T], "
            f"[B, S], got {[f'{x.dtype}{list(x.shape)}' for x in ids]}"
        )
    return ids


def check_dropout(rate, rng):
    """``rate`` must be a static Python number in [0, 1); ``rng`` one PRNG key when rate > 0."""
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate must be a Python float in [0, 1), got {rate!r}")
    if rate == 0.0:
        return
    if rng is None:
        raise ValueError("dropout_rate > 0 needs a dropout_rng")
    rng = jnp.asarray(rng)
    is_typed_key = jnp.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.shape == ()
    is_raw_key = rng.dtype == jnp.uint32 and rng.shape == (2,)
    if not (is_typed_key or is_raw_key):
        raise ValueError(
            "dropout_rng must be one PRNG key (jax.random.key(seed)), got "
            f"dtype {rng.dtype} shape {rng.shape}"
        )


def attention_logits_shape(query, key) -> tuple[int, int, int, int]:
    """``(B, H, T, S)``: the shape that masks and biases broadcast to."""
    return query.shape[0], query.shape[2], query.shape[1], key.shape[1]


def as_rank4(name: str, x, target: tuple[int, ...]):
    """Left-pads ``x`` to rank 4 after checking that it broadcasts to ``target``.

    Unlike ``jnp.broadcast_to``, nothing is materialized: size-1 dimensions stay size 1.
    """
    if x is None:
        return None
    if x.ndim > 4 or any(
        s not in (1, t) for s, t in zip(x.shape[::-1], target[::-1], strict=False)
    ):
        raise ValueError(
            f"{name} of shape {tuple(x.shape)} does not broadcast to [batch, heads, q_len, kv_len]"
            f" = {target}"
        )
    return x.reshape((1,) * (4 - x.ndim) + tuple(x.shape))


def group_heads(x, num_kv_heads: int):
    """``[B, H, T, S]`` (any axis may be 1) -> ``[B, Hk, G, T, S]`` (both 1 where H is 1).

    Query head ``n`` belongs to key/value head ``n // G``, G = H / Hk, so a plain reshape of
    the head axis into ``(Hk, G)`` puts each query head under its key/value head.
    """
    if x is None:
        return None
    b, h, t, s = x.shape
    if h == 1:
        return x.reshape(b, 1, 1, t, s)
    return x.reshape(b, num_kv_heads, h // num_kv_heads, t, s)


def default_scale(query, scale):
    """``scale`` or ``1 / sqrt(Dh)``."""
    return 1.0 / float(query.shape[-1]) ** 0.5 if scale is None else scale


def dropout_keep(rng, rate: float, shape):
    """Bernoulli keep-mask with P(keep) = 1 - rate."""
    return jax.random.bernoulli(rng, 1.0 - rate, shape)
