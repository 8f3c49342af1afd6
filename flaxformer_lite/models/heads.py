"""A model's last step: ``[B, T, D]`` -> vocabulary logits or regression outputs, built from a
:class:`ModelConfig`. (The encoder's sequence classifier, which pools first, is ``Encoder``'s.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from flaxformer_lite.models.config import ModelConfig
from flaxformer_lite.models.layers import make_layer_norm
from flaxformer_lite.models.width import output_multiplier
from flaxformer_lite.nn.dense import Dense, param
from flaxformer_lite.nn.embed import Embed
from flaxformer_lite.nn.mlp import nonlinearity_of
from flaxformer_lite.nn.sharding import gathered_for_compute


class OutputHead(nnx.Module):
    """``[B, T, D]`` -> vocabulary logits (tied to the token table or separate), or a regression
    ``[B, T, output_dim]``; BERT's MLM transform (dense, activation, norm) first if configured.
    Under muP the outputs are multiplied by ``1 / m`` (:func:`~.width.output_multiplier`)."""

    def __init__(self, cfg: ModelConfig, *, tokens: Embed | None, rngs: nnx.Rngs):
        common = dict(init=cfg.kernel_init, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.nonlinearity = nonlinearity_of(cfg.activation)
        self.multiplier = output_multiplier(cfg)
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
        if self.multiplier != 1.0:  # on the features: [B, T, D] is the smaller array
            x = x * jnp.asarray(self.multiplier, x.dtype)
        if self.projection is not None:
            return self.projection(x)
        logits = self.tokens.attend(x)
        return logits if self.bias is None else logits + self.bias[...].astype(logits.dtype)


def head_projection(model):
    """``[B, T', D] -> [B, T', V]``: ``model.head`` with its parameters gathered for compute, for
    a loop over blocks of positions (``ops.chunked_cross_entropy``); gradients flow through it."""
    head_def, head_state = nnx.split(model.head)
    head_state = jax.tree.map(
        lambda v: v.replace(gathered_for_compute(v[...], v.out_sharding)),
        head_state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return lambda x: nnx.merge(head_def, head_state)(x)
