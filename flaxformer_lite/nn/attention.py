"""Multi-head attention: projections, RoPE and the KV cache here; the attention math in ``ops``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from flaxformer_lite import ops
from flaxformer_lite.nn import context_parallel
from flaxformer_lite.nn.dense import XAVIER, Dense, KernelInit
from flaxformer_lite.nn.rngs import fork, next_key


@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary position embedding settings (see ``ops.apply_rope``)."""

    base: float = 10000.0
    layout: str = "half"
    scaling: ops.RopeScaling | None = None

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        return ops.apply_rope(
            x, positions, base=self.base, layout=self.layout, scaling=self.scaling
        )


class MultiHeadAttention(nnx.Module):
    """Multi-head (grouped-query, multi-query) attention, self or cross, with an optional KV cache.

    ``heads_i = Attention(x Wq_i, ctx Wk_i, ctx Wv_i)``; the heads are concatenated and projected
    by ``Wo`` (written as one contraction over ``[heads, head_dim]``). With ``num_kv_heads <
    num_heads`` groups of query heads share a key/value head (GQA; 1 is MQA).

    Args:
      d_model: input and output size D.
      num_heads: query heads H.
      num_kv_heads: key/value heads Hk (``H % Hk == 0``); defaults to H.
      head_dim: Dh; defaults to ``D // H``.
      context_features: size of the cross-attention context; defaults to D.
      cross: cross-attention: keys/values come from a context, the KV cache (when decoding)
        holds the context's projections, computed once.
      fused_qkv: one projection for self-attention's queries, keys and values: ``[D, 3, H, Dh]``
        when ``Hk == H``, else ``[D, H + 2 * Hk, Dh]`` holding the H query heads, then the Hk
        key heads, then the Hk value heads (Falcon's multi-query layout, for any Hk). That
        concatenated axis is named ``"qkv_heads"``: no default sharding rule splits it, since a
        tensor-parallel split would not fall on the q/k/v boundaries.
      qkv_bias, out_bias: biases on the input and output projections.
      rope: rotate queries and keys by their positions (self-attention only).
      local_window: ``(left, right)``: self-attention sees only keys that many positions
        before and after each query (see ``ops.dot_product_attention``).
      global_tokens: with ``local_window``, the first G positions see and are seen by all
        (Longformer, BigBird). With a KV cache both become an explicit mask at the cache
        positions.
      dropout_rate: dropout on the attention weights.
      implementation: passed to ``ops.dot_product_attention`` (None = chosen per input).
      scale: the logits' multiplier (None: ``1 / sqrt(Dh)``; muP's is ``~1 / Dh``).
      init, out_init: initializers of the input and output projections.
      dtype, param_dtype: compute and storage dtypes.
      sow_weights: at every call, sow the attention weights ``[B, H, T, S]`` (float32, those
        of ``ops.attention_weights``) as the ``nnx.Intermediate`` ``attention_weights``, for
        ``nnx.capture`` to collect. An attribute: ``model.set_attributes(sow_weights=True)``
        switches it on in a built model (``flaxformer_lite.attention_maps`` does).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        context_features: int | None = None,
        cross: bool = False,
        fused_qkv: bool = False,
        qkv_bias: bool = True,
        out_bias: bool = True,
        rope: Rope | None = None,
        local_window: tuple[int, int] | None = None,
        global_tokens: int = 0,
        dropout_rate: float = 0.0,
        implementation: str | None = None,
        scale: float | None = None,
        init: KernelInit = XAVIER,
        out_init: KernelInit | None = None,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        sow_weights: bool = False,
        rngs: nnx.Rngs,
    ):
        num_kv_heads = num_kv_heads or num_heads
        head_dim = head_dim or d_model // num_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if fused_qkv and (cross or context_features is not None):
            raise ValueError("fused_qkv is for self-attention (no cross, no context_features)")
        self.num_kv_heads, self.head_dim, self.cross = num_kv_heads, head_dim, cross
        self.rope, self.dropout_rate, self.dtype = rope, dropout_rate, dtype
        if (local_window is not None or global_tokens) and cross:
            raise ValueError("local_window and global_tokens are for self-attention")
        self.local_window = None if local_window is None else tuple(local_window)
        self.global_tokens = global_tokens
        self.implementation, self.scale = implementation, scale
        common = dict(init=init, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        context_features = context_features or d_model
        if fused_qkv and num_kv_heads < num_heads:
            self.qkv = Dense(
                d_model,
                (num_heads + 2 * num_kv_heads, head_dim),
                names=("embed", "qkv_heads", "head_dim"),
                use_bias=qkv_bias,
                split=(num_heads, num_kv_heads, num_kv_heads),
                **common,
            )
        elif fused_qkv:
            self.qkv = Dense(
                d_model,
                (3, num_heads, head_dim),
                names=("embed", "qkv", "heads", "head_dim"),
                use_bias=qkv_bias,
                fused_axes=(1,),
                **common,
            )
        else:
            self.query = Dense(
                d_model,
                (num_heads, head_dim),
                names=("embed", "heads", "head_dim"),
                use_bias=qkv_bias,
                **common,
            )
            kv_names = ("embed", "kv_heads", "head_dim")
            self.key = Dense(
                context_features,
                (num_kv_heads, head_dim),
                names=kv_names,
                use_bias=qkv_bias,
                **common,
            )
            self.value = Dense(
                context_features,
                (num_kv_heads, head_dim),
                names=kv_names,
                use_bias=qkv_bias,
                **common,
            )
        self.fused_qkv = fused_qkv
        self.out = Dense(
            (num_heads, head_dim),
            d_model,
            names=("heads", "head_dim", "embed"),
            use_bias=out_bias,
            **{**common, "init": out_init or init},
        )
        self.dropout_rngs = fork(rngs["dropout"]) if dropout_rate > 0 else None
        self.deterministic, self.sow_weights = False, sow_weights
        # nnx.Cache arrays after init_cache.
        self.cached_key = nnx.data(None)
        self.cached_value = nnx.data(None)

    def init_cache(self, batch_size: int, max_length: int, *, dtype=None, num_layers=None):
        """Allocates an empty KV cache ``[B, Hk, max_length, Dh]`` for incremental decoding.

        Heads come before positions so that the attention's batched matmuls (batch ``B, Hk``)
        read the cache as it lies; in the ``[B, S, Hk, Dh]`` layout of the keys XLA would copy
        the whole cache into that order at every step. For cross-attention ``max_length`` is
        the context length S: the first decoding call with a context stores its keys/values,
        later calls without one reuse them. ``num_layers`` prefixes a layer axis, for the
        stacked attention of scanned layers.
        """
        shape = (batch_size, self.num_kv_heads, max_length, self.head_dim)
        if num_layers is not None:
            shape = (num_layers, *shape)
        self.cached_key = nnx.Cache(jnp.zeros(shape, dtype or self.dtype))
        self.cached_value = nnx.Cache(jnp.zeros(shape, dtype or self.dtype))

    def __call__(
        self,
        x: jax.Array,
        context: jax.Array | None = None,
        *,
        mask: jax.Array | None = None,
        bias: jax.Array | None = None,
        positions: jax.Array | None = None,
        is_causal: bool = False,
        cache_index: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Attends from ``x`` to itself, or to ``context`` (cross-attention).

        Args:
          x: ``[B, T, D]`` queries (and keys/values for self-attention).
          context: ``[B, S, context_features]`` keys/values for cross-attention.
          mask: bool, broadcastable to ``[B, H, T, S]`` (``S`` = the cache length when decoding).
          bias: float, broadcastable to the same logits shape (relative positions, ALiBi).
          positions: ``[T]`` or ``[B, T]`` positions of ``x`` for RoPE (default ``arange(T)``, or
            ``cache_index + arange(T)`` when decoding).
          is_causal: mask keys after each query (self-attention).
          cache_index: decode with the KV cache: the keys/values of ``x`` are written at slots
            ``[cache_index, cache_index + T)`` and the queries attend to the whole cache, slots
            beyond their own position masked when ``is_causal``. ``cache_index + T`` must not
            exceed the cache length (the slot would be clamped). For cross-attention with a
            cache: a ``context`` is projected and stored; ``context=None`` reuses the stored one.
          segment_ids: int ``[B, T]`` of packed rows (self-attention without a cache): a
            position attends only to keys of its own segment. They reach
            ``ops.dot_product_attention`` as ids rather than a ``[B, 1, T, T]`` mask, which
            the TPU flash kernel takes.

        Returns:
          ``[B, T, D]`` in the compute dtype.
        """
        if x.ndim != 3:
            raise ValueError(f"attention expects x as [batch, length, features], got {x.shape}")
        segment_pair = self._segment_pair(segment_ids, context, cache_index)
        length = x.shape[1]
        if self.fused_qkv:
            if context is not None:
                raise ValueError("a fused_qkv attention is self-attention; it takes no context")
            q, k, v = self._split_qkv(self.qkv(x))
        elif self.cross and cache_index is not None and self.cached_key is not None:
            q, (k, v) = self.query(x), self._cached_context(context)
        else:
            if self.cross and context is None:
                raise ValueError("cross-attention needs a context (or a filled KV cache)")
            kv_input = x if context is None else context
            q, k, v = self.query(x), self.key(kv_input), self.value(kv_input)

        if self.rope is not None and context is None:
            if positions is None:
                start = 0 if cache_index is None else cache_index
                positions = start + jnp.arange(length)
            q, k = self.rope(q, positions), self.rope(k, positions)

        offset = None
        if cache_index is not None and not self.cross:
            if context is not None:
                raise ValueError("a self-attention KV cache takes no context")
            k, v = self._update_cache(k, v, cache_index)
            offset = cache_index  # the queries' positions in the cache
        mask = ops.AttentionMask(
            is_causal=is_causal,
            local_window=self.local_window,
            global_tokens=self.global_tokens,
            query_offset=offset,
            segment_ids=segment_pair,
            explicit=mask,
        )
        if self.sow_weights:
            self.sow(nnx.Intermediate, "attention_weights", self.weights(q, k, bias, mask))
        return self.out(self.attend(q, k, v, bias, mask))

    def attend(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        bias: jax.Array | None,
        mask: ops.AttentionMask,
    ) -> jax.Array:
        """The attention of ``q [B, T, H, Dh]`` over ``k, v [B, S, Hk, Dh]`` (after RoPE; the
        whole cache when decoding) with the logit ``bias`` (broadcastable to ``[B, H, T, S]``)
        and ``mask``: ``[B, T, H, Dh]``, which the output projection maps to ``[B, T, D]``.

        ``ops.dot_product_attention`` with this module's implementation and dropout; over a
        sequence split by the mesh's context axis, on each device against the gathered keys
        (``nn.context_parallel.context_attention``). A variant overrides this (and
        :meth:`weights`) and keeps the projections, RoPE and the cache.
        """
        dropout_rate = 0.0 if self.deterministic else self.dropout_rate
        options = dict(
            implementation=self.implementation,
            scale=self.scale,
            dropout_rate=dropout_rate,
            dropout_rng=next_key(self.dropout_rngs) if dropout_rate > 0 else None,
        )
        axes = context_parallel.sequence_axes()
        if axes:
            return context_parallel.context_attention(q, k, v, bias, mask, axes=axes, **options)
        return ops.dot_product_attention(q, k, v, bias, mask, **options)

    def weights(
        self, q: jax.Array, k: jax.Array, bias: jax.Array | None, mask: ops.AttentionMask
    ) -> jax.Array:
        """float32 ``[B, H, T, S]``: the weights :meth:`attend` gives each key, sown for
        attention maps (``sow_weights``); arguments as :meth:`attend`'s."""
        return ops.attention_weights(
            q, k, bias, mask, scale=self.scale, implementation=self.implementation
        )

    def _split_qkv(self, qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries ``[B, T, H, Dh]`` and keys, values ``[B, T, Hk, Dh]`` of the fused projection."""
        if qkv.ndim == 5:  # [B, T, 3, H, Dh]
            return tuple(y[:, :, 0] for y in jnp.split(qkv, 3, axis=2))
        num_heads = qkv.shape[2] - 2 * self.num_kv_heads
        return tuple(jnp.split(qkv, [num_heads, num_heads + self.num_kv_heads], axis=2))

    def _segment_pair(self, segment_ids, context, cache_index):
        """``(ids, ids)``, the query and key ids of self-attention over packed rows, or ``None``."""
        if segment_ids is None:
            return None
        if self.cross or context is not None or cache_index is not None:
            raise ValueError("segment_ids are for self-attention without a KV cache")
        if self.global_tokens:  # slots of the row, which a packed row's later documents lack
            raise ValueError(
                f"global_tokens={self.global_tokens} are the first slots of a row, not of each "
                "packed document: train on unpacked rows (data.packing=false)"
            )
        return segment_ids, segment_ids

    def _cached_context(self, context: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """Cross-attention keys/values ``[B, S, Hk, Dh]``: of ``context``, stored in the cache
        for the next steps; or, without a context, those stored by an earlier step."""
        if context is None:
            cached = self.cached_key[...], self.cached_value[...]
            return tuple(x.swapaxes(1, 2).astype(self.dtype) for x in cached)
        k, v = self.key(context), self.value(context)
        if k.swapaxes(1, 2).shape != self.cached_key.shape:
            raise ValueError(
                f"context keys {k.shape} do not fit the cross-attention cache "
                f"{self.cached_key.shape} [B, Hk, S, Dh] (init_cache with the source length)"
            )
        self.cached_key[...] = k.swapaxes(1, 2).astype(self.cached_key.dtype)
        self.cached_value[...] = v.swapaxes(1, 2).astype(self.cached_value.dtype)
        return k, v

    def _update_cache(self, k: jax.Array, v: jax.Array, cache_index: jax.Array):
        """Writes ``k, v [B, T, Hk, Dh]`` at slots ``[cache_index, cache_index + T)`` and returns
        the whole cache as keys/values ``[B, S, Hk, Dh]``."""
        if self.cached_key is None:
            raise ValueError("decoding with cache_index needs init_cache(batch_size, max_length)")
        if k.shape[0] != self.cached_key.shape[0]:
            raise ValueError(
                f"batch size {k.shape[0]} does not match the KV cache {self.cached_key.shape}"
            )
        start = (0, 0, cache_index, 0)
        cached_key = jax.lax.dynamic_update_slice(
            self.cached_key[...], k.swapaxes(1, 2).astype(self.cached_key.dtype), start
        )
        cached_value = jax.lax.dynamic_update_slice(
            self.cached_value[...], v.swapaxes(1, 2).astype(self.cached_value.dtype), start
        )
        self.cached_key[...], self.cached_value[...] = cached_key, cached_value
        return tuple(x.swapaxes(1, 2).astype(self.dtype) for x in (cached_key, cached_value))
