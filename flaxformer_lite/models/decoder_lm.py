"""GPT-style decoder-only language model (also LLaMA-style with the matching config)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flaxformer_lite.models.config import ModelConfig
from flaxformer_lite.models.parts import (
    DecodeState,
    InputEmbedding,
    OutputHead,
    Tower,
    check_length,
    default_positions,
    key_mask,
    poison_if,
    token_embedding,
)


class DecoderLM(nnx.Module):
    """Embeddings -> causal layers -> (final norm) -> logits over the vocabulary.

    Args:
      cfg: a config with ``num_decoder_layers > 0`` (encoder layers are ignored).
      rngs: ``nnx.Rngs`` with ``params`` (and ``dropout``, else ``default``) streams.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if not cfg.num_decoder_layers:
            raise ValueError("DecoderLM needs num_decoder_layers > 0")
        self.config = cfg
        tokens = None if cfg.input_dim is not None else token_embedding(cfg, rngs)
        self.embed = InputEmbedding(cfg, tokens=tokens, input_dim=cfg.input_dim, rngs=rngs)
        self.decoder = Tower(
            cfg,
            num_layers=cfg.num_decoder_layers,
            causal=True,
            cross_attention=False,
            rngs=rngs,
        )
        self.head = OutputHead(cfg, tokens=tokens, rngs=rngs)
        self.decode_state = nnx.data(None)  # a DecodeState after init_cache

    def __call__(
        self,
        inputs: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        padding_mask: jax.Array | None = None,
        decode: bool = False,
    ) -> jax.Array:
        """Next-token logits.

        Args:
          inputs: int ``[B, T]`` tokens (float ``[B, T, input_dim]`` with ``input_dim``).
          positions: ``[T]`` or ``[B, T]`` (packed sequences restart at 0 in each segment);
            default ``arange(T)``, or continuing from the cache when decoding.
          segment_ids: int ``[B, T]``: tokens attend only within their segment (packing).
          padding_mask: bool ``[B, T]``, True at real tokens, False at padding: no token
            attends to padding (ragged prompts).
          decode: run incrementally through the KV cache set up by :meth:`init_cache`; the
            tokens are appended after those of earlier calls. Tokens beyond the cache's
            ``max_length`` get NaN logits.

        Returns:
          ``[B, T, V]`` logits (``[B, T, output_dim]`` with a regression head) in the
          compute dtype.
        """
        batch, length = inputs.shape[:2]
        if decode:
            if self.decode_state is None:
                raise ValueError("decode=True needs model.init_cache(batch_size, max_length) first")
            if segment_ids is not None:
                raise ValueError("segment_ids (packing) are not supported when decoding")
            valid = jnp.ones((batch, length), jnp.bool_) if padding_mask is None else padding_mask
            cache_index, mask, overflow = self.decode_state.append(valid)
            kv_length = self.decode_state.max_length
        else:
            check_length(self.config, length, "input")
            mask = key_mask(padding_mask)
            cache_index, kv_length, overflow = None, length, None
        if positions is None:
            positions = default_positions(length, 0 if cache_index is None else cache_index)
        x = self.embed(inputs, positions)
        x = self.decoder(
            x,
            mask=mask,
            positions=positions,
            cache_index=cache_index,
            kv_length=kv_length,
            segment_ids=segment_ids,
        )
        logits = self.head(x)
        return logits if overflow is None else poison_if(overflow, logits)

    def init_cache(self, batch_size: int, max_length: int | None = None, *, dtype=None) -> None:
        """Empties the KV cache for ``batch_size`` rows of up to ``max_length`` tokens."""
        max_length = max_length or self.config.max_length
        check_length(self.config, max_length, "the cache")
        self.decode_state = DecodeState(batch_size, max_length)
        self.decoder.init_cache(batch_size, max_length, dtype=dtype)
