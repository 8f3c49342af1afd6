"""A model's first step: tokens (or continuous features) and their positions -> the ``[B, T, D]``
inputs of the first layer, built from a :class:`ModelConfig`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flaxformer_lite import ops
from flaxformer_lite.models.config import ModelConfig
from flaxformer_lite.models.layers import make_layer_norm
from flaxformer_lite.models.width import sqrt_d_model
from flaxformer_lite.nn.dense import Dense
from flaxformer_lite.nn.embed import Embed
from flaxformer_lite.nn.rngs import apply_dropout, dropout


def token_embedding(cfg: ModelConfig, rngs: nnx.Rngs) -> Embed:
    """The ``[vocab, D]`` token table."""
    common = dict(init=cfg.kernel_init, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
    return Embed(cfg.vocab_size, cfg.d_model, **common)


def default_positions(length: int, start=0) -> jax.Array:
    """``start + [0, 1, ..., length - 1]``."""
    return start + jnp.arange(length)


def check_length(cfg: ModelConfig, length: int, what: str) -> None:
    """Learned position tables have ``max_length`` rows: longer inputs are an error."""
    if cfg.positions == "learned" and length > cfg.max_length:
        raise ValueError(
            f"{what} of length {length} exceeds max_length={cfg.max_length} "
            "(the learned position table)"
        )


class InputEmbedding(nnx.Module):
    """Tokens (or continuous features) -> ``[B, T, D]`` inputs of the first layer.

    Token embeddings (times ``sqrt(d_model)`` when ``scale_embeddings``), or a linear projection
    of ``[B, T, input_dim]`` features; plus sinusoidal or learned positions; plus token-type
    embeddings; then the embedding norm (BERT) and dropout.

    Args:
      cfg: the model configuration.
      tokens: the token table, for token inputs.
      input_dim: the feature count of continuous inputs (instead of ``tokens``).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        tokens: Embed | None = None,
        input_dim: int | None = None,
        rngs: nnx.Rngs,
    ):
        if (tokens is None) == (input_dim is None):
            raise ValueError("InputEmbedding takes either a token table or an input_dim")
        self.cfg, self.tokens, self.input_dim = cfg, tokens, input_dim
        common = dict(init=cfg.kernel_init, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.features = (
            Dense(input_dim, cfg.d_model, names=("features", "embed"), **common)
            if input_dim is not None
            else None
        )
        self.positions = (
            Embed(cfg.max_length, cfg.d_model, names=("length", "embed"), **common)
            if cfg.positions == "learned"
            else None
        )
        self.token_types = (
            Embed(cfg.type_vocab_size, cfg.d_model, names=("token_types", "embed"), **common)
            if cfg.type_vocab_size
            else None
        )
        self.norm = make_layer_norm(cfg, rngs) if cfg.embed_norm else None
        self.dropout = dropout(cfg.embedding_dropout, rngs, "embedding")

    def __call__(
        self, inputs: jax.Array, positions: jax.Array, token_types: jax.Array | None = None
    ) -> jax.Array:
        """``inputs`` int ``[B, T]`` (or float ``[B, T, input_dim]``), ``positions`` ``[T]`` or
        ``[B, T]`` -> ``[B, T, D]`` in the compute dtype."""
        cfg = self.cfg
        if self.features is not None:
            if (
                inputs.ndim != 3
                or inputs.shape[-1] != self.input_dim
                or not jnp.issubdtype(inputs.dtype, jnp.floating)
            ):
                got = f"{inputs.dtype}{inputs.shape}"
                raise ValueError(
                    f"this model takes continuous inputs [batch, length, {self.input_dim}], "
                    f"got {got}"
                )
            x = self.features(inputs)
        else:
            if inputs.ndim != 2 or not jnp.issubdtype(inputs.dtype, jnp.integer):
                got = f"{inputs.dtype}{inputs.shape}"
                raise ValueError(f"this model takes token ids int [batch, length], got {got}")
            x = self.tokens(inputs) * jnp.asarray(sqrt_d_model(cfg), cfg.dtype)
        if cfg.positions == "sinusoidal":
            table = ops.sinusoidal_positions(positions, cfg.d_model, layout=cfg.sinusoidal_layout)
            x = x + table.astype(x.dtype)
        elif self.positions is not None:
            x = x + self.positions(positions)
        if self.token_types is not None:
            x = x + self.token_types(
                jnp.zeros(x.shape[:2], jnp.int32) if token_types is None else token_types
            )
        if self.norm is not None:
            x = self.norm(x)
        return apply_dropout(self.dropout, x)
