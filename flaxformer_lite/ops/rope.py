"""Rotary position embeddings (RoPE, Su et al. 2021) and their context-extension scalings.

RoPE rotates each pair of query/key features by an angle proportional to the token's position, so
the attention logit <rope(q, m), rope(k, n)> depends on the positions only through n - m.

Two feature layouts are in use and checkpoints are tied to one of them:

* ``"half"``: feature ``i`` pairs with ``i + Dh // 2`` (GPT-NeoX, Hugging Face Llama's
  ``rotate_half``).
* ``"interleaved"``: features ``2i`` and ``2i + 1`` form a pair (RoFormer, the original Meta Llama).

Both compute the same function up to a fixed permutation of the features.
"""

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

import einops
import jax
import jax.numpy as jnp
import numpy as np

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
    def from_dict(cls, config: Mapping[str, Any]) -> "RopeScaling | None":
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


def rope_frequencies(
    head_dim: int,
    *,
    base: float = 10000.0,
    scaling: RopeScaling | None = None,
    length: jax.Array | int | None = None,
) -> jax.Array:
    """Inverse frequencies ``base ** (-2i / Dh)`` of RoPE, optionally scaled.

    Static scalings are computed once at trace time in float64 numpy and become a compile-time
    constant; ``"dynamic"`` depends on ``length`` and is computed in float32 like Hugging Face.

    Args:
        head_dim: Features per head, Dh (static, even).
        base: The RoPE base ("theta"), a Python float: 10000 in the paper, 500000 in Llama 3.
        scaling: Optional context-extension scaling.
        length: dynamic scaling only: the current sequence length L (may be traced); None or
            a length within ``original_max_position_embeddings`` leaves the base unchanged.

    Returns:
        ``[Dh // 2]`` float32, the angle per position step of each feature pair, from
        highest (index 0, always 1 before scaling) to lowest frequency.

    Raises:
        ValueError: head_dim is not a positive even int, or is 2 with NTK scaling.
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ValueError(f"RoPE head_dim must be a positive even int, got {head_dim!r}")
    if scaling is not None and scaling.type in ("ntk", "dynamic") and head_dim == 2:
        raise ValueError("NTK RoPE scaling needs head_dim >= 4 (its exponent is d / (d - 2))")
    if scaling is not None and scaling.type == "dynamic":
        return _dynamic_ntk_frequencies(head_dim, base, scaling, length)
    if scaling is not None and scaling.type == "ntk":
        # Chosen so the lowest frequency is divided by exactly ``factor`` while the highest stays 1.
        base = base * scaling.factor ** (head_dim / (head_dim - 2))
    inv_freq = float(base) ** (-np.arange(0, head_dim, 2) / head_dim)
    if scaling is not None and scaling.type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling is not None and scaling.type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    return jnp.asarray(inv_freq, jnp.float32)


def _dynamic_ntk_frequencies(
    head_dim: int, base: float, scaling: RopeScaling, length: jax.Array | int | None
) -> jax.Array:
    """Hugging Face's ``_compute_dynamic_ntk_parameters``: with ``L = max(length, original)``,
    ``base' = base * (factor * L / original - (factor - 1)) ** (Dh / (Dh - 2))``."""
    original = scaling.original_max_position_embeddings
    length = original if length is None else length
    length = jnp.maximum(jnp.asarray(length, jnp.float32), original)
    stretch = scaling.factor * length / original - (scaling.factor - 1)
    # In log space: base' itself can leave float32's exact-integer range for long contexts.
    log_base = math.log(base) + head_dim / (head_dim - 2) * jnp.log(stretch)
    exponents = jnp.asarray(np.arange(0, head_dim, 2) / head_dim, jnp.float32)
    return jnp.exp(-exponents * log_base)


def _llama3_scale(inv_freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    """Llama 3.1 scaling, following Hugging Face's ``_compute_llama3_parameters`` step by step."""
    context = scaling.original_max_position_embeddings
    low_freq_wavelen = context / scaling.low_freq_factor
    high_freq_wavelen = context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Pairs that turn less than once within the original context never learned to tell far
    # positions apart, so they are interpolated; fast-turning pairs encode local order and stay.
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled)


def apply_rope(
    x: jax.Array,
    positions: jax.Array,
    *,
    base: float = 10000.0,
    layout: str = "half",
    scaling: RopeScaling | None = None,
) -> jax.Array:
    """Rotates queries or keys by their positions.

    Args:
        x: ``[B, T, H, Dh]`` queries or keys (or ``Hk`` heads), any float dtype.
        positions: ``[T]`` (shared by the batch) or ``[B, T]`` (e.g. per-row offsets when
            decoding with a cache), int or float. A batch of 1 broadcasts.
        base: The RoPE base ("theta"), a Python float (static).
        layout: ``"half"`` (pairs ``i, i + Dh // 2``; HF Llama, GPT-NeoX) or
            ``"interleaved"`` (pairs ``2i, 2i + 1``; RoFormer). Static.
        scaling: Optional context-extension scaling. Static. With ``"dynamic"`` the current
            length is ``max(positions) + 1`` over the whole batch, as in Hugging Face: when
            decoding with a cache the new keys are rotated with the base of the total length
            so far while the cached keys keep the base they were rotated with.

    Returns:
        Same shape and dtype as ``x``. The rotation is computed in float32.

    Raises:
        ValueError: Wrong ranks, positions that do not match x, an odd Dh or an unknown
            layout.
    """
    if layout not in ROPE_LAYOUTS:
        raise ValueError(f"RoPE layout must be one of {ROPE_LAYOUTS}, got {layout!r}")
    if x.ndim != 4:
        raise ValueError(f"RoPE expects x as [batch, length, heads, head_dim], got shape {x.shape}")
    batch, length, _, head_dim = x.shape
    positions = jnp.asarray(positions)
    shape_ok = (positions.ndim == 1 and positions.shape[0] == length) or (
        positions.ndim == 2 and positions.shape[0] in (1, batch) and positions.shape[1] == length
    )
    if not shape_ok:
        raise ValueError(
            f"RoPE positions must be [length] or [batch, length] matching x of shape {x.shape} "
            f"(length={length}, batch={batch}), got shape {positions.shape}"
        )

    length = None
    if scaling is not None and scaling.type == "dynamic":
        length = jnp.max(positions) + 1
    inv_freq = rope_frequencies(head_dim, base=base, scaling=scaling, length=length)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [(B,) T, Dh / 2]
    # A heads axis to broadcast over; [T, ...] angles broadcast over the batch by themselves.
    angles = angles[..., None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)

    x32 = x.astype(jnp.float32)
    if layout == "half":
        first, second = jnp.split(x32, 2, axis=-1)
    else:
        pairs = einops.rearrange(x32, "... (d two) -> ... d two", two=2)
        first, second = pairs[..., 0], pairs[..., 1]
    # The 2-D rotation (first + i * second) * exp(i * angle) on every feature pair.
    rotated_first = first * cos - second * sin
    rotated_second = second * cos + first * sin
    if layout == "half":
        out = jnp.concatenate([rotated_first, rotated_second], axis=-1)
    else:
        out = einops.rearrange(
            jnp.stack([rotated_first, rotated_second], axis=-1), "... d two -> ... (d two)"
        )
    return out.astype(x.dtype)
