"""Tests for flaxformer_lite.ops.rope: float64 numpy references and RoPE's properties."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.choices import RopeScaling
from flaxformer_lite.ops.rope import apply_rope, rope_frequencies

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

# Llama 3.1's published rope_scaling, with its base and head size.
LLAMA31 = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
LLAMA31_BASE, LLAMA31_HEAD_DIM = 500000.0, 128

# Tests call this jitted wrapper: one compile per shape instead of one per primitive keeps them
# fast. test_jit_and_eager_agree covers the eager path.
rope = jax.jit(apply_rope, static_argnames=("base", "layout", "scaling"))


# ---------------------------------------------------------------- float64 references


def reference_inv_freq(head_dim, base):
    return np.array([base ** (-2.0 * i / head_dim) for i in range(head_dim // 2)])


def reference_llama3(inv_freq, factor, low_freq_factor, high_freq_factor, old_context_len):
    """Scalar port of Hugging Face's `_compute_llama3_parameters`."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    out = []
    for freq in inv_freq:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def reference_rope_half(x, positions, inv_freq):
    """Port of Hugging Face Llama's ``apply_rotary_pos_emb`` with ``rotate_half``."""
    x = np.asarray(x, np.float64)
    freqs = np.asarray(positions, np.float64)[..., None] * inv_freq  # [(B,) T, Dh/2]
    emb = np.concatenate([freqs, freqs], axis=-1)[..., None, :]  # heads axis
    half = x.shape[-1] // 2
    rotate_half = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(emb) + rotate_half * np.sin(emb)


def reference_rope_interleaved(x, positions, inv_freq):
    """RoFormer: each pair (2i, 2i+1) as a complex number times exp(i * position * freq_i)."""
    x = np.asarray(x, np.float64)
    z = x[..., 0::2] + 1j * x[..., 1::2]
    angles = np.asarray(positions, np.float64)[..., None, None] * inv_freq
    rotated = z * np.exp(1j * angles)
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = rotated.real, rotated.imag
    return out


def normal(seed, shape, dtype=jnp.float32):
    # numpy, not jax.random: compiling a jax sampler costs seconds per shape on a small CPU.
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


# ---------------------------------------------------------------- frequencies and scaling


@pytest.mark.parametrize("head_dim, base", [(2, 10000.0), (8, 10000.0), (64, 500000.0)])
def test_frequencies_match_formula(head_dim, base):
    inv_freq = rope_frequencies(head_dim, base=base)
    assert inv_freq.shape == (head_dim // 2,) and inv_freq.dtype == jnp.float32
    np.testing.assert_allclose(inv_freq, reference_inv_freq(head_dim, base), rtol=2e-6)


def test_linear_scaling_divides_every_frequency():
    plain = rope_frequencies(16)
    scaled = rope_frequencies(16, scaling=RopeScaling("linear", 4.0))
    np.testing.assert_allclose(scaled, plain / 4.0, rtol=1e-6)


def test_ntk_scaling_rescales_the_base():
    head_dim, factor = 16, 4.0
    plain = np.asarray(rope_frequencies(head_dim))
    scaled = np.asarray(rope_frequencies(head_dim, scaling=RopeScaling("ntk", factor)))
    expected = reference_inv_freq(head_dim, 10000.0 * factor ** (head_dim / (head_dim - 2)))
    np.testing.assert_allclose(scaled, expected, rtol=2e-6)
    assert scaled[0] == plain[0] == 1.0  # the fastest pair is untouched
    assert np.all(scaled[1:] < plain[1:])
    np.testing.assert_allclose(scaled[-1], plain[-1] / factor, rtol=2e-6)  # slowest: / factor


def test_llama3_scaling_matches_hugging_face_port():
    plain = rope_frequencies(LLAMA31_HEAD_DIM, base=LLAMA31_BASE)
    scaled = rope_frequencies(LLAMA31_HEAD_DIM, base=LLAMA31_BASE, scaling=LLAMA31)
    expected = reference_llama3(
        reference_inv_freq(LLAMA31_HEAD_DIM, LLAMA31_BASE), 8.0, 1.0, 4.0, 8192
    )
    np.testing.assert_allclose(scaled, expected, rtol=1e-5)

    plain, scaled = np.asarray(plain, np.float64), np.asarray(scaled, np.float64)
    wavelen = 2 * np.pi / plain
    high, low, middle = wavelen < 8192 / 4, wavelen > 8192, (wavelen > 2048) & (wavelen < 8192)
    assert high.any() and low.any() and middle.any()  # the test covers all three bands
    np.testing.assert_array_equal(scaled[high], plain[high])
    np.testing.assert_allclose(scaled[low], plain[low] / 8.0, rtol=1e-6)
    assert np.all(scaled[middle] < plain[middle])
    assert np.all(scaled[middle] > plain[middle] / 8.0)


def test_scaling_reaches_apply_rope():
    # Position interpolation: linear scaling by f is the same as positions divided by f.
    x = normal(0, (2, 4, 2, 8))
    positions = jnp.arange(4) * 3
    scaled = rope(x, positions, scaling=RopeScaling("linear", 3.0))
    np.testing.assert_allclose(scaled, rope(x, positions / 3.0), atol=1e-6)
    ntk = rope(x, positions, scaling=RopeScaling("ntk", 3.0))
    assert not np.allclose(ntk, rope(x, positions), atol=1e-3)


@pytest.mark.parametrize(
    "kwargs, bad_field",
    [
        ({"type": "yarn", "factor": 2.0}, "type"),
        ({"type": "linear", "factor": 0.0}, "factor"),
        ({"type": "linear", "factor": True}, "factor"),
        ({"type": "llama3", "factor": 8.0, "low_freq_factor": 4.0}, "high_freq_factor"),
        ({"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192.0}, "original"),
    ],
)
def test_rope_scaling_rejects_bad_fields(kwargs, bad_field):
    with pytest.raises(ValueError, match=bad_field):
        RopeScaling(**kwargs)


def test_rope_scaling_error_lists_valid_types():
    with pytest.raises(ValueError, match="'linear', 'ntk', 'llama3', 'dynamic'"):
        RopeScaling("yarn", 2.0)


def test_rope_scaling_from_hugging_face_dicts():
    llama31 = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    }
    assert RopeScaling.from_dict(llama31) == LLAMA31
    assert RopeScaling.from_dict({"type": "linear", "factor": 2.0}) == RopeScaling("linear", 2.0)
    # transformers 5.x `rope_parameters` carry the base and say "default" for plain RoPE.
    assert RopeScaling.from_dict({"rope_type": "default", "rope_theta": 10000.0}) is None
    hash(RopeScaling.from_dict(llama31))  # usable as a static jit argument


@pytest.mark.parametrize(
    "config, message",
    [
        ({"rope_type": "yarn", "factor": 2.0}, "yarn"),
        ({"rope_type": "dynamic"}, "factor"),
        ({"factor": 2.0}, "rope_type"),
        ({"rope_type": "linear"}, "factor"),
        ({"rope_type": "linear", "factor": 2.0, "beta_fast": 32}, "beta_fast"),
    ],
)
def test_rope_scaling_from_dict_rejects(config, message):
    with pytest.raises(ValueError, match=message):
        RopeScaling.from_dict(config)


# ---------------------------------------------------------------- apply_rope values


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("batched_positions", [False, True])
def test_apply_rope_matches_reference(layout, batched_positions):
    x = normal(0, (2, 4, 2, 8))
    positions = jnp.array([[3, 4, 5, 6], [0, 9, 2, 40]]) if batched_positions else jnp.arange(4) + 7
    reference = reference_rope_half if layout == "half" else reference_rope_interleaved
    expected = reference(x, positions, reference_inv_freq(8, 10000.0))
    np.testing.assert_allclose(rope(x, positions, layout=layout), expected, atol=2e-5)


def test_llama3_rope_matches_reference():
    x = normal(0, (1, 4, 1, LLAMA31_HEAD_DIM))
    positions = jnp.array([0, 1, 5000, 20000])
    inv_freq = reference_llama3(
        reference_inv_freq(LLAMA31_HEAD_DIM, LLAMA31_BASE), 8.0, 1.0, 4.0, 8192
    )
    out = rope(x, positions, base=LLAMA31_BASE, scaling=LLAMA31)
    # float32 angles of ~2e4 radians carry ~1e-3 absolute error, as in Hugging Face.
    np.testing.assert_allclose(out, reference_rope_half(x, positions, inv_freq), atol=5e-3)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_dot_product_depends_only_on_offset(layout):
    q, k = normal(0, (1, 1, 1, 16)), normal(1, (1, 1, 1, 16))

    def dot(m, n):
        rotated_q = rope(q, jnp.array([m]), layout=layout)
        rotated_k = rope(k, jnp.array([n]), layout=layout)
        return float(jnp.sum(rotated_q * rotated_k))

    same_offset = [dot(m, m + 3) for m in (0, 5, 17, 100)]
    np.testing.assert_allclose(same_offset, same_offset[0], rtol=1e-4, atol=1e-4)
    other_offsets = [dot(0, offset) for offset in (0, 1, 2, 5, -3)]
    assert min(abs(value - same_offset[0]) for value in other_offsets) > 1e-3


def test_layouts_agree_up_to_feature_permutation():
    head_dim = 8
    x = normal(0, (2, 4, 2, head_dim))
    positions = jnp.array([0, 3, 8, 21])
    # Interleaved slot 2i holds half-layout feature i, slot 2i + 1 holds feature i + d/2.
    perm = np.stack([np.arange(head_dim // 2), np.arange(head_dim // 2) + head_dim // 2], -1)
    perm = perm.reshape(-1)
    half = rope(x, positions, layout="half")
    interleaved = rope(x[..., perm], positions, layout="interleaved")
    np.testing.assert_allclose(interleaved, half[..., perm], atol=1e-6)
    assert not np.allclose(half, rope(x, positions, layout="interleaved"), atol=1e-3)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rotation_preserves_norm(layout):
    x = normal(0, (2, 4, 2, 8))
    out = rope(x, jnp.arange(4) * 11, layout=layout)
    np.testing.assert_allclose(
        jnp.linalg.norm(out, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5
    )


def test_batched_positions_equal_per_row_application():
    x = normal(0, (3, 4, 2, 8))
    positions = jnp.array([[0, 1, 2, 3], [10, 11, 12, 13], [5, 0, 7, 2]])
    batched = rope(x, positions)
    for row in range(3):
        per_row = rope(x[row : row + 1], positions[row])
        np.testing.assert_allclose(batched[row : row + 1], per_row, atol=1e-6)
    # A batch of one broadcasts like [length].
    np.testing.assert_allclose(rope(x, positions[:1]), rope(x, positions[0]))


def test_float_positions_equal_int_positions():
    x = normal(0, (2, 4, 2, 8))
    np.testing.assert_allclose(
        rope(x, jnp.array([1, 4, 9, 30])), rope(x, jnp.array([1.0, 4.0, 9.0, 30.0]))
    )


def test_bfloat16_input_returns_bfloat16():
    x = normal(0, (2, 4, 2, 8), jnp.bfloat16)
    positions = jnp.arange(4) + 100
    out = rope(x, positions)
    assert out.dtype == jnp.bfloat16 and out.shape == x.shape
    expected = rope(x.astype(jnp.float32), positions)
    np.testing.assert_allclose(out.astype(jnp.float32), expected, atol=2e-2, rtol=1e-2)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "x_shape, positions_shape, message",
    [
        ((4, 3, 8), (4,), r"\(4, 3, 8\)"),
        ((2, 4, 3, 8), (5,), r"\(5,\)"),
        ((2, 4, 3, 8), (3, 4), r"\(3, 4\)"),
        ((2, 4, 3, 8), (2, 4, 1), r"\(2, 4, 1\)"),
        ((2, 4, 3, 7), (4,), "head_dim"),
    ],
)
def test_apply_rope_rejects_bad_shapes(x_shape, positions_shape, message):
    with pytest.raises(ValueError, match=message):
        apply_rope(jnp.zeros(x_shape), jnp.zeros(positions_shape, jnp.int32))


def test_apply_rope_rejects_unknown_layout():
    with pytest.raises(ValueError, match="'half', 'interleaved'"):
        apply_rope(jnp.zeros((1, 2, 1, 4)), jnp.arange(2), layout="neox")


def test_rope_frequencies_rejects_odd_head_dim():
    with pytest.raises(ValueError, match="7"):
        rope_frequencies(7)


# ---------------------------------------------------------------- transformations


def test_jit_and_eager_agree():
    x = normal(0, (2, 4, 2, 8))
    positions = jnp.array([[0, 1, 2, 3], [7, 8, 9, 10]])
    for layout in ("half", "interleaved"):
        eager = apply_rope(x, positions, layout=layout, scaling=LLAMA31)
        jitted = rope(x, positions, layout=layout, scaling=LLAMA31)
        np.testing.assert_allclose(jitted, eager, atol=1e-6)


def test_vmap_matches_loop():
    x = normal(0, (3, 2, 4, 2, 8))  # an extra leading axis mapped over
    positions = jnp.arange(3 * 2 * 4).reshape(3, 2, 4)
    mapped = jax.jit(jax.vmap(apply_rope))(x, positions)
    for i in range(3):
        np.testing.assert_allclose(mapped[i], rope(x[i], positions[i]), atol=1e-6)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_grad_is_inverse_rotation(layout):
    # The rotation is orthogonal, so the gradient of <rope(x), w> is R^T w = rope(w, -positions).
    x, weights = normal(0, (2, 4, 2, 8)), normal(1, (2, 4, 2, 8))
    positions = jnp.array([0, 2, 5, 9])

    def loss(x):
        return jnp.sum(apply_rope(x, positions, layout=layout) * weights)

    grad = jax.jit(jax.grad(loss))(x)
    np.testing.assert_allclose(grad, rope(weights, -positions, layout=layout), atol=1e-5)
    if layout == "half":  # eager differentiation once; it is slow and shares the same rules
        np.testing.assert_allclose(jax.grad(loss)(x), grad, atol=1e-6)


# ---------------------------------------------------------------- dynamic NTK scaling


def reference_dynamic_inv_freq(head_dim, base, factor, original, length):
    """float64 transcription of Hugging Face's ``_compute_dynamic_ntk_parameters``."""
    length = max(length, original)
    base = base * ((factor * length / original) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return reference_inv_freq(head_dim, base)


DYNAMIC = RopeScaling("dynamic", 4.0, original_max_position_embeddings=16)


@pytest.mark.parametrize("length", [1, 16, 17, 40, 1000, 100_000])
def test_dynamic_frequencies_match_reference(length):
    out = rope_frequencies(32, base=10000.0, scaling=DYNAMIC, length=length)
    expected = reference_dynamic_inv_freq(32, 10000.0, 4.0, 16, length)
    np.testing.assert_allclose(out, expected, rtol=2e-5)


def test_dynamic_scaling_within_the_original_length_is_plain_rope():
    plain = rope_frequencies(16, base=500.0)
    for length in (None, 3, 16):
        dynamic = rope_frequencies(16, base=500.0, scaling=DYNAMIC, length=length)
        np.testing.assert_allclose(dynamic, plain, rtol=1e-6)


@pytest.mark.parametrize("batched_positions", [False, True])
def test_dynamic_rope_uses_the_largest_position_as_length(batched_positions):
    x = normal(3, (2, 5, 2, 8))
    positions = (
        jnp.array([[0, 1, 2, 3, 4], [20, 21, 22, 23, 24]])
        if batched_positions
        else (jnp.arange(5) + 30)
    )
    length = int(np.max(positions)) + 1
    expected = reference_rope_half(
        x, positions, reference_dynamic_inv_freq(8, 10000.0, 4.0, 16, length)
    )
    np.testing.assert_allclose(rope(x, positions, scaling=DYNAMIC), expected, atol=2e-5)


def test_dynamic_rope_step_by_step_rotates_each_key_with_the_base_of_its_time():
    # Decoding one token at a time, position p is rotated with the base of length p + 1.
    x = normal(4, (1, 24, 1, 8))
    steps = [rope(x[:, p : p + 1], jnp.array([p]), scaling=DYNAMIC) for p in range(24)]
    for p in (0, 15, 16, 23):
        inv_freq = reference_dynamic_inv_freq(8, 10000.0, 4.0, 16, p + 1)
        expected = reference_rope_half(x[:, p : p + 1], np.array([p]), inv_freq)
        np.testing.assert_allclose(steps[p], expected, atol=2e-5)


def test_dynamic_scaling_from_dict_and_hashable():
    scaling = RopeScaling.from_dict(
        {"rope_type": "dynamic", "factor": 4.0, "original_max_position_embeddings": 16}
    )
    assert scaling == DYNAMIC
    hash(scaling)


@pytest.mark.parametrize("length", [8, 16, 17, 50, 300])
def test_dynamic_rope_matches_hugging_face_llama(hf, length):
    torch, transformers = hf.torch, hf.transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    head_dim, base = 16, 10000.0
    config = transformers.LlamaConfig(
        hidden_size=32,
        num_attention_heads=2,
        head_dim=head_dim,
        max_position_embeddings=16,
        rope_theta=base,
        rope_scaling={"rope_type": "dynamic", "factor": 4.0},
    )
    rotary = LlamaRotaryEmbedding(config)  # a fresh one: Hugging Face's keeps the longest length
    x = normal(5, (1, length, 1, head_dim))
    position_ids = torch.arange(length)[None]
    cos, sin = rotary(torch.zeros(1, length, head_dim), position_ids)
    q = torch.from_numpy(np.array(x)).transpose(1, 2)  # [B, H, T, Dh]
    rotate_half = torch.cat((-q[..., head_dim // 2 :], q[..., : head_dim // 2]), dim=-1)
    expected = (q * cos[:, None] + rotate_half * sin[:, None]).transpose(1, 2).numpy()
    scaling = RopeScaling("dynamic", 4.0, original_max_position_embeddings=16)
    np.testing.assert_allclose(
        rotary.inv_freq.numpy(),
        rope_frequencies(head_dim, base=base, scaling=scaling, length=length),
        rtol=2e-5,
    )
    out = rope(x, jnp.arange(length), base=base, scaling=scaling)
    np.testing.assert_allclose(out, expected, atol=2e-4)
