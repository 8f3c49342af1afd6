"""Marian (``MarianMTModel``, the OPUS-MT translation models) <-> our ``EncoderDecoder``.

Marian is the paper's encoder-decoder: post-LN layers (LayerNorm, eps 1e-5), sinusoidal positions
counted from 0 and laid out ``[sin | cos]`` (our ``sinusoidal_layout="concat"``), token embeddings
times ``sqrt(d_model)`` when ``scale_embedding``, no embedding norm, biases everywhere, and one
token table for source, target and output (``share_encoder_decoder_embeddings``,
``tie_word_embeddings``) plus a bias on the logits, ``final_logits_bias [1, V]``. Projections are
``torch.nn.Linear`` weights stored ``[outputs, inputs]``: transposed, then reshaped.

The fixed position tables ``model.{encoder,decoder}.embed_positions.weight`` are not parameters:
recent ``transformers`` does not save them, older checkpoints do; both load, and they are ignored
(we compute the same table).

A checkpoint with ``tie_word_embeddings: false`` is read as transformers 5.x builds it: then
nothing is tied, not even the source and target tables to ``model.shared`` (4.x did tie those),
so ``model.encoder.embed_tokens`` and ``model.decoder.embed_tokens`` are our source and target
tables and ``model.shared`` (unused by that model's forward pass) is ignored. A shared table with
a separate head is written under all three names, which both versions load alike.

Pad, EOS and decoder-start ids are the caller's business: our model
takes the shifted target. :func:`config_to_hf` writes the OPUS-MT conventions (EOS 0; pad and
decoder start the last id), which only generation and training in ``transformers`` read.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flaxformer_lite.interop.common import (
    ZERO_BIASES,
    Rule,
    layer_rules,
    multi_head_mismatches,
    require,
)
from flaxformer_lite.models.config import ModelConfig

ARCHITECTURE = "MarianMTModel"
MODEL_TYPE = "marian"
NORM_EPS = 1e-5  # HF's Marian layers are nn.LayerNorm(d_model) with torch's default eps

# HF `activation_function` -> our activation. OPUS-MT models use "swish" (= SiLU).
ACTIVATIONS = {
    "swish": "silu",
    "silu": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}
_ACTIVATION_NAMES = {"silu": "swish", "gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}


@dataclasses.dataclass(frozen=True)
class _RowRule(Rule):
    """A vector of ours that HF stores as one row, ``[1, N]`` (``final_logits_bias``)."""

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (1, *shape)


_ATTENTION = (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value"))


def _attention_rules(hf: str, ours: str) -> list[Rule]:
    """``hf`` an HF attention module prefix (``...self_attn.``), ``ours`` our attention's."""
    return [
        *(Rule(f"{hf}{a}.weight", f"{ours}{b}.kernel", "out_in", 1) for a, b in _ATTENTION),
        *(Rule(f"{hf}{a}.bias", f"{ours}{b}.bias", "flat") for a, b in _ATTENTION),
        Rule(hf + "out_proj.weight", ours + "out.kernel", "out_in", 2),
        Rule(hf + "out_proj.bias", ours + "out.bias"),
    ]


def _norm_rules(hf: str, ours: str) -> list[Rule]:
    return [Rule(hf + "weight", ours + "scale"), Rule(hf + "bias", ours + "bias")]


def _layer(stack: str) -> list[Rule]:
    """The rules of one layer of ``stack`` ("encoder" or "decoder"), with ``{i}`` for its index."""
    hf, ours = f"model.{stack}.layers.{{i}}.", f"{stack}.layers.layers.{{i}}."
    rules = [
        *_attention_rules(hf + "self_attn.", ours + "self_attention."),
        *_norm_rules(hf + "self_attn_layer_norm.", ours + "self_attention_norm."),
    ]
    if stack == "decoder":
        rules += [
            *_attention_rules(hf + "encoder_attn.", ours + "cross_attention."),
            *_norm_rules(hf + "encoder_attn_layer_norm.", ours + "cross_attention_norm."),
        ]
    return [
        *rules,
        Rule(hf + "fc1.weight", ours + "mlp.wi.kernel", "out_in", 1),
        Rule(hf + "fc1.bias", ours + "mlp.wi.bias"),
        Rule(hf + "fc2.weight", ours + "mlp.wo.kernel", "out_in", 1),
        Rule(hf + "fc2.bias", ours + "mlp.wo.bias"),
        *_norm_rules(hf + "final_layer_norm.", ours + "mlp_norm."),
    ]


ENCODER_LAYER_RULES = tuple(_layer("encoder"))
DECODER_LAYER_RULES = tuple(_layer("decoder"))


def rules(cfg: ModelConfig) -> list[Rule]:
    """Every HF tensor of ``cfg``'s model and where it goes.

    A table shared by several modules is one parameter of ours, found under the first of its
    paths in NNX's (sorted) order: ``head.tokens`` when the head is tied, else the embedding's.
    """
    tgt_table = "head.tokens.embedding" if cfg.tie_embeddings else "tgt_embed.tokens.embedding"
    if cfg.share_src_tgt_embeddings:
        shared = tgt_table if cfg.tie_embeddings else "src_embed.tokens.embedding"
        model = [Rule("model.shared.weight", shared)]
        if not cfg.tie_embeddings:  # transformers 5.x then reads untied copies (module doc)
            model += [
                Rule(f"model.{side}.embed_tokens.weight", shared) for side in ("encoder", "decoder")
            ]
    else:
        model = [
            Rule("model.encoder.embed_tokens.weight", "src_embed.tokens.embedding"),
            Rule("model.decoder.embed_tokens.weight", tgt_table),
        ]
    if cfg.tie_embeddings:
        model.append(_RowRule("final_logits_bias", "head.bias"))
    else:
        model += [
            Rule("lm_head.weight", "head.projection.kernel", "out_in", 1),
            _RowRule("final_logits_bias", "head.projection.bias"),
        ]
    return [
        *model,
        *layer_rules(ENCODER_LAYER_RULES, cfg.num_encoder_layers),
        *layer_rules(DECODER_LAYER_RULES, cfg.num_decoder_layers),
    ]


def hf_name(name: str) -> str:
    return name


def ignored(cfg: ModelConfig) -> tuple[str, ...]:
    """The fixed position tables, and copies of a shared or tied table that checkpoints may
    store beside it (older conversions store every alias)."""
    names = [r"model\.(encoder|decoder)\.embed_positions\.weight"]
    if cfg.share_src_tgt_embeddings:
        names.append(r"model\.(encoder|decoder)\.embed_tokens\.weight")
    else:  # untied in transformers 5.x: a table the model does not use (module doc)
        names.append(r"model\.shared\.weight")
    if cfg.tie_embeddings:
        names.append(r"lm_head\.weight")
    return tuple(names)


def config_from_hf(hf: dict[str, Any], *, dtype: str = "float32") -> ModelConfig:
    """Our config for a HF ``MarianConfig`` dict (``config.json``).

    ``activation_dropout`` and the layer-drop rates (training only) are not represented.

    Raises:
      ValueError: naming every setting we cannot represent.
    """
    activation = hf.get("activation_function", "gelu")
    problems = []
    if activation not in ACTIVATIONS:
        problems.append(f"activation_function={activation!r} (supported: {sorted(ACTIVATIONS)})")
    for encoder, decoder in (
        ("encoder_attention_heads", "decoder_attention_heads"),
        ("encoder_ffn_dim", "decoder_ffn_dim"),
    ):
        if hf[encoder] != hf[decoder]:
            problems.append(f"{encoder}={hf[encoder]} != {decoder}={hf[decoder]}")
    decoder_vocab = hf.get("decoder_vocab_size")
    if decoder_vocab is not None and decoder_vocab != hf["vocab_size"]:
        problems.append(
            f"decoder_vocab_size={decoder_vocab} != vocab_size={hf['vocab_size']} "
            "(one vocabulary size for both sides)"
        )
    if hf["d_model"] % hf["encoder_attention_heads"]:
        problems.append(
            f"d_model={hf['d_model']} not divisible by {hf['encoder_attention_heads']} heads"
        )
    require(problems, "unsupported Marian config")
    dropout = float(hf.get("dropout", 0.1))
    tied = hf.get("tie_word_embeddings", True)
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=hf["d_model"],
        num_heads=hf["encoder_attention_heads"],
        d_ff=hf["encoder_ffn_dim"],
        num_encoder_layers=hf["encoder_layers"],
        num_decoder_layers=hf["decoder_layers"],
        max_length=hf.get("max_position_embeddings", 1024),
        embedding_dropout=dropout,
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        residual_dropout=dropout,
        norm="layernorm",
        norm_eps=NORM_EPS,
        norm_position="post",
        positions="sinusoidal",
        sinusoidal_layout="concat",
        activation=ACTIVATIONS[activation],
        tie_embeddings=tied,
        share_src_tgt_embeddings=tied and hf.get("share_encoder_decoder_embeddings", True),
        scale_embeddings=hf.get("scale_embedding", False),
        fused_qkv=False,
        qkv_bias=True,
        attention_out_bias=True,
        mlp_bias=True,
        output_bias=True,
        init="normal",
        init_std=hf.get("init_std", 0.02),
        dtype=dtype,
        param_dtype=dtype,
    )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` of a Marian with ``cfg``'s architecture.

    Raises:
      ValueError: naming every setting of ``cfg`` that Marian does not have.
    """
    require(mismatches(cfg), "this model is not a Marian")
    pad = cfg.vocab_size - 1  # the OPUS-MT convention; HF's default (58100) may not fit
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "decoder_vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "encoder_layers": cfg.num_encoder_layers,
        "decoder_layers": cfg.num_decoder_layers,
        "encoder_attention_heads": cfg.num_heads,
        "decoder_attention_heads": cfg.num_heads,
        "encoder_ffn_dim": cfg.d_ff,
        "decoder_ffn_dim": cfg.d_ff,
        "max_position_embeddings": cfg.max_length,
        "activation_function": _ACTIVATION_NAMES[cfg.activation],
        "dropout": cfg.residual_dropout,
        "attention_dropout": cfg.attention_dropout,
        "activation_dropout": 0.0,
        "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0,
        "scale_embedding": cfg.scale_embeddings,
        "share_encoder_decoder_embeddings": cfg.share_src_tgt_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings,
        "init_std": cfg.init_std,
        "is_encoder_decoder": True,
        "pad_token_id": pad,
        "decoder_start_token_id": pad,
        "eos_token_id": 0,
        "forced_eos_token_id": 0,
        "dtype": cfg.param_dtype,
        "torch_dtype": cfg.param_dtype,  # the key transformers 4.x reads
    }


def mismatches(cfg: ModelConfig) -> list[str]:
    """The settings of ``cfg`` that a Marian cannot have (empty: it is a Marian)."""
    want = dict(
        kind="encoder_decoder",
        norm="layernorm",
        norm_bias=True,
        norm_eps=NORM_EPS,
        norm_position="post",
        positions="sinusoidal",
        sinusoidal_layout="concat",
        embed_norm=False,
        parallel_block=False,
        fused_qkv=False,
        qkv_bias=True,
        attention_out_bias=True,
        mlp_bias=True,
        output_bias=True,
        input_dim=None,
        output_dim=None,
        mlm_transform=False,
    )
    problems = multi_head_mismatches(cfg, "Marian", want, _ACTIVATION_NAMES, ZERO_BIASES)
    if cfg.embedding_dropout != cfg.residual_dropout:
        problems.append(
            f"embedding_dropout={cfg.embedding_dropout} != residual_dropout="
            f"{cfg.residual_dropout} (Marian has one dropout rate)"
        )
    return problems
