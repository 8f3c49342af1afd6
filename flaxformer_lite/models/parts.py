"""The pieces the three models share: input embedding, attention biases, a layer tower with its
final norm, and the output head. Each reads its settings from a :class:`ModelConfig`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flaxformer_lite import ops
from flaxformer_lite.models.config import ModelConfig, sqrt_d_model
from flaxformer_lite.models.layers import DecoderLayer, EncoderLayer, make_layer_norm
from flaxformer_lite.nn.dense import Dense, param
from flaxformer_lite.nn.embed import Embed
from flaxformer_lite.nn.mlp import nonlinearity_of
from flaxformer_lite.nn.positions import RelativePositionBias, alibi
from flaxformer_lite.nn.stack import LayerStack


def token_embedding(cfg: ModelConfig, rngs: nnx.Rngs) -> Embed:
    """The ``[vocab, D]`` token table."""
    return Embed(
        cfg.vocab_size,
        cfg.d_model,
        init=cfg.kernel_init,
        dtype=cfg.dtype,
        param_dtype=cfg.param_dtype,
        rngs=rngs,
    )


def key_mask(valid: jax.Array | None) -> jax.Array | None:
    """``[B, S]`` bool (True = real key) -> an attention mask ``[B, 1, 1, S]``."""
    if valid is None:
        return None
    valid = jnp.asarray(valid)
    if valid.ndim != 2 or valid.dtype != jnp.bool_:
        raise ValueError(
            f"a padding mask must be bool [batch, length], got {valid.dtype}{valid.shape}"
        )
    return valid[:, None, None, :]


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
        self.dropout = nnx.Dropout(cfg.embedding_dropout, rngs=rngs)

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
        return self.dropout(x)


class Tower(nnx.Module):
    """A stack of layers with its position bias (relative / ALiBi) and, for pre-LN, final norm."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        num_layers: int,
        causal: bool,
        cross_attention: bool,
        rngs: nnx.Rngs,
    ):
        self.num_heads, self.positions = cfg.num_heads, cfg.positions
        self.relative_bias = (
            RelativePositionBias(
                cfg.num_heads,
                num_buckets=cfg.relative_buckets,
                max_distance=cfg.relative_max_distance,
                bidirectional=not causal,
                init=cfg.kernel_init,
                param_dtype=cfg.param_dtype,
                rngs=rngs,
            )
            if cfg.positions == "relative"
            else None
        )

        def make_layer(layer_rngs):
            if not causal:
                return EncoderLayer(cfg, num_layers=num_layers, rngs=layer_rngs)
            return DecoderLayer(
                cfg,
                num_layers=num_layers,
                cross_attention=cross_attention,
                rngs=layer_rngs,
            )

        self.layers = LayerStack(
            num_layers, make_layer, scan=cfg.scan_layers, remat=cfg.remat, rngs=rngs
        )
        self.final_norm = make_layer_norm(cfg, rngs) if cfg.norm_position == "pre" else None

    def __call__(
        self,
        x,
        context=None,
        *,
        mask=None,
        context_mask=None,
        positions=None,
        cache_index=None,
        kv_length=None,
        segment_ids=None,
    ):
        """``x [B, T, D]`` -> ``[B, T, D]``.

        ``kv_length`` is the self-attention key count (the cache length when decoding; T
        otherwise); ``cache_index`` the first cache slot of ``x``; ``segment_ids`` int
        ``[B, T]`` those of packed rows, for the self-attention.
        """
        length = x.shape[1]
        kv_length = kv_length or length
        bias = None
        if self.relative_bias is not None:
            start = 0 if cache_index is None else cache_index
            bias = self.relative_bias(start + jnp.arange(length), jnp.arange(kv_length))
        elif self.positions == "alibi":
            bias = alibi(self.num_heads, length, kv_length, cache_index)
        x = self.layers(
            x,
            context,
            mask=mask,
            bias=bias,
            context_mask=context_mask,
            positions=positions,
            cache_index=cache_index,
            segment_ids=segment_ids,
        )
        return x if self.final_norm is None else self.final_norm(x)

    def init_cache(
        self, batch_size: int, max_length: int, *, context_length: int | None = None, dtype=None
    ) -> None:
        self.layers.init_cache(batch_size, max_length, context_length=context_length, dtype=dtype)


class OutputHead(nnx.Module):
    """``[B, T, D]`` -> vocabulary logits (tied to the token table or separate), or a regression
    ``[B, T, output_dim]``; BERT's MLM transform (dense, activation, norm) first if configured."""

    def __init__(self, cfg: ModelConfig, *, tokens: Embed | None, rngs: nnx.Rngs):
        common = dict(init=cfg.kernel_init, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.nonlinearity = nonlinearity_of(cfg.activation)
        if cfg.mlm_transform and cfg.output_dim is None:
            self.transform = Dense(cfg.d_model, cfg.d_model, names=("embed", "embed_out"), **common)
            self.transform_norm = make_layer_norm(cfg, rngs)
        else:
            self.transform = self.transform_norm = None
        self.tokens = tokens if cfg.tie_embeddings and cfg.output_dim is None else None
        if cfg.output_dim is not None:
            self.projection = Dense(
                cfg.d_model, cfg.output_dim, names=("embed", "outputs"), **common
            )
        elif self.tokens is None:
            self.projection = Dense(
                cfg.d_model,
                cfg.vocab_size,
                names=("embed", "vocab"),
                use_bias=cfg.output_bias,
                **common,
            )
        else:
            self.projection = None
        self.bias = (
            param(rngs, nnx.initializers.zeros, (cfg.vocab_size,), ("vocab",), cfg.param_dtype)
            if self.tokens is not None and cfg.output_bias
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.transform is not None:
            x = self.transform_norm(self.nonlinearity(self.transform(x)))
        if self.projection is not None:
            return self.projection(x)
        logits = self.tokens.attend(x)
        return logits if self.bias is None else logits + self.bias[...].astype(logits.dtype)


def default_positions(length: int, start=0) -> jax.Array:
    """``start + [0, 1, ..., length - 1]``."""
    return start + jnp.arange(length)


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


def check_length(cfg: ModelConfig, length: int, what: str) -> None:
    """Learned position tables have ``max_length`` rows: longer inputs are an error."""
    if cfg.positions == "learned" and length > cfg.max_length:
        raise ValueError(
            f"{what} of length {length} exceeds max_length={cfg.max_length} "
            "(the learned position table)"
        )


def poison_if(overflow: jax.Array, outputs: jax.Array) -> jax.Array:
    """``outputs``, or NaN everywhere when ``overflow`` (decoding past the end of the cache)."""
    return jnp.where(overflow, jnp.asarray(jnp.nan, outputs.dtype), outputs)
