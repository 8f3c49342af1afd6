"""Tests for flaxformer_lite.ops.norms against float64 NumPy formulas and flax.nnx.LayerNorm."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxformer_lite.ops.norms import layer_norm, rms_norm

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


def _f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def _layer_norm_ref(x, scale=None, bias=None, eps=1e-5):
    x = _f64(x)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps)
    if scale is not None:
        y = y * _f64(scale)
    if bias is not None:
        y = y + _f64(bias)
    return y


def _rms_norm_ref(x, scale=None, eps=1e-6):
    x = _f64(x)
    y = x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)
    return y if scale is None else y * _f64(scale)


SHAPE = (2, 5, 16)


def _normal(seed, shape=SHAPE):
    # NumPy-drawn inputs of one fixed shape: every new shape or dtype makes eager JAX compile each
    # primitive again, which dominates this file's run time on a small CPU.
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.fixture
def data():
    x = jnp.asarray(3.0 * _normal(0) + 2.0, jnp.float32)
    scale = jnp.asarray(1.0 + 0.5 * _normal(1, SHAPE[-1:]), jnp.float32)
    bias = jnp.asarray(_normal(2, SHAPE[-1:]), jnp.float32)
    return x, scale, bias


def test_layer_norm_zero_mean_unit_variance(data):
    x, _, _ = data
    y = np.asarray(layer_norm(x, eps=0.0), np.float64)
    # The float32 mean of 16 features near 2 carries round-off of ~1e-6 in any summation order.
    np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(y.var(-1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(y, _layer_norm_ref(x, eps=0.0), atol=1e-5)


def test_layer_norm_scale_and_bias(data):
    x, scale, bias = data
    np.testing.assert_allclose(
        layer_norm(x, scale, bias), _layer_norm_ref(x, scale, bias), atol=1e-5
    )
    np.testing.assert_allclose(layer_norm(x, scale), _layer_norm_ref(x, scale), atol=1e-5)
    np.testing.assert_allclose(layer_norm(x, bias=bias), _layer_norm_ref(x, bias=bias), atol=1e-5)


def test_layer_norm_matches_flax(data):
    x, scale, bias = data
    module = nnx.LayerNorm(16, epsilon=1e-5, rngs=nnx.Rngs(0))
    module.scale[...] = scale
    module.bias[...] = bias
    np.testing.assert_allclose(layer_norm(x, scale, bias, eps=1e-5), module(x), atol=1e-5)


def test_layer_norm_constant_row_is_finite(data):
    _, _, bias = data
    x = jnp.full(SHAPE, 7.0)
    np.testing.assert_array_equal(layer_norm(x), 0.0)
    np.testing.assert_array_equal(layer_norm(x, bias=bias), np.broadcast_to(bias, SHAPE))


def test_layer_norm_eps_shrinks_by_expected_factor(data):
    x, _, _ = data
    eps = 4.0
    var = _f64(x).var(-1, keepdims=True)
    expected = np.asarray(layer_norm(x, eps=0.0)) * np.sqrt(var / (var + eps))
    np.testing.assert_allclose(layer_norm(x, eps=eps), expected, atol=1e-5)


def test_layer_norm_large_mean_float32_uses_two_pass_variance():
    # E[x^2] - E[x]^2 would cancel every digit here (x^2 ~ 1e8 has a float32 ulp of 8; its error
    # is ~700). What remains is the float32 rounding of the mean itself, a few ulps of 1e4.
    x = jnp.asarray(1e4 + _normal(3), jnp.float32)
    np.testing.assert_allclose(layer_norm(x), _layer_norm_ref(x), atol=1e-2)


def test_layer_norm_bf16_large_mean_is_accurate():
    x = jnp.asarray(1000.0 + 8.0 * _normal(4), jnp.bfloat16)
    y = layer_norm(x)
    assert y.dtype == jnp.bfloat16
    # The only error allowed is the final bfloat16 rounding (8 bits: ~0.4% relative); bfloat16
    # statistics would be off by a whole bf16 step of the mean (4.0 at 1000), i.e. ~0.5 here.
    np.testing.assert_allclose(_f64(y), _layer_norm_ref(x), rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_dtype_preserved(data, dtype):
    x, scale, bias = data
    assert layer_norm(x.astype(dtype), scale, bias).dtype == dtype
    assert rms_norm(x.astype(dtype), scale).dtype == dtype


def test_rms_norm_definition(data):
    x, scale, _ = data
    np.testing.assert_allclose(rms_norm(x), _rms_norm_ref(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rms_norm(x, scale), _rms_norm_ref(x, scale), rtol=1e-5, atol=1e-6)
    # No mean subtraction: the output keeps the sign pattern of x.
    np.testing.assert_array_equal(np.sign(rms_norm(x)), np.sign(x))


def test_rms_norm_eps(data):
    x, _, _ = data
    eps = 3.0
    ms = (_f64(x) ** 2).mean(-1, keepdims=True)
    expected = np.asarray(rms_norm(x, eps=0.0)) * np.sqrt(ms / (ms + eps))
    np.testing.assert_allclose(rms_norm(x, eps=eps), expected, rtol=1e-5)
    np.testing.assert_array_equal(rms_norm(jnp.zeros(SHAPE)), 0.0)


def test_rms_norm_bf16_rounds_once(data):
    _, scale, _ = data
    x = jnp.asarray(_normal(5), jnp.bfloat16)
    y = _f64(rms_norm(x, scale))
    once = _f64(jnp.asarray(_rms_norm_ref(x, scale), jnp.float32).astype(jnp.bfloat16))
    # Scaling in float32 and casting once matches a single rounding of the exact result; HF's
    # cast-then-multiply order (two roundings) matches only ~70% of elements.
    assert np.mean(y == once) > 0.99


@pytest.mark.parametrize(
    ("fn", "name", "shape"),
    [
        # All of these broadcast against x without complaint; only the explicit check catches them.
        (layer_norm, "scale", (1,)),
        (layer_norm, "bias", (1, 16)),
        (rms_norm, "scale", (5, 16)),
    ],
)
def test_param_shape_mismatch_raises(data, fn, name, shape):
    x, _, _ = data
    with pytest.raises(ValueError, match=rf"{name}.*\(2, 5, 16\).*{re.escape(str(shape))}"):
        fn(x, **{name: jnp.ones(shape)})


def test_jit_and_vmap_match_eager(data):
    # Other programs may sum the 16 features in another order: statistics ~16 * 2**-24 apart in
    # relative terms, outputs of up to ~5 about 5e-6 at most.
    x, scale, bias = data
    for fn, args in [(layer_norm, (scale, bias)), (rms_norm, (scale,))]:
        eager = fn(x, *args)
        np.testing.assert_allclose(jax.jit(fn)(x, *args), eager, atol=1e-5)
        np.testing.assert_allclose(
            jax.vmap(fn, in_axes=(0,) + (None,) * len(args))(x, *args), eager, atol=1e-5
        )


def _layer_norm_dx_ref(x, scale, g):
    """float64 closed-form input gradient of LayerNorm (eps 1e-5) for upstream gradient ``g``."""
    xhat = _layer_norm_ref(x)
    sigma = np.sqrt(_f64(x).var(-1, keepdims=True) + 1e-5)
    gs = _f64(g) * _f64(scale)
    return (gs - gs.mean(-1, keepdims=True) - xhat * (gs * xhat).mean(-1, keepdims=True)) / sigma


def test_layer_norm_grad_matches_closed_form(data):
    x, scale, bias = data
    g = jnp.asarray(_normal(6), jnp.float32)  # upstream gradient
    dx, dscale, dbias = jax.grad(lambda *a: jnp.sum(g * layer_norm(*a)), argnums=(0, 1, 2))(
        x, scale, bias
    )
    np.testing.assert_allclose(dx, _layer_norm_dx_ref(x, scale, g), atol=1e-5)
    xhat = _layer_norm_ref(x)
    np.testing.assert_allclose(dscale, (_f64(g) * xhat).sum((0, 1)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dbias, _f64(g).sum((0, 1)), rtol=1e-5, atol=1e-5)


def test_rms_norm_grad_matches_closed_form(data):
    x, scale, _ = data
    g = jnp.asarray(_normal(6), jnp.float32)
    dx = jax.grad(lambda x: jnp.sum(g * rms_norm(x, scale)))(x)
    x64 = _f64(x)
    r = np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6)
    gs = _f64(g) * _f64(scale)
    expected = (gs - x64 * (gs * x64).mean(-1, keepdims=True) / r**2) / r
    np.testing.assert_allclose(dx, expected, atol=1e-5)


def test_layer_norm_grad_without_scale_or_bias_matches_autodiff_of_the_formula(data):
    x, _, _ = data
    g = jnp.asarray(_normal(7), jnp.float32)

    def formula(x):
        centered = x - jnp.mean(x, -1, keepdims=True)
        return centered * jax.lax.rsqrt(jnp.mean(centered**2, -1, keepdims=True) + 1e-5)

    expected = jax.grad(lambda x: jnp.sum(g * formula(x)))(x)
    np.testing.assert_allclose(
        jax.grad(lambda x: jnp.sum(g * layer_norm(x)))(x), expected, atol=1e-5
    )
    dx, dbias = jax.grad(lambda x, b: jnp.sum(g * layer_norm(x, bias=b)), argnums=(0, 1))(
        x, jnp.zeros(SHAPE[-1])
    )
    np.testing.assert_allclose(dx, expected, atol=1e-5)
    np.testing.assert_allclose(dbias, _f64(g).sum((0, 1)), rtol=1e-5, atol=1e-5)


def test_layer_norm_grad_large_mean_and_under_vmap(data):
    """The backward pass reuses the forward's two-pass statistics: a mean of 1000 costs only the
    float32 rounding of that mean; and it batches under vmap."""
    _, scale, bias = data
    x = jnp.asarray(1000.0 + _normal(0), jnp.float32)
    g = jnp.asarray(_normal(6), jnp.float32)
    grad = jax.grad(lambda x, g: jnp.sum(g * layer_norm(x, scale, bias)))
    # The float32 mean of 16 values near 1000 (partial sums up to 16000, spaced 2**-10) is off by
    # up to ~1e-4 depending on summation order, and dx with it; one-pass or bfloat16 statistics
    # would be off by tenths.
    np.testing.assert_allclose(grad(x, g), _layer_norm_dx_ref(x, scale, g), atol=1e-3)
    np.testing.assert_allclose(jax.vmap(grad)(x, g), grad(x, g), atol=1e-3)


def test_layer_norm_bf16_grad_dtypes_follow_their_inputs(data):
    x, scale, bias = data
    g = jnp.asarray(_normal(6), jnp.bfloat16)
    _, vjp = jax.vjp(layer_norm, x.astype(jnp.bfloat16), scale, bias.astype(jnp.bfloat16))
    dx, dscale, dbias = vjp(g)
    assert (dx.dtype, dscale.dtype, dbias.dtype) == (jnp.bfloat16, jnp.float32, jnp.bfloat16)
    np.testing.assert_allclose(_f64(dbias), _f64(g).sum((0, 1)), rtol=2e-2, atol=5e-2)
