"""Rotary position embeddings (RoPE, Su et al. 2021) and their context-extension scalings.

RoPE rotates each pair of query/key features by an angle proportional to the token's position, so
the attention logit <rope(q, m), rope(k, n)> depends on the positions only through n - m.

Two feature layouts are in use and checkpoints are tied to one of them:

* ``"half"``: feature ``i`` pairs with ``i + Dh // 2`` (GPT-NeoX, Hugging Face Llama's
  ``rotate_half``).
* ``"interleaved"``: features ``2i`` and ``2i + 1`` form a pair (RoFormer, the original Meta Llama).

Both compute the same function up to a fixed permutation of the features.
"""

import math

import einops
import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.choices import ROPE_LAYOUTS, RopeScaling


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
