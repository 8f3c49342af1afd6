"""flaxformer_lite.nn's Dense, initializers, Embed, norms, MLP and relative position bias
against float64 NumPy references written from the published formulas.

Every reference here reads the module's parameters and recomputes the output with NumPy only,
so a bug in ``ops`` cannot cancel out. Inputs and modules come from ``nn_numpy.py``.
"""

import math
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from nn_numpy import TOL, B, H, build, f32, f64, gelu_exact, layer_norm_ref, normal

from flaxformer_lite.nn import (
    MLP,
    Dense,
    Embed,
    KernelInit,
    LayerNorm,
    RelativePositionBias,
    RMSNorm,
)
from flaxformer_lite.nn.dense import param

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


# --------------------------------------------------------------------------------------------
# Dense and parameters


def test_dense_multi_axis_equals_tensordot_plus_bias():
    dense = build(lambda: Dense((3, 4), (2, 5), names=("a", "b", "c", "d"), rngs=nnx.Rngs(0)), 1)
    x = normal(2, (B, 6, 3, 4))
    y = dense(f32(x))
    assert y.shape == (B, 6, 2, 5) and y.dtype == jnp.float32
    expected = np.tensordot(x, f64(dense.kernel[...]), axes=2) + f64(dense.bias[...])
    np.testing.assert_allclose(y, expected, **TOL)


def test_dense_without_bias_and_bf16_compute():
    dense = build(
        lambda: Dense(
            6, 4, names=("embed", "mlp"), use_bias=False, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)
        ),
        1,
    )
    assert dense.bias is None
    assert dense.kernel[...].dtype == jnp.float32  # param_dtype is storage
    x = normal(3, (B, 6))
    y = dense(f32(x))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(f64(y), x @ f64(dense.kernel[...]), rtol=3e-2, atol=3e-2)


def test_dense_wrong_input_shape_raises_naming_the_shape():
    dense = build(lambda: Dense((3, 4), 5, names=("a", "b", "c"), rngs=nnx.Rngs(0)), 1)
    with pytest.raises(ValueError, match=re.escape("(2, 6, 4, 3)")):
        dense(jnp.zeros((2, 6, 4, 3)))
    with pytest.raises(ValueError, match=re.escape("(2, 4)")):
        dense(jnp.zeros((2, 4)))


def test_dense_params_carry_logical_axis_names():
    dense = nnx.eval_shape(
        lambda: Dense(4, (3, 5), names=("embed", "heads", "head_dim"), rngs=nnx.Rngs(0))
    )
    specs = nnx.get_partition_spec(nnx.state(dense, nnx.Param))
    assert tuple(specs["kernel"].get_value()) == ("embed", "heads", "head_dim")
    assert tuple(specs["bias"].get_value()) == ("heads", "head_dim")
    assert dense.kernel.get_metadata()["out_sharding"] == ("embed", "heads", "head_dim")
    assert dense.bias.get_metadata()["out_sharding"] == ("heads", "head_dim")
    assert dense.kernel.shape == (4, 3, 5) and dense.bias.shape == (3, 5)


def test_param_with_wrong_number_of_names_raises():
    with pytest.raises(ValueError, match="axis names"):
        param(nnx.Rngs(0), nnx.initializers.zeros, (2, 3), ("embed",), jnp.float32)
    with pytest.raises(ValueError):
        Dense(4, (3, 5), names=("embed", "heads"), rngs=nnx.Rngs(0))


# --------------------------------------------------------------------------------------------
# KernelInit


def test_xavier_kernel_is_glorot_uniform_over_all_in_and_out_axes():
    fan_in, fan_out = 512, 8 * 64
    dense = Dense(512, (8, 64), names=("embed", "heads", "head_dim"), rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(dense.bias[...], 0.0)  # biases start at zero
    kernel = f64(dense.kernel[...])
    expected_var = 2.0 / (fan_in + fan_out)
    assert abs(kernel.var() / expected_var - 1) < 0.05
    assert abs(kernel.mean()) < 1e-3
    # Uniform on [-limit, limit] with limit = sqrt(6 / (fan_in + fan_out)).
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    assert np.abs(kernel).max() <= limit * (1 + 1e-6)
    assert np.abs(kernel).max() > 0.99 * limit
    # Multi-axis inputs: fan_in is the product of the input axes (the output projection).
    out_kernel = f64(Dense((8, 64), 256, names=("h", "d", "e"), rngs=nnx.Rngs(1)).kernel[...])
    assert abs(out_kernel.var() / (2.0 / (512 + 256)) - 1) < 0.05
    # A fused q/k/v kernel [D, 3, H, Dh]: each of q, k, v initialized as its own [D, H, Dh].
    fused = Dense(512, (3, 8, 64), names=("e", "qkv", "h", "d"), fused_axes=(1,), rngs=nnx.Rngs(2))
    for part in np.moveaxis(f64(fused.kernel[...]), 1, 0):
        assert abs(part.var() / expected_var - 1) < 0.05


def test_normal_kernel_std_and_scaled():
    init = KernelInit("normal", std=0.02)
    kernel = f64(Dense(256, 256, names=("a", "b"), init=init, rngs=nnx.Rngs(0)).kernel[...])
    assert abs(kernel.std() / 0.02 - 1) < 0.03
    scaled = init.scaled(0.25).scaled(2.0)
    assert scaled.scale == pytest.approx(0.5)
    kernel = f64(Dense(256, 256, names=("a", "b"), init=scaled, rngs=nnx.Rngs(0)).kernel[...])
    assert abs(kernel.std() / 0.01 - 1) < 0.03


def test_embedding_init_std():
    table = f64(Embed(1024, 64, rngs=nnx.Rngs(0)).embedding[...])  # xavier: std = d ** -0.5
    assert abs(table.std() / 64**-0.5 - 1) < 0.03
    table = f64(
        Embed(1024, 64, init=KernelInit("normal", std=0.05), rngs=nnx.Rngs(0)).embedding[...]
    )
    assert abs(table.std() / 0.05 - 1) < 0.03


def test_unknown_init_scheme_raises():
    with pytest.raises(ValueError, match="init must be one of"):
        KernelInit("he")


# --------------------------------------------------------------------------------------------
# Embed


def test_embed_lookup_and_attend():
    embed = build(lambda: Embed(11, 6, rngs=nnx.Rngs(0)), 1)
    table = f64(embed.embedding[...])
    ids = np.random.default_rng(0).integers(0, 11, (B, 7))
    np.testing.assert_array_equal(f64(embed(jnp.asarray(ids, jnp.int32))), table[ids])
    x = normal(1, (B, 7, 6))
    logits = embed.attend(f32(x))
    assert logits.shape == (B, 7, 11)
    np.testing.assert_allclose(logits, x @ table.T, **TOL)
    specs = nnx.get_partition_spec(nnx.state(embed, nnx.Param))
    assert tuple(specs["embedding"].get_value()) == ("vocab", "embed")


def test_embed_non_integer_ids_raise():
    embed = build(lambda: Embed(11, 6, rngs=nnx.Rngs(0)), 1)
    with pytest.raises(ValueError, match="integer ids"):
        embed(jnp.zeros((B, 3), jnp.float32))


def test_embed_bf16_output_dtype():
    embed = build(lambda: Embed(11, 6, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), 1)
    assert embed(jnp.arange(5)).dtype == jnp.bfloat16


# --------------------------------------------------------------------------------------------
# Norms


def _rms_norm_ref(x, scale, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * scale


def test_layer_norm_module_matches_formula():
    # A large eps (next to the unit variance of x) makes a dropped or misplaced eps visible.
    x = 1.5 * normal(0, (B, 5, 16)) + 0.7
    for eps in (1e-5, 0.5):
        norm = LayerNorm(16, eps=eps, rngs=nnx.Rngs(0))
        scale, bias = 1 + 0.5 * normal(1, (16,)), normal(2, (16,))
        norm.scale[...], norm.bias[...] = f32(scale), f32(bias)
        y = norm(f32(x))
        assert y.dtype == jnp.float32
        np.testing.assert_allclose(y, layer_norm_ref(x, scale, bias, eps), **TOL)
    no_bias = LayerNorm(16, use_bias=False, rngs=nnx.Rngs(0))
    assert no_bias.bias is None
    np.testing.assert_allclose(no_bias(f32(x)), layer_norm_ref(x, 1.0, 0.0, 1e-5), **TOL)


def test_rms_norm_module_matches_formula():
    x = 1.5 * normal(0, (B, 5, 16)) + 0.7
    for eps in (1e-6, 0.5):
        norm = RMSNorm(16, eps=eps, rngs=nnx.Rngs(0))
        scale = 1 + 0.5 * normal(1, (16,))
        norm.scale[...] = f32(scale)
        np.testing.assert_allclose(norm(f32(x)), _rms_norm_ref(x, scale, eps), **TOL)
    specs = nnx.get_partition_spec(nnx.state(norm, nnx.Param))
    assert tuple(specs["scale"].get_value()) == ("norm",)


def test_norm_output_dtype_follows_dtype_arg():
    x = 1.5 * normal(0, (B, 5, 16)) + 0.7
    scale, bias = 1 + 0.5 * normal(1, (16,)), normal(2, (16,))
    ln = LayerNorm(16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    ln.scale[...], ln.bias[...] = f32(scale), f32(bias)
    rms = RMSNorm(16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    rms.scale[...] = f32(scale)
    y_ln, y_rms = ln(f32(x)), rms(f32(x))
    assert y_ln.dtype == jnp.bfloat16 and y_rms.dtype == jnp.bfloat16
    # Only the final bfloat16 rounding (8 significant bits) separates them from the formula.
    np.testing.assert_allclose(
        f64(y_ln), layer_norm_ref(x, scale, bias, 1e-5), rtol=8e-3, atol=8e-3
    )
    np.testing.assert_allclose(f64(y_rms), _rms_norm_ref(x, scale, 1e-6), rtol=8e-3, atol=8e-3)
    # bf16 inputs with a float32 dtype come out float32.
    assert LayerNorm(16, rngs=nnx.Rngs(0))(jnp.ones((2, 16), jnp.bfloat16)).dtype == jnp.float32


# --------------------------------------------------------------------------------------------
# MLP


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _silu(x):
    return x / (1.0 + np.exp(-x))


_MLP_REFERENCE = {
    "relu": (lambda x: np.maximum(x, 0.0), False),
    "gelu": (gelu_exact, False),
    "gelu_tanh": (_gelu_tanh, False),
    "silu": (_silu, False),
    "swiglu": (_silu, True),
    "geglu": (gelu_exact, True),
}


@pytest.mark.parametrize("activation", list(_MLP_REFERENCE))
def test_mlp_matches_reference(activation):
    act, gated = _MLP_REFERENCE[activation]
    mlp = build(lambda: MLP(16, 24, activation=activation, rngs=nnx.Rngs(0)), 1)
    assert (mlp.wi_gate is not None) == gated
    x = 2.0 * normal(2, (B, 5, 16))
    y = mlp(f32(x))

    def proj(dense, h):
        return h @ f64(dense.kernel[...]) + f64(dense.bias[...])

    hidden = act(proj(mlp.wi_gate, x)) * proj(mlp.wi, x) if gated else act(proj(mlp.wi, x))
    assert y.shape == (B, 5, 16)
    np.testing.assert_allclose(y, proj(mlp.wo, hidden), **TOL)


def test_mlp_unknown_activation_raises():
    with pytest.raises(ValueError, match="activation must be one of"):
        MLP(16, 24, activation="tanh", rngs=nnx.Rngs(0))


def test_mlp_without_bias_and_logical_names():
    mlp = nnx.eval_shape(lambda: MLP(16, 24, activation="swiglu", use_bias=False, rngs=nnx.Rngs(0)))
    assert mlp.wi.bias is None and mlp.wi_gate.bias is None and mlp.wo.bias is None
    specs = nnx.get_partition_spec(nnx.state(mlp, nnx.Param))
    assert tuple(specs["wi"]["kernel"].get_value()) == ("embed", "mlp")
    assert tuple(specs["wi_gate"]["kernel"].get_value()) == ("embed", "mlp")
    assert tuple(specs["wo"]["kernel"].get_value()) == ("mlp", "embed")


# --------------------------------------------------------------------------------------------
# RelativePositionBias


def _t5_bucket(relative_position, bidirectional, num_buckets, max_distance):
    """NumPy port of Hugging Face T5Attention._relative_position_bucket."""
    relative_position = np.asarray(relative_position, np.int64)
    buckets = np.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).astype(np.int64) * num_buckets
        relative_position = np.abs(relative_position)
    else:
        relative_position = -np.minimum(relative_position, 0)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    with np.errstate(divide="ignore"):
        large = max_exact + (
            np.log(relative_position.astype(np.float64) / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        )
    large = np.where(is_small, 0, large).astype(np.int64)
    large = np.minimum(large, num_buckets - 1)
    return buckets + np.where(is_small, relative_position, large)


def test_t5_bucket_port_known_values():
    """The port itself, against values of T5's default (32 buckets, max distance 128)."""
    rel = np.array([-200, -128, -20, -8, -7, -1, 0, 1, 7, 8, 20, 200])
    np.testing.assert_array_equal(
        _t5_bucket(rel, True, 32, 128), [15, 15, 10, 8, 7, 1, 0, 17, 23, 24, 26, 31]
    )
    np.testing.assert_array_equal(
        _t5_bucket(rel, False, 32, 128), [31, 31, 17, 8, 7, 1, 0, 0, 0, 0, 0, 0]
    )


_relative_bias = nnx.jit(lambda module, q_positions, k_positions: module(q_positions, k_positions))


@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidirectional", "causal"])
def test_relative_position_bias_matches_t5_buckets(bidirectional):
    # num_buckets=16, max_distance=20: no offset lands on a bucket boundary where float32 and
    # float64 logs could disagree; offsets span the exact, logarithmic and clamped ranges.
    rpb = build(
        lambda: RelativePositionBias(
            H, num_buckets=16, max_distance=20, bidirectional=bidirectional, rngs=nnx.Rngs(0)
        ),
        1,
    )
    q_pos = np.array([0, 5, 11, 17, 30])
    k_pos = np.arange(12) * 3
    bias = _relative_bias(rpb, jnp.asarray(q_pos), jnp.asarray(k_pos))
    assert bias.shape == (1, H, 5, 12) and bias.dtype == jnp.float32
    buckets = _t5_bucket(k_pos[None, :] - q_pos[:, None], bidirectional, 16, 20)
    assert len(np.unique(buckets)) >= 8 and buckets.max() == 15
    table = f64(rpb.table.embedding[...])  # [num_buckets, H]
    expected = np.moveaxis(table[buckets], -1, 0)[None]  # [1, H, Tq, Tk]
    np.testing.assert_array_equal(f64(bias), expected)
    # Per-row positions give a per-row bias.
    q_batch = np.stack([q_pos, q_pos + 4])
    batched = _relative_bias(rpb, jnp.asarray(q_batch), jnp.asarray(np.stack([k_pos, k_pos])))
    assert batched.shape == (2, H, 5, 12)
    np.testing.assert_array_equal(f64(batched[:1]), expected)
    buckets_1 = _t5_bucket(k_pos[None, :] - q_batch[1][:, None], bidirectional, 16, 20)
    np.testing.assert_array_equal(f64(batched[1]), np.moveaxis(table[buckets_1], -1, 0))
