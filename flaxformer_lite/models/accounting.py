"""Counting a model's parameters and its training FLOPs per token, for MFU (whose denominator,
the devices' peak FLOP/s, is in ``flaxformer_lite.train.metrics``)."""

from __future__ import annotations

import numpy as np
from flax import nnx

from flaxformer_lite.models.build import abstract_model
from flaxformer_lite.models.config import ModelConfig

# Tables looked up rather than multiplied: "non-embedding" parameter counts leave them out.
_EMBEDDING_TABLES = ("tokens", "positions", "token_types")


def parameter_counts(model_or_config) -> dict[str, int]:
    """``{"total": ..., "non_embedding": ...}`` parameter counts.

    A config is counted with ``nnx.eval_shape`` (shapes only, nothing allocated). Shared tables
    (tied or source/target-shared embeddings) count once. ``non_embedding`` leaves out the token,
    position and token-type tables (Kaplan et al., 2020).
    """
    model = model_or_config
    if isinstance(model_or_config, ModelConfig):
        model = abstract_model(model_or_config)
    total = embedding = 0
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        size = int(np.prod(variable.shape))
        total += size
        if any(name in _EMBEDDING_TABLES for name in map(str, path)):
            embedding += size
    return {"total": total, "non_embedding": total - embedding}


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), for MFU.

    ``6 N`` for the matmul parameters N (every projection, the vocabulary projection, tied or
    not, and BERT's MLM transform; lookups are free) plus attention's logits and weighted sum,
    ``12 * layers * heads * head_dim * seq_len`` (PaLM, Appendix B), counted at half for causal
    self-attention, whose upper triangle need not be computed. For an encoder-decoder, per target
    token with source and target both ``seq_len`` long.
    """
    d, h, hk, dh, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_ff
    attention = d * h * dh * 2 + d * hk * dh * 2  # q and out; k and v
    gated = cfg.activation in ("swiglu", "geglu")
    mlp = d * f * (3 if gated else 2)
    enc, dec = cfg.num_encoder_layers, cfg.num_decoder_layers
    cross = attention if enc and dec else 0
    matmul_params = enc * (attention + mlp) + dec * (attention + cross + mlp)
    matmul_params += d * (cfg.output_dim or cfg.vocab_size)
    # Continuous inputs are projected (token ids are looked up, for free); an encoder-decoder's
    # decoder with a regression head also projects its continuous targets.
    matmul_params += d * (cfg.input_dim or 0)
    if cfg.kind == "encoder_decoder":
        matmul_params += d * (cfg.output_dim or 0)
    if cfg.mlm_transform and cfg.output_dim is None:
        matmul_params += d * d
    attention_flops = 12 * h * dh * seq_len * (enc + dec * (0.5 + (1 if enc else 0)))
    return float(6 * matmul_params + attention_flops)
