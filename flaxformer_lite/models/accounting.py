"""Counting a model's parameters and its training FLOPs per token, for MFU (whose denominator,
the devices' peak FLOP/s, is in ``flaxformer_lite.train.metrics``)."""

from __future__ import annotations

import numpy as np
from flax import nnx

from flaxformer_lite.choices import AFT_MIXERS
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


def training_flops_per_token(
    cfg: ModelConfig, seq_len: int, *, adapter_params: int | None = None
) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), for MFU: the work the model
    needs, whatever an implementation computes on top.

    ``6 N`` for the matmul parameters N applied to every token (every projection; the
    vocabulary projection, tied or not, and BERT's MLM transform, or instead, with
    ``num_classes``, the pooler and classifier applied once per sequence; lookups are free)
    plus the mixing of positions, ``12 * layers * H * Dh * keys`` for attention's logits and
    weighted sum (PaLM, Appendix B) with ``keys`` the keys a query sees on average: ``seq_len``,
    half of it for causal self-attention (the upper triangle need not be computed), those in
    its window with ``local_window``. AFT-full and AFT-local mix ``D`` features over ``seq_len``
    positions as attention does (``H * Dh -> D``); AFT-simple's mixing is elementwise (free). An
    encoder-decoder counts per target token, source and target both ``seq_len`` long. A piece of
    the user's (``models.pieces``) is counted as the built-in one in its place.

    With ``adapter_params`` (a LoRA run's adapters, the base frozen) the base's weight
    gradients are work no one needs: its matmuls count twice (forward, input gradients), the
    mixing three times, and each adapter parameter ``6`` per token.
    """
    forward = _forward_flops(cfg, seq_len, seq_len)
    if adapter_params is None:
        return 3 * forward / seq_len
    matmuls = _forward_flops(cfg, seq_len, seq_len, mixing=False)
    return (3 * forward - matmuls) / seq_len + 6 * adapter_params


def generation_flops(cfg: ModelConfig, prompt_len: int, new_tokens: int) -> float:
    """Forward FLOPs of one row's generation: a decoder LM runs its prompt and new tokens
    through its stack; an encoder-decoder encodes its source (the prompt) once and runs only
    the new tokens through its decoder, attending to the source. Counted as
    :func:`training_flops_per_token`'s forward third."""
    if cfg.kind.is_seq2seq:
        return _forward_flops(cfg, prompt_len, new_tokens)
    total = prompt_len + new_tokens
    return _forward_flops(cfg, total, total)


def _forward_flops(
    cfg: ModelConfig, source_len: int, target_len: int, *, mixing: bool = True
) -> float:
    """Forward FLOPs of one row: ``target_len`` tokens through the model (and an
    encoder-decoder's ``source_len`` through its encoder), 2 per multiply-add; those of the
    parameters' matmuls alone without ``mixing``."""
    d, h, hk, dh, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_ff
    query_out, key_value = 2 * d * h * dh, 2 * d * hk * dh
    self_attention = 4 * d * d if cfg.mixer in AFT_MIXERS else query_out + key_value
    mlp = d * f * (3 if cfg.activation in ("swiglu", "geglu") else 2)
    enc, dec = cfg.num_encoder_layers, cfg.num_decoder_layers
    if cfg.num_classes is not None:  # Encoder.classify: no vocabulary projection
        head = (d * d * cfg.pooler_dense + d * cfg.num_classes) / target_len
    else:
        head = d * (cfg.output_dim or cfg.vocab_size)
        head += d * d if cfg.mlm_transform and cfg.output_dim is None else 0
    # Continuous inputs are projected (token ids are looked up, for free); an encoder-decoder's
    # decoder with a regression head also projects its continuous targets.
    inputs = d * (cfg.input_dim or 0)
    mixing, source_keys = (_mixing_per_key(cfg), source_len) if mixing else (0, 0)
    if not cfg.kind.is_seq2seq:
        causal = cfg.kind.generates
        layers = enc + dec
        matmuls = layers * (self_attention + mlp) + head + inputs
        keys = _keys_per_query(cfg, target_len, causal=causal)
        return target_len * (2 * matmuls + 4 * layers * mixing * keys)
    encoder = source_len * (
        2 * (enc * (self_attention + mlp) + inputs)
        + 4 * enc * mixing * _keys_per_query(cfg, source_len, causal=False)
        + 2 * dec * key_value  # the cross-attention's keys and values, once per source token
    )
    target_inputs = d * (cfg.output_dim or 0)
    decoder = target_len * (
        2 * (dec * (self_attention + query_out + mlp) + head + target_inputs)
        + 4 * dec * (mixing * _keys_per_query(cfg, target_len, causal=True) + h * dh * source_keys)
    )
    return encoder + decoder


def _mixing_per_key(cfg: ModelConfig) -> int:
    """Multiply-adds of self-attention's logits (or of AFT's weights) per query and key, over
    the heads: ``H * Dh`` for attention, ``D`` for AFT-full and AFT-local, 0 for AFT-simple."""
    if cfg.mixer == "aft_simple":
        return 0
    return cfg.d_model if cfg.mixer in AFT_MIXERS else cfg.num_heads * cfg.head_dim


def _keys_per_query(cfg: ModelConfig, seq_len: int, *, causal: bool) -> float:
    """The keys a query of self-attention over ``seq_len`` positions sees, on average: all of
    them, half for a causal stack (the triangle), or the mean count within ``local_window`` and
    the global tokens' rows and columns."""
    if cfg.local_window is None or cfg.mixer in AFT_MIXERS:
        return seq_len / 2 if causal else float(seq_len)
    left, right = cfg.local_window
    right = 0 if causal else right
    query = np.arange(seq_len)
    first = np.maximum(query - left, 0)  # each query's window of keys [first, last]
    last = np.minimum(query + right, seq_len - 1)
    seen = last - first + 1
    g = min(cfg.global_tokens, seq_len)
    # global keys before a query's window; global queries see every key (within causality)
    seen = seen + np.minimum(first, g)
    seen = np.where(query < g, query + 1 if causal else seq_len, seen)
    return float(seen.mean())
