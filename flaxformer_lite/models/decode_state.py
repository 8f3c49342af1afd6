"""Incremental decoding, written once for ``DecoderLM`` and ``EncoderDecoder``: where decoding
stands (:class:`DecodeState`) and, for every call of the causal stack, decoding or not, its
self-attention inputs (:func:`decoder_inputs`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from flaxformer_lite.models.config import ModelConfig
from flaxformer_lite.models.embedding import check_length, default_positions
from flaxformer_lite.models.layers import key_mask


class DecodeState(nnx.Module):
    """Where incremental decoding stands: the next cache slot and which slots hold real tokens."""

    def __init__(self, batch_size: int, max_length: int):
        self.max_length = max_length
        self.index = nnx.Cache(jnp.zeros((), jnp.int32))
        self.valid = nnx.Cache(jnp.zeros((batch_size, max_length), jnp.bool_))

    def append(self, valid: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Records ``valid [B, T]`` at the next ``T`` slots.

        Returns:
          The first slot, the key mask ``[B, 1, 1, max_length]``, and whether the tokens
          overflow the cache (a traced bool: the slots would be clamped, so callers poison
          their outputs with NaN rather than return wrong numbers).
        """
        index = self.index[...]
        all_valid = jax.lax.dynamic_update_slice(self.valid[...], valid, (0, index))
        self.valid[...] = all_valid
        self.index[...] = index + valid.shape[1]
        return index, key_mask(all_valid), index + valid.shape[1] > self.max_length


def new_decode_state(cfg: ModelConfig, batch_size: int, max_length: int | None) -> DecodeState:
    """An empty :class:`DecodeState` of ``max_length`` slots (default ``cfg.max_length``)."""
    max_length = max_length or cfg.max_length
    check_length(cfg, max_length, "the cache")
    return DecodeState(batch_size, max_length)


@dataclasses.dataclass(frozen=True)
class DecoderInputs:
    """What the causal stack's self-attention takes in one call.

    Attributes:
      mask: the key mask ``[B, 1, 1, S]`` (None: every key is real).
      positions: ``[T]`` or ``[B, T]``.
      cache_index: the first cache slot of the call's tokens; None without decoding.
      kv_length: S, the key count: the cache length when decoding, T otherwise.
      overflow: a traced bool, True when the tokens run past the cache; None without decoding.
    """

    mask: jax.Array | None
    positions: jax.Array
    cache_index: jax.Array | None
    kv_length: int
    overflow: jax.Array | None

    def poisoned(self, outputs: jax.Array) -> jax.Array:
        """``outputs``, or NaN everywhere when the call overflowed the cache."""
        if self.overflow is None:
            return outputs
        return jnp.where(self.overflow, jnp.asarray(jnp.nan, outputs.dtype), outputs)


def decoder_inputs(
    model,
    tokens: jax.Array,
    *,
    decode: bool,
    what: str,
    padding_mask: jax.Array | None = None,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> DecoderInputs:
    """The :class:`DecoderInputs` of a call of ``model`` (``DecoderLM``, ``EncoderDecoder``) on
    ``tokens [B, T, ...]``.

    Without ``decode`` the keys are the call's own tokens (``what`` names them in the length
    error). With it the tokens are appended to ``model.decode_state`` after those of earlier
    calls. ``padding_mask`` is bool ``[B, T]``, False at padding; ``positions`` default to the
    tokens' slots.
    """
    batch, length = tokens.shape[:2]
    state = model.decode_state
    if decode:
        if state is None:
            raise ValueError("decode=True needs model.init_cache(batch_size, max_length) first")
        if segment_ids is not None:
            raise ValueError("segment_ids (packing) are not supported when decoding")
        valid = jnp.ones((batch, length), jnp.bool_) if padding_mask is None else padding_mask
        cache_index, mask, overflow = state.append(valid)
        kv_length = state.max_length
    else:
        check_length(model.config, length, what)
        mask = key_mask(padding_mask)
        cache_index, kv_length, overflow = None, length, None
    if positions is None:
        positions = default_positions(length, 0 if cache_index is None else cache_index)
    return DecoderInputs(mask, positions, cache_index, kv_length, overflow)
