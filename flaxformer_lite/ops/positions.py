"""Position encodings other than RoPE: sinusoidal tables, T5 relative buckets and ALiBi biases.

* ``sinusoidal_positions``: the fixed encoding of "Attention Is All You Need", added to embeddings.
* ``relative_position_buckets``: T5's map from key-minus-query offsets to learned-bias buckets.
* ``alibi_slopes`` / ``alibi_bias``: ALiBi (Press et al. 2022), a fixed per-head linear penalty on
  the distance between query and key, added to the attention logits.
"""

import math

import einops
import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.choices import SINUSOIDAL_LAYOUTS


def sinusoidal_positions(
    positions: int | jax.Array,
    dim: int,
    *,
    max_wavelength: float = 10000.0,
    layout: str = "interleaved",
) -> jax.Array:
    """The Transformer paper's sinusoidal encoding, sin and cos interleaved as in its formula.

    ``PE[..., 2i] = sin(pos / max_wavelength ** (2i / dim))`` and
    ``PE[..., 2i + 1] = cos(pos / max_wavelength ** (2i / dim))``. With ``layout="concat"`` the
    same features are laid out ``[sin | cos]`` (Marian / OPUS-MT, HF's
    ``MarianSinusoidalPositionalEmbedding``): ``PE[..., i]`` is the sine and
    ``PE[..., dim / 2 + i]`` the cosine of frequency ``i``. Tensor2Tensor's ``[sin | cos]``
    differs: it spaces its frequencies by ``max_wavelength ** (-i / (dim / 2 - 1))``.

    Args:
        positions: A Python int ``T`` (positions ``0 .. T - 1``; static under jit) or an int or
            float array ``[T]`` or ``[B, T]`` (e.g. offsets when decoding; differentiable if
            float).
        dim: The model width D (static, positive, even).
        max_wavelength: The paper's 10000 (static): the longest wavelength is
            ``2 * pi * max_wavelength``.
        layout: ``"interleaved"`` (the paper's formula) or ``"concat"`` (static).

    Returns:
        ``[T, dim]``, or ``[*positions.shape, dim]`` for an array, float32.

    Raises:
        ValueError: ``dim`` is not a positive even int, the int length is negative, or
            ``positions`` is a scalar array, or ``layout`` is unknown.
    """
    if layout not in SINUSOIDAL_LAYOUTS:
        raise ValueError(
            f"sinusoidal_positions layout must be one of {SINUSOIDAL_LAYOUTS}, got {layout!r}"
        )
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2:
        raise ValueError(f"sinusoidal_positions dim must be a positive even int, got {dim!r}")
    if isinstance(positions, int | np.integer):
        if positions < 0:
            raise ValueError(f"sinusoidal_positions length must be >= 0, got {positions}")
        positions = jnp.arange(positions)
    elif jnp.ndim(positions) == 0:
        # Most likely an int length that jit turned into a tracer; a 0-d table would be a surprise.
        raise ValueError(
            "sinusoidal_positions needs an int length or a [T] / [B, T] array, got a scalar "
            "array (under jit, pass the length as a static argument)"
        )
    # From static arguments only, so numpy: a float64-accurate compile-time constant.
    inv_freq = (max_wavelength ** (-np.arange(0, dim, 2) / dim)).astype(np.float32)
    angles = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq  # [..., dim / 2]
    if layout == "concat":
        return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    sin_cos = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    return einops.rearrange(sin_cos, "... d two -> ... (d two)")


def relative_position_buckets(
    q_positions: jax.Array,
    k_positions: jax.Array,
    *,
    bidirectional: bool,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> jax.Array:
    """T5's bucket index of ``relative_position = k_pos - q_pos`` for every query/key pair.

    The same arithmetic as Hugging Face's ``T5Attention._relative_position_bucket`` (float32 log,
    truncation toward zero). Half of the buckets (per direction when bidirectional) hold exact
    small distances; the rest cover distances up to ``max_distance`` logarithmically, and every
    longer distance shares the last bucket.

    Args:
        q_positions: ``[T]`` or ``[B, T]`` int query positions.
        k_positions: ``[S]`` or ``[B, S]`` int key positions.
        bidirectional: True for encoders (keys after the query get their own buckets); False for
            causal decoders (all keys after the query share bucket 0 with the query itself).
        num_buckets: Total number of buckets (static).
        max_distance: Distance from which all offsets share the last bucket (static).

    Returns:
        ``[T, S]``, or ``[B, T, S]`` if either input is batched, int32 in ``[0, num_buckets)``.

    Raises:
        ValueError: Positions of rank other than 1 or 2, batch sizes that differ, or too few
            buckets for the exact and logarithmic ranges.
    """
    q_positions, k_positions = jnp.asarray(q_positions), jnp.asarray(k_positions)
    if q_positions.ndim not in (1, 2) or k_positions.ndim not in (1, 2):
        raise ValueError(
            "relative_position_buckets expects positions as [T] or [B, T], got q_positions "
            f"{q_positions.shape} and k_positions {k_positions.shape}"
        )
    if q_positions.ndim == k_positions.ndim == 2 and q_positions.shape[0] != k_positions.shape[0]:
        raise ValueError(
            "relative_position_buckets got different batch sizes: q_positions "
            f"{q_positions.shape} and k_positions {k_positions.shape}"
        )
    relative_position = (
        k_positions.astype(jnp.int32)[..., None, :] - q_positions.astype(jnp.int32)[..., :, None]
    )

    max_exact = (num_buckets // 2 if bidirectional else num_buckets) // 2
    if max_exact < 1 or max_distance <= max_exact:
        raise ValueError(
            "relative_position_buckets needs at least 2 buckets per direction and max_distance "
            f"above the exact range, got num_buckets={num_buckets}, max_distance={max_distance}, "
            f"bidirectional={bidirectional}"
        )

    if bidirectional:
        # Keys after the query get their own half of the buckets.
        buckets_per_direction = num_buckets // 2
        direction_offset = jnp.where(relative_position > 0, buckets_per_direction, 0)
        distance = jnp.abs(relative_position)
    else:
        # Keys after the query (masked out in a causal decoder anyway) count as distance 0.
        buckets_per_direction = num_buckets
        direction_offset = 0
        distance = -jnp.minimum(relative_position, 0)

    # Clamped so the log never sees 0; distances below max_exact take the exact branch anyway.
    log_ratio = jnp.log(jnp.maximum(distance, max_exact).astype(jnp.float32) / max_exact)
    log_bucket = max_exact + (
        log_ratio / math.log(max_distance / max_exact) * (buckets_per_direction - max_exact)
    ).astype(jnp.int32)
    log_bucket = jnp.minimum(log_bucket, buckets_per_direction - 1)
    return direction_offset + jnp.where(distance < max_exact, distance, log_bucket)


def alibi_slopes(num_heads: int) -> jax.Array:
    """ALiBi's per-head slopes, in the order of the paper's reference code.

    For a power-of-two ``n`` heads the slopes are ``2 ** (-8 * h / n)``, h = 1..n: a geometric
    sequence starting at and shrinking by ``2 ** (-8/n)``. Otherwise the paper (and HF BLOOM's
    ``build_alibi_tensor``) takes the slopes for the closest smaller power of two ``p`` and
    appends every other slope of the ``2p`` sequence, starting at the first: two decreasing runs,
    not one decreasing sequence (3 heads: ``[2 ** -4, 2 ** -8, 2 ** -2]``).

    Args:
        num_heads: Number of attention heads (static, positive).

    Returns:
        ``[H]`` float32 (``H = num_heads``): decreasing when ``H`` is a power of two, else the
        ``p`` decreasing slopes followed by ``H - p`` decreasing slopes that interleave them.

    Raises:
        ValueError: num_heads is not a positive int.
    """
    return jnp.asarray(_alibi_slopes_numpy(num_heads), jnp.float32)


def _alibi_slopes_numpy(num_heads: int) -> np.ndarray:
    # numpy: the slopes depend only on the static head count.
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"ALiBi num_heads must be a positive int, got {num_heads!r}")

    def geometric_slopes(n: int) -> np.ndarray:
        return 2.0 ** (-8.0 * np.arange(1, n + 1) / n)

    power_of_two = 2 ** int(math.floor(math.log2(num_heads)))
    extra = geometric_slopes(2 * power_of_two)[0::2][: num_heads - power_of_two]
    return np.concatenate([geometric_slopes(power_of_two), extra]).astype(np.float32)


def alibi_bias(
    num_heads: int, q_len: int, kv_len: int, offset: int | jax.Array | None = None
) -> jax.Array:
    """ALiBi's additive attention-logit bias ``-slope_h * |query position - key position|``.

    Query ``i`` sits at position ``offset + i`` and key ``j`` at ``j``; by default the queries
    are the last ``q_len`` of the ``kv_len`` keys (``offset = kv_len - q_len``). When decoding
    into a cache, pass the cache index as ``offset``. On the entries a causal mask
    keeps, this equals the paper's ``slope_h * (j - i_pos)``; the entries a causal mask removes
    hold the mirrored penalty, which makes this also the symmetric variant for bidirectional
    encoders. The bias is only a function of distance; combine it with the mask separately.

    Args:
        num_heads: Number of attention heads H (static).
        q_len: Number of queries T (static).
        kv_len: Number of keys S (static).
        offset: Position of the first query: an int or a scalar int array (may be traced).

    Returns:
        ``[H, T, S]`` float32, <= 0; broadcast it over the batch.

    Raises:
        ValueError: num_heads is not a positive int or a length is negative.
    """
    if q_len < 0 or kv_len < 0:
        raise ValueError(f"alibi_bias lengths must be >= 0, got q_len={q_len}, kv_len={kv_len}")
    # Built from iotas rather than as a numpy table: under jit a [H, T, S] constant would be
    # embedded in the program, while this fuses into whatever consumes the bias.
    offset = kv_len - q_len if offset is None else offset
    return alibi_bias_at(num_heads, jnp.arange(q_len) + offset, jnp.arange(kv_len))


def alibi_bias_at(num_heads: int, query_positions: jax.Array, key_positions: jax.Array):
    """ALiBi's bias ``-slope_h * |query position - key position|`` at given positions: query
    positions ``[T]`` and key positions ``[S]`` -> ``[H, T, S]`` float32 (:func:`alibi_bias`)."""
    distance = jnp.abs(query_positions[:, None] - key_positions[None, :])
    slopes = alibi_slopes(num_heads)
    return -slopes[:, None, None] * distance.astype(jnp.float32)
