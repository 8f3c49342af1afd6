"""Tests for flaxformer_lite.ops.positions: float64 references and the encodings' properties."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.ops.positions import (
    alibi_bias,
    alibi_slopes,
    relative_position_buckets,
    sinusoidal_positions,
)

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

# Most tests call jitted wrappers, one compile per shape instead of one per primitive, to stay
# fast; the tests named *eager* cover the eager path.
encode = jax.jit(sinusoidal_positions, static_argnames=("dim", "max_wavelength", "layout"))
bucketize = jax.jit(
    relative_position_buckets, static_argnames=("bidirectional", "num_buckets", "max_distance")
)

# ---------------------------------------------------------------- float64 references


def reference_sinusoidal(positions, dim):
    """The paper's formula, one element at a time."""
    table = np.zeros((len(positions), dim))
    for row, pos in enumerate(positions):
        for i in range(dim // 2):
            table[row, 2 * i] = math.sin(pos / 10000 ** (2 * i / dim))
            table[row, 2 * i + 1] = math.cos(pos / 10000 ** (2 * i / dim))
    return table


def reference_t5_bucket(relative_position, bidirectional, num_buckets, max_distance):
    """Scalar port of Hugging Face's `T5Attention._relative_position_bucket`."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        bucket += num_buckets if relative_position > 0 else 0
        relative_position = abs(relative_position)
    else:
        relative_position = -min(relative_position, 0)
    max_exact = num_buckets // 2
    if relative_position < max_exact:
        return bucket + relative_position
    if_large = max_exact + int(
        math.log(relative_position / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    )
    return bucket + min(if_large, num_buckets - 1)


def reference_bloom_slopes(num_heads):
    """HF BLOOM's ``build_alibi_tensor`` slope formula."""
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3)))
    slopes = [base**power for power in range(1, 1 + closest_power_of_2)]
    if closest_power_of_2 != num_heads:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest_power_of_2) - 3)))
        num_remaining = min(closest_power_of_2, num_heads - closest_power_of_2)
        slopes += [extra_base**power for power in range(1, 1 + 2 * num_remaining, 2)]
    return np.array(slopes)


# ---------------------------------------------------------------- sinusoidal


@pytest.mark.parametrize("dim", [2, 6, 16])
def test_sinusoidal_matches_paper_formula(dim):
    positions = [0, 1, 2, 7, 50, 1000]
    table = encode(jnp.array(positions), dim)
    assert table.shape == (len(positions), dim) and table.dtype == jnp.float32
    np.testing.assert_allclose(table, reference_sinusoidal(positions, dim), atol=2e-4)


def test_sinusoidal_shift_is_a_fixed_rotation():
    # PE(t + k) = R_k PE(t), R_k block-diagonal with one 2x2 rotation per frequency.
    dim = 8
    freqs = 1.0 / 10000 ** (np.arange(0, dim, 2) / dim)
    table = np.asarray(encode(jnp.arange(64), dim), np.float64)
    for shift in (1, 5, 13):
        rotation = np.zeros((dim, dim))
        for i, freq in enumerate(freqs):
            c, s = math.cos(shift * freq), math.sin(shift * freq)
            rotation[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = [[c, s], [-s, c]]
        for t in (0, 3, 20, 50):
            np.testing.assert_allclose(table[t + shift], rotation @ table[t], atol=1e-5)


def test_sinusoidal_int_length_equals_arange_eager_and_jit():
    table = sinusoidal_positions(10, 8)
    np.testing.assert_allclose(table, encode(jnp.arange(10), 8), atol=1e-6)
    np.testing.assert_array_equal(sinusoidal_positions(np.int64(10), 8), table)
    static_length = jax.jit(sinusoidal_positions, static_argnums=(0, 1))
    np.testing.assert_allclose(static_length(10, 8), table, atol=1e-6)


def test_sinusoidal_rejects_traced_length():
    # jit turns an int length into a scalar tracer unless it is static: say so, don't return [dim].
    with pytest.raises(ValueError, match="static"):
        jax.jit(sinusoidal_positions, static_argnames="dim")(10, dim=8)


def test_sinusoidal_batched_positions():
    positions = jnp.array([[0, 1, 2], [5, 6, 7]])
    table = encode(positions, 6)
    assert table.shape == (2, 3, 6)
    np.testing.assert_allclose(table[1], reference_sinusoidal([5, 6, 7], 6), atol=1e-6)
    # Another program: its sin and cos may run on another vector width, a few ulps apart.
    np.testing.assert_allclose(
        jax.jit(jax.vmap(lambda row: sinusoidal_positions(row, 6)))(positions), table, atol=1e-6
    )


def test_sinusoidal_max_wavelength():
    table = encode(jnp.array([3.0]), 4, max_wavelength=100.0)
    expected = [math.sin(3.0), math.cos(3.0), math.sin(3.0 / 10), math.cos(3.0 / 10)]
    np.testing.assert_allclose(table[0], expected, atol=1e-6)


@pytest.mark.parametrize("dim", [2, 6, 16])
def test_sinusoidal_concat_layout(dim):
    """``layout="concat"`` is ``[sin | cos]`` (Marian's table, HF
    ``MarianSinusoidalPositionalEmbedding``): the same features as the paper's, regrouped."""
    positions = np.array([0, 1, 2, 7, 50, 1000])
    angles = positions[:, None] / 10000.0 ** (np.arange(0, dim, 2) / dim)  # float64
    expected = np.concatenate([np.sin(angles), np.cos(angles)], axis=-1)
    table = encode(jnp.asarray(positions), dim, layout="concat")
    assert table.shape == (len(positions), dim) and table.dtype == jnp.float32
    np.testing.assert_allclose(table, expected, atol=2e-4)
    paper = np.asarray(encode(jnp.asarray(positions), dim))
    # Two programs (the same sin and cos on other vector widths, maybe): equal up to a few ulps.
    np.testing.assert_allclose(
        table, np.concatenate([paper[:, 0::2], paper[:, 1::2]], -1), rtol=0, atol=1e-6
    )
    np.testing.assert_allclose(sinusoidal_positions(3, dim, layout="concat"), table[:3], atol=1e-6)
    with pytest.raises(ValueError, match="layout"):
        sinusoidal_positions(4, dim, layout="halves")


@pytest.mark.parametrize("dim", [5, 0])
def test_sinusoidal_rejects_bad_dim(dim):
    with pytest.raises(ValueError, match="dim"):
        sinusoidal_positions(4, dim)


def test_sinusoidal_grad_eager_and_jit():
    dim = 8
    positions = jnp.array([0.0, 1.5, 30.0])

    def total(positions):
        return jnp.sum(sinusoidal_positions(positions, dim))

    # d/dp [sin(p w) + cos(p w)] = w (cos(p w) - sin(p w)), summed over frequencies.
    freqs = 1.0 / 10000 ** (np.arange(0, dim, 2) / dim)
    angles = np.asarray(positions, np.float64)[:, None] * freqs
    expected = np.sum(freqs * (np.cos(angles) - np.sin(angles)), axis=-1)
    grad = jax.grad(total)(positions)
    np.testing.assert_allclose(grad, expected, atol=1e-5)
    np.testing.assert_allclose(jax.jit(jax.grad(total))(positions), grad, atol=1e-6)


# ---------------------------------------------------------------- T5 relative buckets


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 20)])
def test_relative_buckets_match_t5(bidirectional, num_buckets, max_distance):
    # Offsets from -300 to 300: every exact bucket, every log bucket and the clipped tail.
    q_positions = np.arange(0, 301, 3)
    k_positions = np.arange(0, 301, 4)
    buckets = bucketize(
        jnp.array(q_positions),
        jnp.array(k_positions),
        bidirectional=bidirectional,
        num_buckets=num_buckets,
        max_distance=max_distance,
    )
    expected = [
        [reference_t5_bucket(k - q, bidirectional, num_buckets, max_distance) for k in k_positions]
        for q in q_positions
    ]
    assert buckets.dtype == jnp.int32
    np.testing.assert_array_equal(buckets, expected)
    assert buckets.min() == 0 and buckets.max() == num_buckets - 1
    # The grid reaches every bucket but one: T5 never uses the "after, distance 0" bucket.
    unused = {num_buckets // 2} if bidirectional else set()
    assert set(np.unique(buckets).tolist()) == set(range(num_buckets)) - unused


def test_relative_buckets_batched_eager_and_jit():
    q_positions = jnp.array([[0, 1, 2], [10, 11, 12]])
    k_positions = jnp.array([[0, 1, 2, 3], [40, 41, 42, 43]])
    bucket = functools.partial(bucketize, bidirectional=True)
    buckets = bucket(q_positions, k_positions)
    assert buckets.shape == (2, 3, 4)
    for row in range(2):
        np.testing.assert_array_equal(buckets[row], bucket(q_positions[row], k_positions[row]))
    # Shared [Tk] keys broadcast against batched queries.
    np.testing.assert_array_equal(
        bucket(q_positions, k_positions[0])[1], bucket(q_positions[1], k_positions[0])
    )
    eager = relative_position_buckets(q_positions, k_positions, bidirectional=True)
    np.testing.assert_array_equal(eager, buckets)


@pytest.mark.parametrize(
    "q_shape, k_shape, kwargs",
    [
        ((2, 3, 4), (4,), {}),
        ((2, 3), (3, 4), {}),
        ((3,), (4,), {"num_buckets": 2}),
        ((3,), (4,), {"max_distance": 8}),
    ],
)
def test_relative_buckets_reject_bad_inputs(q_shape, k_shape, kwargs):
    with pytest.raises(ValueError, match="relative_position_buckets"):
        relative_position_buckets(
            jnp.zeros(q_shape, jnp.int32),
            jnp.zeros(k_shape, jnp.int32),
            bidirectional=True,
            **kwargs,
        )


# ---------------------------------------------------------------- ALiBi


def test_alibi_slopes_power_of_two():
    np.testing.assert_array_equal(alibi_slopes(8), 2.0 ** -np.arange(1, 9))
    np.testing.assert_array_equal(alibi_slopes(1), [2.0**-8])


@pytest.mark.parametrize("num_heads", [3, 12, 16, 20])
def test_alibi_slopes_match_bloom(num_heads):
    slopes = alibi_slopes(num_heads)
    assert slopes.shape == (num_heads,) and slopes.dtype == jnp.float32
    np.testing.assert_allclose(slopes, reference_bloom_slopes(num_heads), rtol=1e-7)


def test_alibi_slopes_rejects_zero_heads():
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes(0)


@pytest.mark.parametrize("q_len, kv_len", [(5, 5), (1, 6), (3, 7)])
def test_alibi_bias_values(q_len, kv_len):
    num_heads = 4
    bias = alibi_bias(num_heads, q_len, kv_len)
    assert bias.shape == (num_heads, q_len, kv_len) and bias.dtype == jnp.float32
    slopes = reference_bloom_slopes(num_heads)
    expected = np.zeros((num_heads, q_len, kv_len))
    for h in range(num_heads):
        for i in range(q_len):
            for j in range(kv_len):
                expected[h, i, j] = -slopes[h] * abs(i + kv_len - q_len - j)
    np.testing.assert_allclose(bias, expected, rtol=1e-6)
    np.testing.assert_array_equal(
        jax.jit(alibi_bias, static_argnums=(0, 1, 2))(4, q_len, kv_len), bias
    )


def test_alibi_bias_offset_places_the_queries():
    # Decoding 2 queries from cache slot 3 of 8: queries at positions 3 and 4.
    slopes = reference_bloom_slopes(4)
    expected = np.array(
        [[[-s * abs(i - j) for j in range(8)] for i in (3, 4)] for s in slopes], np.float64
    )
    np.testing.assert_allclose(alibi_bias(4, 2, 8, offset=3), expected, rtol=1e-6)
    traced = jax.jit(alibi_bias, static_argnums=(0, 1, 2))(4, 2, 8, jnp.int32(3))
    np.testing.assert_allclose(traced, expected, rtol=1e-6)


def test_alibi_bias_causal_part_is_the_papers():
    # The paper adds slope * (j - i) for keys j <= query i.
    bias = np.asarray(alibi_bias(8, 6, 6))
    slopes = np.asarray(alibi_slopes(8))
    i, j = np.tril_indices(6)
    np.testing.assert_allclose(bias[:, i, j], slopes[:, None] * (j - i), rtol=1e-6)
    np.testing.assert_array_equal(bias, np.swapaxes(bias, 1, 2))  # symmetric for encoders
