"""The Attention Free Transformer's token mixer: projections, the pairwise bias and the decoding
state here; the math in ``ops.aft``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flaxformer_lite import ops
from flaxformer_lite.choices import AFT_MIXERS
from flaxformer_lite.nn.dense import XAVIER, Dense, KernelInit, param
from flaxformer_lite.ops import attention_free


class AttentionFree(nnx.Module):
    """AFT (Zhai et al. 2021) in place of self-attention: ``out(ops.aft(x Wq, x Wk, x Wv, w))``.

    Its call takes the arguments of :class:`~flaxformer_lite.nn.MultiHeadAttention`'s self-
    attention, so a layer uses either.

    Args:
      d_model: input and output size D (the queries, keys and values are D wide too).
      mixer: ``"aft_full"`` (a learned bias ``w [max_length, max_length]``), ``"aft_local"``
        (``w`` used within ``window`` positions, 0 beyond) or ``"aft_simple"`` (no ``w``).
      max_length: the longest sequence (rows and columns of ``w``).
      window: AFT-local's ``s``: ``w`` counts where ``|t - t'| < s``.
      qkv_bias, out_bias: biases on the input and output projections.
      init, out_init: initializers of the input and output projections; ``w`` starts at 0.
      dtype, param_dtype: compute and storage dtypes.

    Decoding (``cache_index``, causal only) keeps, after :meth:`init_cache`:

    * ``aft_simple``: the running maximum, numerator and denominator per feature ``[B, D]``
      (float32): O(D) per token, no cache of keys or values.
    * ``aft_full`` / ``aft_local``: each new query needs its row of ``w`` against every earlier
      key, so the keys, values and positions of earlier tokens are cached ``[B, S, D]`` (as a
      KV cache) and a step costs O(S * D) (``ops.attention_free.cached_causal_aft``).

    ``w`` is indexed by the tokens' positions (those given, or the slots), so packed rows and
    left-padded prompts, whose positions restart at 0, use the bias of their own sequence.
    """

    def __init__(
        self,
        d_model: int,
        *,
        mixer: str,
        max_length: int,
        window: int | None = None,
        qkv_bias: bool = True,
        out_bias: bool = True,
        init: KernelInit = XAVIER,
        out_init: KernelInit | None = None,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if mixer not in AFT_MIXERS:
            raise ValueError(f"mixer must be one of {AFT_MIXERS}, got {mixer!r}")
        if mixer == "aft_local" and (window is None or window < 1):
            raise ValueError(f"aft_local needs a window >= 1, got {window!r}")
        self.mixer, self.window, self.dtype = mixer, window, dtype
        self.max_length = max_length
        common = dict(init=init, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        # "aft_features" has no default sharding rule (replicated); AFT mixes each feature on
        # its own, so a rule may shard it like attention heads.
        names = ("embed", "aft_features")
        self.query = Dense(d_model, d_model, names=names, use_bias=qkv_bias, **common)
        self.key = Dense(d_model, d_model, names=names, use_bias=qkv_bias, **common)
        self.value = Dense(d_model, d_model, names=names, use_bias=qkv_bias, **common)
        self.out = Dense(
            d_model,
            d_model,
            names=("aft_features", "embed"),
            use_bias=out_bias,
            **{**common, "init": out_init or init},
        )
        self.pairwise_bias = (
            None
            if mixer == "aft_simple"
            else param(
                rngs,
                nnx.initializers.zeros,
                (max_length, max_length),
                ("aft_query_length", "aft_key_length"),
                param_dtype,
            )
        )
        self.deterministic = False
        # nnx.Cache arrays after init_cache.
        self.running_max = self.numerator = self.denominator = nnx.data(None)
        self.cached_key = self.cached_value = self.cached_positions = nnx.data(None)

    def init_cache(self, batch_size: int, max_length: int, *, dtype=None, num_layers=None):
        """Allocates the decoding state (see the class docstring) for ``batch_size`` rows of up
        to ``max_length`` tokens; ``num_layers`` prefixes a layer axis (scanned layers)."""
        features = self.query.out_shape[0]
        lead = (batch_size,) if num_layers is None else (num_layers, batch_size)
        if self.pairwise_bias is None:
            self.running_max = nnx.Cache(jnp.full((*lead, features), -1e30, jnp.float32))
            self.numerator = nnx.Cache(jnp.zeros((*lead, features), jnp.float32))
            self.denominator = nnx.Cache(jnp.zeros((*lead, features), jnp.float32))
            return
        if max_length > self.max_length:
            raise ValueError(
                f"an {self.mixer} cache of {max_length} tokens exceeds max_length="
                f"{self.max_length} (the pairwise bias)"
            )
        shape = (*lead, max_length, features)
        self.cached_key = nnx.Cache(jnp.zeros(shape, dtype or self.dtype))
        self.cached_value = nnx.Cache(jnp.zeros(shape, dtype or self.dtype))
        self.cached_positions = nnx.Cache(jnp.zeros((*lead, max_length), jnp.int32))

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
        """Mixes ``x [B, T, D]`` over positions; arguments as ``MultiHeadAttention``.

        ``mask`` must be a key mask ``[B, 1, 1, S]`` (padding; ``S`` the cache length when
        decoding), ``positions`` ``[T]`` or ``[B, T]`` index ``w``. A ``context`` (cross-
        attention) or a logit ``bias`` (relative positions, ALiBi) is refused.
        """
        if context is not None:
            raise ValueError("the AFT mixer is self-attention only; it takes no context")
        if bias is not None:
            raise ValueError("the AFT mixer takes no attention-logit bias (relative, alibi)")
        if x.ndim != 3:
            raise ValueError(f"AFT expects x as [batch, length, features], got {x.shape}")
        batch, length, _ = x.shape
        if self.pairwise_bias is not None and length > self.max_length:
            raise ValueError(
                f"input of length {length} exceeds max_length={self.max_length} "
                f"(the {self.mixer} pairwise bias)"
            )
        key_valid = None if mask is None else _key_valid(mask, batch)
        start = 0 if cache_index is None else cache_index
        if positions is None:
            positions = start + jnp.arange(length)
        positions = jnp.broadcast_to(positions, (batch, length))
        q, k, v = self.query(x), self.key(x), self.value(x)
        if cache_index is not None:
            if not is_causal:
                raise ValueError("AFT decoding (cache_index) needs a causal mixer")
            if segment_ids is not None:
                raise ValueError("segment_ids are for AFT without a decoding state")
            return self.out(self._decode(q, k, v, key_valid, positions, cache_index))
        w = None if self.pairwise_bias is None else self._bias(positions, positions)
        out = ops.aft(q, k, v, w, is_causal=is_causal, mask=key_valid, segment_ids=segment_ids)
        return self.out(out)

    def _bias(self, query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
        """``w`` at the pairs of positions ``[B, T, S]`` (0 beyond AFT-local's window)."""
        w = self.pairwise_bias[...].astype(jnp.float32)
        rows = w[query_positions[:, :, None], key_positions[:, None, :]]
        if self.window is None:
            return rows
        distance = query_positions[:, :, None] - key_positions[:, None, :]
        return jnp.where(jnp.abs(distance) < self.window, rows, 0.0)

    def _decode(self, q, k, v, key_valid, positions, cache_index):
        """Causal AFT of ``T`` new tokens at slots ``[cache_index, cache_index + T)``."""
        length = q.shape[1]
        new_valid = (
            None
            if key_valid is None
            else jax.lax.dynamic_slice_in_dim(key_valid, cache_index, length, axis=1)
        )
        if self.pairwise_bias is None:
            if self.running_max is None:
                raise ValueError("decoding with cache_index needs init_cache(batch_size, ...)")
            state = (self.running_max[...], self.numerator[...], self.denominator[...])
            out, state = attention_free.aft_simple_step(state, q, k, v, new_valid)
            self.running_max[...], self.numerator[...], self.denominator[...] = state
            return out
        if self.cached_key is None:
            raise ValueError("decoding with cache_index needs init_cache(batch_size, max_length)")
        start = (0, cache_index, 0)
        keys = jax.lax.dynamic_update_slice(
            self.cached_key[...], k.astype(self.cached_key.dtype), start
        )
        values = jax.lax.dynamic_update_slice(
            self.cached_value[...], v.astype(self.cached_value.dtype), start
        )
        key_positions = jax.lax.dynamic_update_slice(
            self.cached_positions[...], positions.astype(jnp.int32), (0, cache_index)
        )
        self.cached_key[...], self.cached_value[...] = keys, values
        self.cached_positions[...] = key_positions
        return attention_free.cached_causal_aft(
            q,
            keys.astype(self.dtype),
            values.astype(self.dtype),
            self._bias(positions, key_positions),
            offset=cache_index,
            key_mask=key_valid,
        )


def _key_valid(mask: jax.Array, batch: int) -> jax.Array:
    """The ``[B, S]`` key validity of a ``[B, 1, 1, S]`` attention mask; any other mask (one
    that varies per query) is refused: AFT drops keys, it has no per-pair mask."""
    if mask.ndim != 4 or mask.shape[1:3] != (1, 1):
        raise ValueError(
            f"the AFT mixer takes a key mask [B, 1, 1, S] (padding), got a mask {mask.shape}"
        )
    return jnp.broadcast_to(mask[:, 0, 0, :], (batch, mask.shape[-1]))
