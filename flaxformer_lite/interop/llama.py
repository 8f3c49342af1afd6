"""Llama (``LlamaForCausalLM``) <-> our ``DecoderLM``.

Llama is a pre-norm decoder with RMSNorm, rotary positions in the "half" (``rotate_half``) layout,
a SwiGLU MLP, grouped-query attention and, optionally, a head tied to the token table. Its
projections are ``torch.nn.Linear`` weights stored ``[outputs, inputs]``: each is transposed and
then reshaped, e.g. ``q_proj.weight [H * Dh, D]`` -> our ``[D, H, Dh]`` and
``o_proj.weight [D, H * Dh]`` -> our ``[H, Dh, D]``. HF's GQA gives query head ``h`` the key/value
head ``h // (H / Hk)``, which is also ours, so heads need no permutation.

RoPE settings come in two styles: transformers 4.x writes ``rope_theta`` and ``rope_scaling``,
5.x one ``rope_parameters`` dict holding ``rope_theta`` and the scaling. Both are read; the 4.x
style is written, which both versions load.
"""

from __future__ import annotations

from typing import Any

from flaxformer_lite import ops
from flaxformer_lite.interop.common import Rule, layer_rules, require
from flaxformer_lite.models.config import ModelConfig

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"
# HF rope types we compute exactly ("dynamic", "yarn", "longrope" are not implemented).
ROPE_TYPES = ("default", "linear", "llama3")

_LAYER = "decoder.layers.layers.{i}."
_ATTENTION = (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value"))
_MLP = (("gate_proj", "wi_gate"), ("up_proj", "wi"))  # SwiGLU: silu(x W_gate) * (x W_up)


def rules(cfg: ModelConfig) -> list[Rule]:
    """Every HF tensor of ``cfg``'s model and where it goes."""
    hf, ours = "model.layers.{i}.", _LAYER
    layer = [
        Rule(hf + "input_layernorm.weight", ours + "self_attention_norm.scale"),
        *(
            Rule(hf + f"self_attn.{a}.weight", ours + f"self_attention.{b}.kernel", "out_in", 1)
            for a, b in _ATTENTION
        ),
        Rule(hf + "self_attn.o_proj.weight", ours + "self_attention.out.kernel", "out_in", 2),
        Rule(hf + "post_attention_layernorm.weight", ours + "mlp_norm.scale"),
        *(Rule(hf + f"mlp.{a}.weight", ours + f"mlp.{b}.kernel", "out_in", 1) for a, b in _MLP),
        Rule(hf + "mlp.down_proj.weight", ours + "mlp.wo.kernel", "out_in", 1),
    ]
    if cfg.qkv_bias:  # HF's `attention_bias` adds all four biases; config_from_hf sets both
        layer += [
            Rule(hf + f"self_attn.{a}.bias", ours + f"self_attention.{b}.bias", "flat")
            for a, b in _ATTENTION
        ]
    if cfg.attention_out_bias:
        layer.append(Rule(hf + "self_attn.o_proj.bias", ours + "self_attention.out.bias"))
    if cfg.mlp_bias:
        layer += [Rule(hf + f"mlp.{a}.bias", ours + f"mlp.{b}.bias") for a, b in _MLP]
        layer.append(Rule(hf + "mlp.down_proj.bias", ours + "mlp.wo.bias"))
    model = [
        Rule("model.embed_tokens.weight", "embed.tokens.embedding"),
        Rule("model.norm.weight", "decoder.final_norm.scale"),
    ]
    if not cfg.tie_embeddings:
        model.append(Rule("lm_head.weight", "head.projection.kernel", "out_in", 1))
    return [*model, *layer_rules(layer, cfg.num_decoder_layers)]


def hf_name(name: str) -> str:
    return name


def ignored(cfg: ModelConfig) -> tuple[str, ...]:
    # Older checkpoints stored the RoPE frequencies as a buffer; a tied head may be stored too.
    buffers = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)
    return (*buffers, r"lm_head\.weight") if cfg.tie_embeddings else buffers


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, ops.RopeScaling | None]:
    """``(theta, scaling)`` from either config style.

    Raises:
      ValueError: an unsupported rope type, or keys we do not understand.
    """
    if hf.get("rope_parameters") is not None:  # transformers 5.x
        params = dict(hf["rope_parameters"])
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    else:  # transformers 4.x: a null rope_scaling is plain RoPE
        params = dict(hf.get("rope_scaling") or {"rope_type": "default"})
        theta = hf.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"unsupported Llama config: rope type {rope_type!r} (supported: {ROPE_TYPES})"
        )
    try:
        return float(theta), ops.RopeScaling.from_dict({**params, "rope_type": rope_type})
    except ValueError as e:
        raise ValueError(f"unsupported Llama config: rope settings {params}: {e}") from None


def config_from_hf(hf: dict[str, Any], *, dtype: str = "float32") -> ModelConfig:
    """Our config for a HF ``LlamaConfig`` dict (``config.json``).

    Raises:
      ValueError: naming every setting we cannot represent.
    """
    problems = []
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (Llama's SwiGLU needs 'silu')")
    require(problems, "unsupported Llama config")
    theta, scaling = rope_from_hf(hf)
    bias = hf.get("attention_bias", False)
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        num_heads=hf["num_attention_heads"],
        # Absent, null or 0 in config.json: the default, which ModelConfig derives.
        num_kv_heads=hf.get("num_key_value_heads") or None,
        head_dim=hf.get("head_dim") or None,
        d_ff=hf["intermediate_size"],
        num_encoder_layers=0,
        num_decoder_layers=hf["num_hidden_layers"],
        max_length=hf.get("max_position_embeddings", 2048),
        embedding_dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        residual_dropout=0.0,
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        norm_position="pre",
        positions="rope",
        rope_base=theta,
        rope_layout="half",
        rope_scaling=scaling,
        activation="swiglu",
        # LlamaConfig's default is an untied head.
        tie_embeddings=hf.get("tie_word_embeddings", False),
        scale_embeddings=False,
        qkv_bias=bias,
        attention_out_bias=bias,
        mlp_bias=hf.get("mlp_bias", False),
        output_bias=False,
        init="normal",
        init_std=hf.get("initializer_range", 0.02),
        dtype=dtype,
        param_dtype=dtype,
    )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` of a Llama with ``cfg``'s architecture (transformers 4.x rope keys).

    Raises:
      ValueError: naming every setting of ``cfg`` that Llama does not have.
    """
    require(mismatches(cfg), "this model is not a Llama")
    scaling = cfg.rope_scaling
    rope_scaling = None
    if scaling is not None and scaling.type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": scaling.factor}
    elif scaling is not None:
        rope_scaling = {
            "rope_type": "llama3",
            **{
                name: getattr(scaling, name)
                for name in (
                    "factor",
                    "low_freq_factor",
                    "high_freq_factor",
                    "original_max_position_embeddings",
                )
            },
        }
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.num_decoder_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_length,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "rope_scaling": rope_scaling,
        "attention_bias": cfg.qkv_bias,
        "attention_dropout": cfg.attention_dropout,
        "mlp_bias": cfg.mlp_bias,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "pretraining_tp": 1,
        "dtype": cfg.param_dtype,
        "torch_dtype": cfg.param_dtype,  # the key transformers 4.x reads
    }


def mismatches(cfg: ModelConfig) -> list[str]:
    """The settings of ``cfg`` that a Llama cannot have (empty: it is a Llama)."""
    want = dict(
        kind="decoder",
        norm="rmsnorm",
        norm_position="pre",
        positions="rope",
        rope_layout="half",
        activation="swiglu",
        embed_norm=False,
        scale_embeddings=False,
        parallel_block=False,
        fused_qkv=False,
        output_bias=False,
        input_dim=None,
        output_dim=None,
        mlm_transform=False,
        embedding_dropout=0.0,
        residual_dropout=0.0,
    )
    problems = [
        f"{name}={getattr(cfg, name)!r} (Llama has {value!r})"
        for name, value in want.items()
        if getattr(cfg, name) != value
    ]
    if cfg.qkv_bias != cfg.attention_out_bias:
        problems.append(
            f"qkv_bias={cfg.qkv_bias} with attention_out_bias={cfg.attention_out_bias} "
            "(Llama's attention_bias sets both)"
        )
    if cfg.rope_scaling is not None and cfg.rope_scaling.type not in ROPE_TYPES:
        problems.append(f"rope_scaling.type={cfg.rope_scaling.type!r} (HF has {ROPE_TYPES})")
    return problems
