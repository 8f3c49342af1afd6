"""The values the model's settings choose from, known without JAX: the config checks a setting
against them (so reading and checking a config imports no JAX), and the module that implements
a choice takes its names from here.

  names                      implemented in
  ACTIVATIONS                nn.mlp (the nonlinearities)
  INIT_SCHEMES               nn.dense
  REMAT_NAMES                nn.stack.REMAT_POLICIES
  AFT_MIXERS                 nn.attention_free
  ROPE_LAYOUTS, RopeScaling  ops.rope
  SINUSOIDAL_LAYOUTS         ops.positions
  PARAMETRIZATIONS           nn.parametrization
  the piece registries       ops.attention_choice (ATTENTION), models.pieces (the others)

The piece registries (:class:`~flaxformer_lite.registry.Registry`) are the extension points of
the model: ``model.attention_implementation``, ``mixer``, ``positions``, ``norm`` and
``feed_forward`` (``models/pieces.py`` says what each name stands for and how to add one).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from flaxformer_lite.registry import Registry

# activation name -> (nonlinearity, gated)
ACTIVATIONS = {
    **{name: (name, False) for name in ("relu", "gelu", "gelu_tanh", "silu")},
    "swiglu": ("silu", True),  # Shazeer 2020, LLaMA
    "geglu": ("gelu", True),
}
INIT_SCHEMES = ("xavier", "normal")
REMAT_NAMES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
AFT_MIXERS = ("aft_full", "aft_local", "aft_simple")
SINUSOIDAL_LAYOUTS = ("interleaved", "concat")
PARAMETRIZATIONS = ("standard", "mup")
# The logical axes whose size may grow with the model's width (d_model, d_ff, heads, head_dim).
WIDTH_AXES = frozenset(
    {"embed", "embed_out", "mlp", "heads", "kv_heads", "qkv_heads", "head_dim", "aft_features"}
)


ROPE_SCALING_TYPES = ("linear", "ntk", "llama3", "dynamic")
ROPE_LAYOUTS = ("half", "interleaved")

_LLAMA3_FIELDS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Hugging Face ``rope_scaling`` / ``rope_parameters`` keys that ``RopeScaling.from_dict`` reads.
# "rope_theta" (transformers 5.x) is the base, which callers pass to ``apply_rope`` separately.
_HF_KEYS = frozenset({"rope_type", "type", "factor", "rope_theta", *_LLAMA3_FIELDS})


def _require_positive(name: str, value: Any) -> None:
    # Booleans are numbers to Python but always a config mistake here.
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"RopeScaling.{name} must be a positive number, got {value!r}")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How to stretch RoPE frequencies to reach beyond the training context length.

    Frozen and hashable, so it can be a static argument of ``jax.jit``.

    Attributes:
        type: ``"linear"`` (position interpolation: every frequency divided by ``factor``),
            ``"ntk"`` (NTK-aware static scaling of the base by ``factor ** (Dh / (Dh - 2))``),
            ``"llama3"`` (Llama 3.1: only the low frequencies are divided by ``factor``) or
            ``"dynamic"`` (Hugging Face's dynamic NTK: the base recomputed from the current
            length ``L`` once it exceeds ``original_max_position_embeddings``).
        factor: The context-length multiplier, e.g. 8.0 for Llama 3.1.
        low_freq_factor: llama3 only. Wavelengths longer than
            ``original_max_position_embeddings / low_freq_factor`` are fully scaled.
        high_freq_factor: llama3 only. Wavelengths shorter than
            ``original_max_position_embeddings / high_freq_factor`` are left unchanged.
        original_max_position_embeddings: llama3 and dynamic. The pre-training context length
            (for dynamic, Hugging Face's ``max_position_embeddings``).
    """

    type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.type not in ROPE_SCALING_TYPES:
            raise ValueError(
                f"RopeScaling.type must be one of {ROPE_SCALING_TYPES}, got {self.type!r}"
            )
        _require_positive("factor", self.factor)
        _require_positive("low_freq_factor", self.low_freq_factor)
        _require_positive("high_freq_factor", self.high_freq_factor)
        # Equal factors would divide by zero in the llama3 interpolation weight.
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                "RopeScaling.high_freq_factor must be greater than low_freq_factor, got "
                f"high_freq_factor={self.high_freq_factor!r}, "
                f"low_freq_factor={self.low_freq_factor!r}"
            )
        if (
            isinstance(self.original_max_position_embeddings, bool)
            or not isinstance(self.original_max_position_embeddings, int)
            or self.original_max_position_embeddings < 1
        ):
            raise ValueError(
                "RopeScaling.original_max_position_embeddings must be a positive int, got "
                f"{self.original_max_position_embeddings!r}"
            )

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> RopeScaling | None:
        """Builds a scaling from a Hugging Face ``rope_scaling`` (or 5.x ``rope_parameters``) dict.

        The type is read from ``"rope_type"``, falling back to the older ``"type"`` key, as
        Hugging Face does. Missing llama3 fields take Llama 3.1's values (the dataclass defaults).

        Args:
            config: e.g. ``{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}``.

        Returns:
            The scaling, or None for ``rope_type == "default"`` (plain RoPE).

        Raises:
            ValueError: The type is missing or unsupported (e.g. "yarn"), a key is
                unknown, or a value is invalid.
        """
        unknown_keys = sorted(set(config) - _HF_KEYS)
        if unknown_keys:
            raise ValueError(
                f"Unknown RoPE scaling keys {unknown_keys}; expected a subset of {sorted(_HF_KEYS)}"
            )
        rope_type = config.get("rope_type", config.get("type"))
        if rope_type == "default":
            return None
        if rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(
                f"RoPE scaling 'rope_type' must be 'default' or one of {ROPE_SCALING_TYPES}, "
                f"got {rope_type!r}"
            )
        if "factor" not in config:
            raise ValueError(
                f"RoPE scaling of type {rope_type!r} needs a 'factor', got {dict(config)}"
            )
        fields = {name: config[name] for name in _LLAMA3_FIELDS if name in config}
        return cls(type=rope_type, factor=config["factor"], **fields)


def check_local_window(window) -> tuple[int, int]:
    """Validates a ``(left, right)`` window of non-negative Python ints and returns it."""
    if (
        not isinstance(window, tuple | list)
        or len(window) != 2
        or not all(isinstance(w, int | np.integer) and w >= 0 for w in window)
    ):
        raise ValueError(f"local_window must be (left, right) non-negative ints, got {window!r}")
    return int(window[0]), int(window[1])


def check_global_tokens(global_tokens) -> int:
    """Validates a non-negative Python int count of global tokens and returns it."""
    if isinstance(global_tokens, bool) or not isinstance(global_tokens, int | np.integer):
        raise ValueError(f"global_tokens must be a non-negative int, got {global_tokens!r}")
    if global_tokens < 0:
        raise ValueError(f"global_tokens must be a non-negative int, got {global_tokens!r}")
    return int(global_tokens)


# --------------------------------------------------------------------------- the piece registries
ATTENTION = Registry(
    "model.attention_implementation",
    "fn(call: ops.AttentionCall) -> [B, T, H, Dv]",
    # In the order the automatic choice tries them: the first that runs a call and is not
    # passed over automatically runs it ("xla", the last, runs every call).
    {
        name: f"flaxformer_lite.ops.attention_choice:{name.upper()}"
        for name in ("cudnn", "pallas", "chunked", "xla")
    },
    entry="flaxformer_lite.ops.attention_choice:named_backend",
)
MIXERS = Registry(
    "model.mixer",
    "factory(cfg, *, num_layers, rngs) -> a module: x [B, T, D] and the keywords mask, bias, "
    "positions, is_causal, cache_index, segment_ids -> [B, T, D]",
    {
        "attention": "flaxformer_lite.models.pieces:self_attention",
        **dict.fromkeys(AFT_MIXERS, "flaxformer_lite.models.pieces:attention_free"),
    },
)
POSITION_BIASES = Registry(
    "model.positions",
    "factory(cfg, *, bidirectional, rngs) -> a module: query positions [T], key positions [S] "
    "-> a logit bias [1, H, T, S]",
    {
        "relative": "flaxformer_lite.models.pieces:relative_bias",
        "alibi": "flaxformer_lite.models.pieces:alibi",
    },
)
# Position schemes that are not a logit bias: the embedding adds sinusoidal and learned ones,
# the attention rotates queries and keys by RoPE.
BUILTIN_POSITIONS = ("sinusoidal", "learned", "rope", "none")
NORMS = Registry(
    "model.norm",
    "factory(cfg, *, rngs) -> a module: [..., D] -> [..., D]",
    {
        "layernorm": "flaxformer_lite.models.pieces:layer_norm_module",
        "rmsnorm": "flaxformer_lite.models.pieces:rms_norm_module",
    },
)
FEED_FORWARDS = Registry(
    "model.feed_forward",
    "factory(cfg, *, num_layers, rngs) -> a module: x [B, T, D] -> [B, T, D]",
    {"mlp": "flaxformer_lite.models.pieces:mlp"},
)
