"""``ModelConfig``: every architectural knob of the three models, validated, with presets."""

from __future__ import annotations

import dataclasses
import difflib
import enum
from typing import TYPE_CHECKING, Any

from flaxformer_lite import choices
from flaxformer_lite.choices import (
    ACTIVATIONS,
    AFT_MIXERS,
    INIT_SCHEMES,
    REMAT_NAMES,
    ROPE_LAYOUTS,
    SINUSOIDAL_LAYOUTS,
    RopeScaling,
)
from flaxformer_lite.models.presets import PRESETS
from flaxformer_lite.models.width import check_parametrization, growing_axes
from flaxformer_lite.settings import setting

if TYPE_CHECKING:
    from flaxformer_lite.nn.attention import Rope
    from flaxformer_lite.nn.dense import KernelInit


class ModelKind(enum.StrEnum):
    """Which of the three models a config builds (:attr:`ModelConfig.kind`), and what follows
    from it; written as its value (``decoder``) in configs and messages."""

    DECODER = "decoder"
    ENCODER_DECODER = "encoder_decoder"
    ENCODER = "encoder"

    def __repr__(self) -> str:  # as its plain value, in messages that show settings
        return repr(self.value)

    @property
    def words(self) -> str:
        """The model in words, for messages: ``a decoder LM``."""
        return {"decoder": "a decoder LM", "encoder_decoder": "an encoder-decoder"}.get(
            self.value, "an encoder-only model"
        )

    @property
    def generates(self) -> bool:
        """Whether it decodes tokens one by one (a decoder LM, an encoder-decoder)."""
        return self is not ModelKind.ENCODER

    @property
    def is_seq2seq(self) -> bool:
        """Whether it reads a source and writes a target (the encoder-decoder)."""
        return self is ModelKind.ENCODER_DECODER


NORM_POSITIONS = ("pre", "post")
POOLINGS = ("first", "mean")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture. Defaults are the paper's base model (Vaswani et al. 2017, Table 3).

    ``num_encoder_layers`` and ``num_decoder_layers`` choose the model: both > 0 an
    ``EncoderDecoder``, only decoder layers a ``DecoderLM``, only encoder layers an ``Encoder``.
    """

    vocab_size: int = setting(37000, help="token ids (set to the tokenizer's size when it differs)")
    d_model: int = setting(512, help="the model width D")
    num_heads: int = setting(8, help="query heads H")
    # None derives num_kv_heads and head_dim in __post_init__: the instance holds ints.
    num_kv_heads: int | None = setting(
        None, help="key/value heads Hk (fewer is GQA, 1 is MQA); null: num_heads"
    )
    head_dim: int | None = setting(None, help="Dh; null: d_model // num_heads")
    d_ff: int | None = setting(
        2048, help="the MLP's hidden width F; null: 4 * d_model (it then scales with the width)"
    )
    num_encoder_layers: int = setting(
        6, help="encoder layers (0 with decoder layers: a decoder-only LM)"
    )
    num_decoder_layers: int = setting(
        6, help="decoder layers (0 with encoder layers: an encoder, e.g. BERT)"
    )
    max_length: int = setting(
        512, help="the longest sequence (learned positions have this many rows)"
    )
    embedding_dropout: float = setting(0.1, help="dropout on the embedding sum")
    attention_dropout: float = setting(0.0, help="dropout on the attention weights")
    residual_dropout: float = setting(0.1, help="dropout on each sublayer's output")
    norm: str = setting("layernorm", help="layernorm, rmsnorm, or a registered or module:attr norm")
    norm_eps: float = setting(1e-6, help="the norms' epsilon")
    norm_bias: bool = setting(
        True, help="LayerNorm's additive bias (false: none, as nanoGPT's bias=False)"
    )
    norm_position: str = setting(
        "post", help="pre (GPT-2, Llama) or post (the paper, BERT) the sublayer"
    )
    embed_norm: bool = setting(False, help="normalize the embedding sum (BERT)")
    positions: str = setting(
        "sinusoidal",
        help="sinusoidal, learned, rope, relative (T5 buckets), alibi, none, or a registered or "
        "module:attr position bias",
    )
    sinusoidal_layout: str = setting(
        "interleaved", help="sin/cos interleaved (the paper) or concat (Marian)"
    )
    rope_base: float = setting(10000.0, help="RoPE's base wavelength theta")
    rope_layout: str = setting(
        "half", help="RoPE's pairing of features: half (GPT-NeoX, Llama) or interleaved"
    )
    rope_scaling: RopeScaling | None = setting(
        None, help="null, or {type: linear|ntk|llama3|dynamic, factor: ...} to stretch RoPE"
    )
    relative_buckets: int = setting(32, help="relative positions: the number of distance buckets")
    relative_max_distance: int = setting(
        128, help="relative positions: distances from here share a bucket"
    )
    activation: str = setting(
        "relu", help="the MLP's activation (relu, gelu, gelu_tanh, swiglu, ...)"
    )
    tie_embeddings: bool = setting(
        True, help="the output projection is the token embedding transposed"
    )
    share_src_tgt_embeddings: bool = setting(
        True, help="encoder-decoder: one embedding table for both sides"
    )
    scale_embeddings: bool = setting(
        True, help="multiply token embeddings by sqrt(d_model) (the paper)"
    )
    parallel_block: bool = setting(
        False, help="attention and MLP side by side from one norm (GPT-J)"
    )
    fused_qkv: bool = setting(False, help="one projection for queries, keys and values")
    qkv_bias: bool = setting(True, help="biases on the query, key and value projections")
    attention_out_bias: bool = setting(True, help="a bias on the attention output projection")
    mlp_bias: bool = setting(True, help="biases in the MLP")
    output_bias: bool = setting(False, help="a bias on the vocabulary logits (BERT, Marian)")
    type_vocab_size: int = setting(0, help="token-type (segment A/B) embeddings, BERT; 0: none")
    mlm_transform: bool = setting(
        False, help="BERT's dense + activation + norm before the MLM decoder"
    )
    num_classes: int | None = setting(
        None, help="encoder: a sequence-classification head with this many classes"
    )
    pooling: str = setting(
        "first", help="classification: the first token ([CLS]) or the mean of real tokens"
    )
    pooler_dense: bool = setting(False, help="BERT's dense + tanh on the pooled vector")
    input_dim: int | None = setting(
        None,
        help="continuous inputs [B, T, input_dim] instead of token ids (an encoder-decoder's "
        "source)",
    )
    output_dim: int | None = setting(
        None,
        help="a regression head [B, T, output_dim] instead of logits (an encoder-decoder's decoder "
        "then reads such targets too)",
    )
    init: str = setting(
        "xavier", help="xavier (Glorot uniform) or normal with init_std (GPT-2, BERT)"
    )
    init_std: float = setting(0.02, help="the standard deviation of init=normal")
    parametrization: str = setting(
        "standard",
        help="standard, or mup: each parameter's init, learning rate and output scaled with "
        "d_model / mup_base_width (docs/reference.md has the table)",
    )
    mup_base_width: int | None = setting(
        None,
        help="mup: the d_model of the base model, where muP is the standard parametrization "
        "(the same heads; d_ff and head_dim scaled alike when null); read only under mup",
    )
    scale_residual_init: bool = setting(
        False, help="GPT-2: residual projections' init times 1/sqrt(2 layers)"
    )
    dtype: str = setting("float32", help="the compute dtype: float32, bfloat16 or float16")
    param_dtype: str = setting("float32", help="the parameters' storage dtype")
    scan_layers: bool = setting(False, help="run the layers in a lax.scan (one layer compiled)")
    remat: str = setting(
        "none", help="recompute activations in the backward pass: none, full, ... (saves memory)"
    )
    attention_implementation: str | None = setting(
        None,
        help="null (chosen per input), xla, chunked, cudnn, pallas, or a registered or module:attr "
        "attention function",
    )
    local_window: tuple[int, int] | None = setting(
        None,
        help="null, or [left, right]: self-attention sees only that many neighbours (Longformer, "
        "BigBird)",
    )
    global_tokens: int = setting(
        0,
        help="with local_window: the first N positions see and are seen by all (within causality)",
    )
    mixer: str = setting(
        "attention",
        help="self-attention's mixer: attention, aft_full, aft_local or aft_simple (AFT), or a "
        "registered or module:attr module; cross-attention stays attention",
    )
    feed_forward: str = setting(
        "mlp", help="the feed-forward block: mlp, or a registered or module:attr module"
    )
    aft_window: int | None = setting(
        None, help="aft_local: its pairwise bias counts within this many positions"
    )

    # ----------------------------------------------------------------------- construction
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A preset by name (see ``PRESETS``), with fields overridden by keyword."""
        if name not in PRESETS:
            raise ValueError(
                f"unknown model preset {name!r}{_suggest(name, PRESETS)}; "
                f"presets: {', '.join(sorted(PRESETS))}"
            )
        return cls.from_dict({**PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelConfig:
        """A config from plain values (e.g. parsed YAML); unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in names:
                raise ValueError(f"unknown model config key {key!r}{_suggest(key, names)}")
        return cls(**values)

    def to_dict(self, *, derived: bool = True) -> dict[str, Any]:
        """Plain values (YAML/JSON-ready); ``from_dict(to_dict())`` is the same config.

        ``derived=False`` gives None for a value that was derived (``num_kv_heads`` and
        ``head_dim`` left unset): values laid over that dict (:meth:`replace`, a partial ``model``
        section of a run config, a saved ``config.yaml``) derive it anew.
        """
        values = dataclasses.asdict(self)
        if self.local_window is not None:  # a list, as YAML writes and reads it
            values["local_window"] = list(self.local_window)
        if not derived:
            values.update(dict.fromkeys(self._derived))
        return values

    def replace(self, **changes: Any) -> ModelConfig:
        """This config with ``changes``; a value at its derived default follows the fields it
        derives from (``replace(num_heads=16)`` keeps ``num_kv_heads == num_heads``)."""
        return self.from_dict({**self.to_dict(derived=False), **changes})

    def _check_sparse_attention(self) -> None:
        """``local_window`` as a ``(left, right)`` tuple; ``global_tokens`` only with it."""
        if self.local_window is not None:
            try:
                window = choices.check_local_window(self.local_window)
            except ValueError as e:
                raise ValueError(f"model.{e}") from None
            object.__setattr__(self, "local_window", window)
        try:
            choices.check_global_tokens(self.global_tokens)
        except ValueError as e:
            raise ValueError(f"model.{e}") from None
        if self.global_tokens and self.local_window is None:
            raise ValueError(
                f"model.global_tokens={self.global_tokens} needs model.local_window "
                "(without a window every position already sees every other)"
            )

    # ----------------------------------------------------------------------- derived
    @property
    def width_multiplier(self) -> float | None:
        """muP's ``m = d_model / mup_base_width``; None under the standard parametrization."""
        if self.parametrization != "mup":
            return None
        return self.d_model / self.mup_base_width

    @property
    def kernel_init(self) -> KernelInit:
        # The model's code imports JAX; reading and checking a config does not.
        from flaxformer_lite.nn.dense import KernelInit

        return KernelInit(
            self.init,
            self.init_std,
            width_multiplier=self.width_multiplier,
            growing=growing_axes(self),
        )

    def is_derived(self, name: str) -> bool:
        """Whether field ``name`` was left null and derived (``num_kv_heads``, ``head_dim``,
        ``d_ff``): such a value follows the fields it derives from."""
        return name in self._derived

    @property
    def rope(self) -> Rope | None:
        if self.positions != "rope":
            return None
        from flaxformer_lite.nn.attention import Rope

        return Rope(self.rope_base, self.rope_layout, self.rope_scaling)

    @property
    def kind(self) -> ModelKind:
        """The model: both layer counts above 0 an encoder-decoder, else the one that is."""
        if self.num_encoder_layers and self.num_decoder_layers:
            return ModelKind.ENCODER_DECODER
        return ModelKind.DECODER if self.num_decoder_layers else ModelKind.ENCODER

    # ----------------------------------------------------------------------- validation
    def _check_mixer(self):
        choices.MIXERS.check(self.mixer)
        if self.aft_window is not None:
            _check_positive_int("aft_window", self.aft_window)
        if (self.mixer == "aft_local") != (self.aft_window is not None):
            raise ValueError(
                f"aft_window is the window of mixer aft_local (got mixer={self.mixer}, "
                f"aft_window={self.aft_window})"
            )
        if self.mixer in AFT_MIXERS and self.local_window is not None:
            raise ValueError(
                f"model.local_window is a window of attention, not of mixer {self.mixer} "
                "(aft_local has its own: model.aft_window)"
            )
        if self.mixer in AFT_MIXERS and self.positions not in ("sinusoidal", "learned", "none"):
            raise ValueError(
                f"mixer {self.mixer} has no attention logits for positions={self.positions!r}; "
                "use sinusoidal, learned or none"
            )

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        for name in ("vocab_size", "d_model", "num_heads", "max_length"):
            _check_positive_int(name, getattr(self, name))
        for name in ("num_encoder_layers", "num_decoder_layers", "type_vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        for name in ("num_kv_heads", "head_dim", "d_ff", "num_classes", "input_dim", "output_dim"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(
                f"d_model ({self.d_model}) is not divisible by num_heads ({self.num_heads}); "
                "set head_dim explicitly"
            )
        # The defaults derived from other fields, resolved once: every reader sees ints. Which
        # ones were derived is kept (not a field: equality and asdict ignore it) for to_dict.
        derived = frozenset(
            n for n in ("num_kv_heads", "head_dim", "d_ff") if getattr(self, n) is None
        )
        object.__setattr__(self, "_derived", derived)
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.d_model // self.num_heads)
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", 4 * self.d_model)
        if not (self.num_encoder_layers or self.num_decoder_layers):
            raise ValueError("a model needs num_encoder_layers > 0 or num_decoder_layers > 0")
        choices.NORMS.check(self.norm)
        choices.FEED_FORWARDS.check(self.feed_forward)
        _check_choice("norm_position", self.norm_position, NORM_POSITIONS)
        if self.positions not in choices.BUILTIN_POSITIONS:
            try:
                choices.POSITION_BIASES.check(self.positions)
            except ValueError:
                valid = (*choices.BUILTIN_POSITIONS, *choices.POSITION_BIASES.entries)
                raise ValueError(
                    f"positions must be one of {valid} or an import path module:attr, got "
                    f"{self.positions!r}"
                ) from None
        _check_choice("rope_layout", self.rope_layout, ROPE_LAYOUTS)
        _check_choice("sinusoidal_layout", self.sinusoidal_layout, SINUSOIDAL_LAYOUTS)
        _check_choice("activation", self.activation, tuple(ACTIVATIONS))
        _check_choice("pooling", self.pooling, POOLINGS)
        if not self.norm_bias and self.norm == "rmsnorm":
            raise ValueError(f"norm_bias=False applies to layernorm; {self.norm} has no bias")
        _check_choice("init", self.init, INIT_SCHEMES)
        check_parametrization(self)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("param_dtype", self.param_dtype, DTYPES)
        _check_choice("remat", self.remat, REMAT_NAMES)
        if self.attention_implementation is not None:
            choices.ATTENTION.check(self.attention_implementation)
        self._check_mixer()
        for name in ("embedding_dropout", "attention_dropout", "residual_dropout"):
            rate = getattr(self, name)
            if not isinstance(rate, int | float) or not 0.0 <= rate < 1.0:
                raise ValueError(f"{name} must be a float in [0, 1), got {rate!r}")
        self._check_sparse_attention()
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"rope needs an even head_dim, got {self.head_dim}")
        if self.positions == "sinusoidal" and self.d_model % 2:
            raise ValueError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        token_targets = self.kind.is_seq2seq or self.input_dim is None
        if self.tie_embeddings and (self.output_dim is not None or not token_targets):
            raise ValueError(
                "tie_embeddings needs a token table and vocabulary outputs; set "
                "tie_embeddings=False with input_dim or output_dim"
            )
        for name in ("norm_eps", "rope_base", "init_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        _check_positive_int("relative_buckets", self.relative_buckets)
        _check_positive_int("relative_max_distance", self.relative_max_distance)
        if self.positions == "relative" and (
            self.relative_buckets < 4 or self.relative_max_distance <= self.relative_buckets // 2
        ):
            raise ValueError(
                "relative positions need relative_buckets >= 4 and relative_max_distance > "
                f"relative_buckets // 2, got {self.relative_buckets} and "
                f"{self.relative_max_distance}"
            )
        if self.num_classes is not None and self.kind is not ModelKind.ENCODER:
            raise ValueError("num_classes (a classification head) is for encoder-only models")
        if self.type_vocab_size and self.kind is not ModelKind.ENCODER:
            raise ValueError("type_vocab_size (token-type embeddings) is for encoder-only models")
        if self.output_bias and self.output_dim is not None:
            raise ValueError(
                "output_bias is a bias on the vocabulary logits; the regression head of "
                "output_dim always has one"
            )


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def _suggest(name: str, options) -> str:
    close = difflib.get_close_matches(str(name), list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
