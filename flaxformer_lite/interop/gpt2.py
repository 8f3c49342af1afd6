"""GPT-2 (``GPT2LMHeadModel``) <-> our ``DecoderLM``.

GPT-2 is a pre-LN decoder with learned positions, LayerNorm, a fused q/k/v projection and a
GELU (tanh approximation, "gelu_new") MLP; its head is tied to the token table. Its projections
are ``Conv1D`` modules whose weights are stored ``[inputs, outputs]``, so they only need reshaping:
``c_attn.weight [D, 3 * H * Dh]`` is our fused kernel ``[D, 3, H, Dh]`` (q, k, v and then the
heads are the slow axes, as HF splits them), ``attn.c_proj.weight [H * Dh, D]`` is ``[H, Dh, D]``.
"""

from __future__ import annotations

from typing import Any

from flaxformer_lite.interop.common import (
    ZERO_BIASES,
    Rule,
    layer_rules,
    multi_head_mismatches,
    require,
)
from flaxformer_lite.models.config import ModelConfig

ARCHITECTURE = "GPT2LMHeadModel"
MODEL_TYPE = "gpt2"

# HF `activation_function` -> our activation ("gelu_new" and "gelu_pytorch_tanh" are both the
# tanh approximation; "gelu" is exact).
ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}
_ACTIVATION_NAMES = {ours: hf for hf, ours in reversed(ACTIVATIONS.items())}  # gelu_tanh->gelu_new

_LAYER = "decoder.layers.layers.{i}."
LAYER_RULES = (
    Rule("h.{i}.ln_1.weight", _LAYER + "self_attention_norm.scale"),
    Rule("h.{i}.ln_1.bias", _LAYER + "self_attention_norm.bias"),
    Rule("h.{i}.attn.c_attn.weight", _LAYER + "self_attention.qkv.kernel", "in_out", 1),
    Rule("h.{i}.attn.c_attn.bias", _LAYER + "self_attention.qkv.bias", "flat"),
    Rule("h.{i}.attn.c_proj.weight", _LAYER + "self_attention.out.kernel", "in_out", 2),
    Rule("h.{i}.attn.c_proj.bias", _LAYER + "self_attention.out.bias"),
    Rule("h.{i}.ln_2.weight", _LAYER + "mlp_norm.scale"),
    Rule("h.{i}.ln_2.bias", _LAYER + "mlp_norm.bias"),
    Rule("h.{i}.mlp.c_fc.weight", _LAYER + "mlp.wi.kernel", "in_out", 1),
    Rule("h.{i}.mlp.c_fc.bias", _LAYER + "mlp.wi.bias"),
    Rule("h.{i}.mlp.c_proj.weight", _LAYER + "mlp.wo.kernel", "in_out", 1),
    Rule("h.{i}.mlp.c_proj.bias", _LAYER + "mlp.wo.bias"),
)
MODEL_RULES = (
    Rule("wte.weight", "embed.tokens.embedding"),
    Rule("wpe.weight", "embed.positions.embedding"),
    Rule("ln_f.weight", "decoder.final_norm.scale"),
    Rule("ln_f.bias", "decoder.final_norm.bias"),
)
HEAD_RULE = Rule("lm_head.weight", "head.projection.kernel", "out_in", 1)
# Buffers some checkpoints carry (the causal mask of older versions), and a tied head stored
# beside the table it is tied to: no parameters of ours.
IGNORED = (r"h\.\d+\.attn\.(masked_)?bias",)
IGNORED_TIED = (*IGNORED, r"lm_head\.weight")


def hf_name(name: str) -> str:
    """Checkpoints of ``GPT2LMHeadModel`` prefix the body with ``transformer.``; the original
    OpenAI conversions (``GPT2Model``) do not. The rules use the bare names."""
    return name.removeprefix("transformer.")


def rules(cfg: ModelConfig) -> list[Rule]:
    """Every HF tensor of ``cfg``'s model and where it goes (``transformer.`` prefix removed)."""
    head = [] if cfg.tie_embeddings else [HEAD_RULE]
    return [*MODEL_RULES, *layer_rules(LAYER_RULES, cfg.num_decoder_layers), *head]


def ignored(cfg: ModelConfig) -> tuple[str, ...]:
    return IGNORED_TIED if cfg.tie_embeddings else IGNORED


def config_from_hf(hf: dict[str, Any], *, dtype: str = "float32") -> ModelConfig:
    """Our config for a HF ``GPT2Config`` dict (``config.json``).

    Raises:
      ValueError: naming every setting we cannot represent.
    """
    activation = hf.get("activation_function", "gelu_new")
    problems = []
    if activation not in ACTIVATIONS:
        problems.append(f"activation_function={activation!r} (supported: {sorted(ACTIVATIONS)})")
    if not hf.get("scale_attn_weights", True):
        problems.append("scale_attn_weights=false (attention logits are always scaled)")
    if hf.get("scale_attn_by_inverse_layer_idx", False):
        problems.append("scale_attn_by_inverse_layer_idx=true")
    if hf.get("add_cross_attention", False):
        problems.append("add_cross_attention=true")
    require(problems, "unsupported GPT-2 config")
    d_model = hf["n_embd"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=d_model,
        num_heads=hf["n_head"],
        d_ff=hf.get("n_inner") or 4 * d_model,  # null means 4 * n_embd
        num_encoder_layers=0,
        num_decoder_layers=hf["n_layer"],
        max_length=hf["n_positions"],
        embedding_dropout=hf.get("embd_pdrop", 0.1),
        attention_dropout=hf.get("attn_pdrop", 0.1),
        residual_dropout=hf.get("resid_pdrop", 0.1),
        norm="layernorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        norm_position="pre",
        positions="learned",
        activation=ACTIVATIONS[activation],
        tie_embeddings=hf.get("tie_word_embeddings", True),
        scale_embeddings=False,
        fused_qkv=True,
        qkv_bias=True,
        attention_out_bias=True,
        mlp_bias=True,
        output_bias=False,
        init="normal",
        init_std=hf.get("initializer_range", 0.02),
        scale_residual_init=True,
        dtype=dtype,
        param_dtype=dtype,
    )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` of a GPT-2 with ``cfg``'s architecture.

    Raises:
      ValueError: naming every setting of ``cfg`` that GPT-2 does not have.
    """
    require(mismatches(cfg), "this model is not a GPT-2")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.d_model,
        "n_head": cfg.num_heads,
        "n_inner": cfg.d_ff,
        "n_layer": cfg.num_decoder_layers,
        "n_positions": cfg.max_length,
        "embd_pdrop": cfg.embedding_dropout,
        "attn_pdrop": cfg.attention_dropout,
        "resid_pdrop": cfg.residual_dropout,
        "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": _ACTIVATION_NAMES[cfg.activation],
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "scale_attn_weights": True,
        "dtype": cfg.param_dtype,
        "torch_dtype": cfg.param_dtype,  # the key transformers 4.x reads
    }


def mismatches(cfg: ModelConfig) -> list[str]:
    """The settings of ``cfg`` that a GPT-2 cannot have (empty: it is a GPT-2)."""
    want = dict(
        kind="decoder",
        norm="layernorm",
        norm_bias=True,
        norm_position="pre",
        positions="learned",
        embed_norm=False,
        scale_embeddings=False,
        parallel_block=False,
        fused_qkv=True,
        qkv_bias=True,
        attention_out_bias=True,
        mlp_bias=True,
        output_bias=False,
        input_dim=None,
        output_dim=None,
        mlm_transform=False,
    )
    return multi_head_mismatches(cfg, "GPT-2", want, _ACTIVATION_NAMES, ZERO_BIASES)
