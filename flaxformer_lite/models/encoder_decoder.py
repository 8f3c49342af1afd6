"""The paper's encoder-decoder Transformer (Vaswani et al., 2017)."""

from __future__ import annotations

import jax
from flax import nnx

from flaxformer_lite.models.config import ModelConfig
from flaxformer_lite.models.decode_state import decoder_inputs, new_decode_state
from flaxformer_lite.models.embedding import (
    InputEmbedding,
    check_length,
    default_positions,
    token_embedding,
)
from flaxformer_lite.models.heads import OutputHead
from flaxformer_lite.models.layers import Tower, key_mask


class EncoderDecoder(nnx.Module):
    """Source -> encoder; target (shifted right) -> causal decoder with cross-attention -> logits.

    With ``share_src_tgt_embeddings`` one token table serves source, target and (with
    ``tie_embeddings``) the output projection, as in the paper's shared-vocabulary models.

    Args:
      cfg: a config with encoder and decoder layers.
      rngs: ``nnx.Rngs`` with ``params`` (and ``dropout``, else ``default``) streams.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if not (cfg.num_encoder_layers and cfg.num_decoder_layers):
            raise ValueError(
                "EncoderDecoder needs num_encoder_layers > 0 and num_decoder_layers > 0"
            )
        self.config = cfg
        src_tokens = None if cfg.input_dim is not None else token_embedding(cfg, rngs)
        if cfg.output_dim is not None:
            tgt_tokens = None  # the decoder reads continuous targets
        elif cfg.share_src_tgt_embeddings and src_tokens is not None:
            tgt_tokens = src_tokens
        else:
            tgt_tokens = token_embedding(cfg, rngs)
        self.src_embed = InputEmbedding(cfg, tokens=src_tokens, input_dim=cfg.input_dim, rngs=rngs)
        self.tgt_embed = InputEmbedding(cfg, tokens=tgt_tokens, input_dim=cfg.output_dim, rngs=rngs)
        self.encoder = Tower(
            cfg,
            num_layers=cfg.num_encoder_layers,
            causal=False,
            cross_attention=False,
            rngs=rngs,
        )
        self.decoder = Tower(
            cfg,
            num_layers=cfg.num_decoder_layers,
            causal=True,
            cross_attention=True,
            rngs=rngs,
        )
        self.head = OutputHead(cfg, tokens=tgt_tokens, rngs=rngs)
        self.decode_state = nnx.data(None)  # a DecodeState after init_cache

    def encode(
        self,
        src: jax.Array,
        *,
        padding_mask: jax.Array | None = None,
        src_positions: jax.Array | None = None,
    ) -> jax.Array:
        """``src`` int ``[B, S]`` (or float ``[B, S, input_dim]``), ``padding_mask`` bool
        ``[B, S]`` (True at real tokens, False at padding; outputs there are meaningless) ->
        ``[B, S, D]``."""
        length = src.shape[1]
        check_length(self.config, length, "source")
        positions = default_positions(length) if src_positions is None else src_positions
        x = self.src_embed(src, positions)
        return self.encoder(x, mask=key_mask(padding_mask), positions=positions)

    def decode(
        self,
        tgt: jax.Array,
        encoded: jax.Array | None,
        *,
        padding_mask: jax.Array | None = None,
        tgt_positions: jax.Array | None = None,
        decode: bool = False,
        features: bool = False,
    ) -> jax.Array:
        """Logits ``[B, T, V]`` for the shifted target ``tgt`` given ``encoded [B, S, D]``, whose
        source padding ``padding_mask`` (bool ``[B, S]``) the cross-attention leaves out.

        ``tgt`` is int ``[B, T]``, or float ``[B, T, output_dim]`` with a regression head (then
        the outputs are ``[B, T, output_dim]``). With ``decode=True`` the target is appended to
        the KV cache from :meth:`init_cache` (one or more positions at a time); positions beyond
        its ``max_length`` get NaN outputs. A cache made with ``source_length`` also keeps the
        cross-attention keys/values: the first call passes ``encoded``, later calls ``None``
        (the encoder output is projected once, not at every step). ``features`` returns the
        ``[B, T, D]`` input of ``self.head`` instead of its output.
        """
        step = decoder_inputs(self, tgt, decode=decode, what="target", positions=tgt_positions)
        x = self.tgt_embed(tgt, step.positions)
        x = self.decoder(
            x,
            encoded,
            mask=step.mask,
            context_mask=key_mask(padding_mask),
            positions=step.positions,
            cache_index=step.cache_index,
            kv_length=step.kv_length,
        )
        return step.poisoned(x if features else self.head(x))

    def __call__(
        self,
        src: jax.Array,
        tgt: jax.Array,
        *,
        padding_mask: jax.Array | None = None,
        src_positions=None,
        tgt_positions=None,
        features: bool = False,
    ) -> jax.Array:
        """Teacher-forced logits ``[B, T, V]`` (``[B, T, output_dim]`` for regression);
        ``padding_mask`` is the source's, bool ``[B, S]``; ``features``: as for :meth:`decode`."""
        encoded = self.encode(src, padding_mask=padding_mask, src_positions=src_positions)
        return self.decode(
            tgt,
            encoded,
            padding_mask=padding_mask,
            tgt_positions=tgt_positions,
            features=features,
        )

    def init_cache(
        self,
        batch_size: int,
        max_length: int | None = None,
        *,
        source_length: int | None = None,
        dtype=None,
    ) -> None:
        """Empties the decoder's KV cache for ``batch_size`` rows of up to ``max_length`` target
        tokens; with ``source_length`` also the cross-attention cache of the encoder output."""
        self.decode_state = new_decode_state(self.config, batch_size, max_length)
        self.decoder.init_cache(
            batch_size, self.decode_state.max_length, context_length=source_length, dtype=dtype
        )
