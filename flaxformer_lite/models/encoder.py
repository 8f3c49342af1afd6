"""BERT-style encoder with a masked-LM head and a sequence-classification head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flaxformer_lite.models.config import ModelConfig
from flaxformer_lite.models.embedding import (
    InputEmbedding,
    check_length,
    default_positions,
    token_embedding,
)
from flaxformer_lite.models.heads import OutputHead
from flaxformer_lite.models.layers import Tower, key_mask
from flaxformer_lite.models.width import output_multiplier
from flaxformer_lite.nn.dense import Dense
from flaxformer_lite.nn.rngs import apply_dropout, dropout


class Encoder(nnx.Module):
    """Embeddings -> bidirectional layers -> (final norm), with heads.

    ``model.classify(...)`` gives ``[B, num_classes]`` from the first token (BERT's [CLS]) or the
    mean of the real tokens, through BERT's tanh pooler when ``pooler_dense``. (For sequence
    regression use ``num_classes=1``.) ``model(...)`` gives what the model is for, as Hugging
    Face's BERT classes do: the class logits of :meth:`classify` with ``num_classes`` (a
    sequence classifier, ``BertForSequenceClassification``), else masked-LM logits
    ``[B, T, V]`` (``BertForMaskedLM``; a regression ``[B, T, output_dim]`` with
    ``output_dim``). A classifier's masked-LM head, if its config has one, stays reachable as
    ``model.head(model.encode(...))``.

    Hugging Face's call arguments become ours with ``flaxformer_lite.interop.hf_arguments``.

    Args:
      cfg: a config with ``num_encoder_layers > 0`` (decoder layers are ignored).
      rngs: ``nnx.Rngs`` with ``params`` (and ``dropout``, else ``default``) streams.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if not cfg.num_encoder_layers:
            raise ValueError("Encoder needs num_encoder_layers > 0")
        self.config = cfg
        tokens = None if cfg.input_dim is not None else token_embedding(cfg, rngs)
        self.embed = InputEmbedding(cfg, tokens=tokens, input_dim=cfg.input_dim, rngs=rngs)
        self.encoder = Tower(
            cfg,
            num_layers=cfg.num_encoder_layers,
            causal=False,
            cross_attention=False,
            rngs=rngs,
        )
        self.head = OutputHead(cfg, tokens=tokens, rngs=rngs)
        common = dict(init=cfg.kernel_init, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        with_classifier = cfg.num_classes is not None
        self.pooler = (
            Dense(cfg.d_model, cfg.d_model, names=("embed", "embed_out"), **common)
            if with_classifier and cfg.pooler_dense
            else None
        )
        self.classifier = (
            Dense(cfg.d_model, cfg.num_classes, names=("embed", "classes"), **common)
            if with_classifier
            else None
        )
        self.classifier_dropout = dropout(cfg.residual_dropout, rngs, "residual")

    def encode(
        self,
        inputs: jax.Array,
        *,
        padding_mask: jax.Array | None = None,
        token_types: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Contextual representations ``[B, T, D]``.

        Args:
          inputs: int ``[B, T]`` tokens (float ``[B, T, input_dim]`` with ``input_dim``).
          padding_mask: bool ``[B, T]``, True at real tokens, False at padding: no position
            attends to padding (the outputs at padded positions are meaningless).
          token_types: int ``[B, T]`` segment A/B ids (``type_vocab_size > 0``); default 0.
          positions: ``[T]`` or ``[B, T]``; default ``arange(T)``.
          segment_ids: int ``[B, T]`` for packed sequences.

        Raises:
          ValueError: a mask or token types not ``[B, T]``, or token types for a model without
            token-type embeddings.
        """
        token_types = self._token_types(inputs, token_types)
        length = inputs.shape[1]
        check_length(self.config, length, "input")
        positions = default_positions(length) if positions is None else positions
        x = self.embed(inputs, positions, token_types)
        return self.encoder(
            x, mask=key_mask(padding_mask), positions=positions, segment_ids=segment_ids
        )

    def __call__(self, inputs: jax.Array, **kwargs) -> jax.Array:
        """With ``num_classes``, the class logits ``[B, num_classes]`` of :meth:`classify`;
        otherwise masked-LM logits ``[B, T, V]`` (``[B, T, output_dim]`` for
        regression). ``inputs`` and keyword arguments as :meth:`encode`."""
        if self.classifier is not None:
            return self.classify(inputs, **kwargs)
        return self.head(self.encode(inputs, **kwargs))

    def classify(
        self, inputs: jax.Array, *, padding_mask: jax.Array | None = None, **kwargs
    ) -> jax.Array:
        """Sequence logits ``[B, num_classes]``; arguments as :meth:`encode` (the padding mask
        also limits mean pooling to the real tokens)."""
        if self.classifier is None:
            raise ValueError("classify needs a config with num_classes")
        hidden = self.encode(inputs, padding_mask=padding_mask, **kwargs)
        if self.config.pooling == "first":
            pooled = hidden[:, 0]
        else:
            weights = (
                jnp.ones(hidden.shape[:2], hidden.dtype)
                if padding_mask is None
                else jnp.asarray(padding_mask).astype(hidden.dtype)
            )
            pooled = jnp.einsum("btd,bt->bd", hidden, weights) / jnp.maximum(
                weights.sum(axis=1, keepdims=True), 1
            )
        if self.pooler is not None:
            pooled = jnp.tanh(self.pooler(pooled))
        multiplier = output_multiplier(self.config)  # muP's 1 / m, as OutputHead's
        if multiplier != 1.0:
            pooled = pooled * jnp.asarray(multiplier, pooled.dtype)
        return self.classifier(apply_dropout(self.classifier_dropout, pooled))

    def _token_types(self, inputs, token_types) -> jax.Array | None:
        """``token_types`` checked: int ``[B, T]``, for a model with token-type embeddings."""
        if token_types is None:
            return None
        if not self.config.type_vocab_size:
            raise ValueError("token types need a config with type_vocab_size > 0")
        token_types = jnp.asarray(token_types)
        if token_types.shape != inputs.shape[:2] or not jnp.issubdtype(
            token_types.dtype, jnp.integer
        ):
            got = f"{token_types.dtype}{token_types.shape}"
            raise ValueError(
                f"token types must be int {list(inputs.shape[:2])} like the inputs, got {got}"
            )
        return token_types
