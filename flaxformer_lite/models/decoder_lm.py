"""GPT-style decoder-only language model (also LLaMA-style with the matching config)."""

from __future__ import annotations

import jax
from flax import nnx

from flaxformer_lite.models.config import ModelConfig
from flaxformer_lite.models.decode_state import decoder_inputs, new_decode_state
from flaxformer_lite.models.embedding import InputEmbedding, token_embedding
from flaxformer_lite.models.heads import OutputHead
from flaxformer_lite.models.layers import Tower


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
        features: bool = False,
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
          features: return the ``[B, T, D]`` input of ``self.head`` instead of its output (a
            chunked loss applies the head a block at a time).

        Returns:
          ``[B, T, V]`` logits (``[B, T, output_dim]`` with a regression head) in the
          compute dtype.
        """
        step = decoder_inputs(
            self,
            inputs,
            decode=decode,
            what="input",
            padding_mask=padding_mask,
            positions=positions,
            segment_ids=segment_ids,
        )
        x = self.embed(inputs, step.positions)
        x = self.decoder(
            x,
            mask=step.mask,
            positions=step.positions,
            cache_index=step.cache_index,
            kv_length=step.kv_length,
            segment_ids=segment_ids,
        )
        return step.poisoned(x if features else self.head(x))

    def init_cache(self, batch_size: int, max_length: int | None = None, *, dtype=None) -> None:
        """Empties the KV cache for ``batch_size`` rows of up to ``max_length`` tokens."""
        self.decode_state = new_decode_state(self.config, batch_size, max_length)
        self.decoder.init_cache(batch_size, self.decode_state.max_length, dtype=dtype)
