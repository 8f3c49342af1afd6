"""flaxformer_lite.nn modules against float64 NumPy references written from the published formulas.

Every reference here reads the module's parameters and recomputes the output with NumPy only
(``attention_reference.naive_attention`` for the softmax attention itself), so a bug in ``ops``
cannot cancel out.

Speed: eager JAX compiles every primitive for every new shape, which dominates CPU test time
(each random initializer of a new kernel shape costs ~0.5 s). So inputs are drawn with NumPy,
modules whose initialization is not under test are built abstractly with ``nnx.eval_shape`` and
filled with NumPy draws (:func:`_build`), and modules called more than once run under ``nnx.jit``.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import naive_attention
from flax import nnx

from flaxformer_lite.models import EncoderLayer, ModelConfig
from flaxformer_lite.nn import (
    MLP,
    Dense,
    Embed,
    KernelInit,
    LayerNorm,
    LayerStack,
    MultiHeadAttention,
    RelativePositionBias,
    RMSNorm,
    Rope,
    stack_layer_states,
)
from flaxformer_lite.nn.dense import param

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

B, T, D, H, DH = 2, 9, 32, 4, 8
TOL = dict(rtol=1e-5, atol=1e-5)


def _f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def _normal(seed, shape, scale=1.0):
    return scale * np.random.default_rng(seed).standard_normal(shape)


def _f32(a):
    return jnp.asarray(a, jnp.float32)


def _build(make, seed, scale=0.3):
    """``make()`` built abstractly, every variable then drawn with NumPy: parameters (biases
    included) ``N(0, scale^2)``, norm scales ``1 + N(0, scale^2)``, PRNG keys (dropout streams)
    from ``seed``."""
    module = nnx.eval_shape(make)
    rng = np.random.default_rng(seed)
    for path, var in nnx.iter_graph(module):
        if not isinstance(var, nnx.Variable) or var.get_value() is None:
            continue
        x = var.get_value()
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            # rbg keys: XLA's RngBitGenerator compiles ~3 s faster here than threefry.
            key = jax.random.key(seed, impl="rbg")
            value = key if x.shape == () else jax.random.split(key, x.shape[0])
        elif jnp.issubdtype(x.dtype, jnp.integer):
            value = np.zeros(x.shape, x.dtype)
        else:
            draw = scale * rng.standard_normal(x.shape)
            value = jnp.asarray(1.0 + draw if path[-1] == "scale" else draw, x.dtype)
        var.set_value(value)
    return module


# --------------------------------------------------------------------------------------------
# Dense and parameters


def test_dense_multi_axis_equals_tensordot_plus_bias():
    dense = _build(lambda: Dense((3, 4), (2, 5), names=("a", "b", "c", "d"), rngs=nnx.Rngs(0)), 1)
    x = _normal(2, (B, 6, 3, 4))
    y = dense(_f32(x))
    assert y.shape == (B, 6, 2, 5) and y.dtype == jnp.float32
    expected = np.tensordot(x, _f64(dense.kernel[...]), axes=2) + _f64(dense.bias[...])
    np.testing.assert_allclose(y, expected, **TOL)


def test_dense_without_bias_and_bf16_compute():
    dense = _build(
        lambda: Dense(
            6, 4, names=("embed", "mlp"), use_bias=False, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)
        ),
        1,
    )
    assert dense.bias is None
    assert dense.kernel[...].dtype == jnp.float32  # param_dtype is storage
    x = _normal(3, (B, 6))
    y = dense(_f32(x))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(_f64(y), x @ _f64(dense.kernel[...]), rtol=3e-2, atol=3e-2)


def test_dense_wrong_input_shape_raises_naming_the_shape():
    dense = _build(lambda: Dense((3, 4), 5, names=("a", "b", "c"), rngs=nnx.Rngs(0)), 1)
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
    kernel = _f64(dense.kernel[...])
    expected_var = 2.0 / (fan_in + fan_out)
    assert abs(kernel.var() / expected_var - 1) < 0.05
    assert abs(kernel.mean()) < 1e-3
    # Uniform on [-limit, limit] with limit = sqrt(6 / (fan_in + fan_out)).
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    assert np.abs(kernel).max() <= limit * (1 + 1e-6)
    assert np.abs(kernel).max() > 0.99 * limit
    # Multi-axis inputs: fan_in is the product of the input axes (the output projection).
    out_kernel = _f64(Dense((8, 64), 256, names=("h", "d", "e"), rngs=nnx.Rngs(1)).kernel[...])
    assert abs(out_kernel.var() / (2.0 / (512 + 256)) - 1) < 0.05
    # A fused q/k/v kernel [D, 3, H, Dh]: each of q, k, v initialized as its own [D, H, Dh].
    fused = Dense(512, (3, 8, 64), names=("e", "qkv", "h", "d"), fused_axes=(1,), rngs=nnx.Rngs(2))
    for part in np.moveaxis(_f64(fused.kernel[...]), 1, 0):
        assert abs(part.var() / expected_var - 1) < 0.05


def test_normal_kernel_std_and_scaled():
    init = KernelInit("normal", std=0.02)
    kernel = _f64(Dense(256, 256, names=("a", "b"), init=init, rngs=nnx.Rngs(0)).kernel[...])
    assert abs(kernel.std() / 0.02 - 1) < 0.03
    scaled = init.scaled(0.25).scaled(2.0)
    assert scaled.scale == pytest.approx(0.5)
    kernel = _f64(Dense(256, 256, names=("a", "b"), init=scaled, rngs=nnx.Rngs(0)).kernel[...])
    assert abs(kernel.std() / 0.01 - 1) < 0.03


def test_embedding_init_std():
    table = _f64(Embed(1024, 64, rngs=nnx.Rngs(0)).embedding[...])  # xavier: std = d ** -0.5
    assert abs(table.std() / 64**-0.5 - 1) < 0.03
    table = _f64(
        Embed(1024, 64, init=KernelInit("normal", std=0.05), rngs=nnx.Rngs(0)).embedding[...]
    )
    assert abs(table.std() / 0.05 - 1) < 0.03


def test_unknown_init_scheme_raises():
    with pytest.raises(ValueError, match="init must be one of"):
        KernelInit("he")


# --------------------------------------------------------------------------------------------
# Embed


def test_embed_lookup_and_attend():
    embed = _build(lambda: Embed(11, 6, rngs=nnx.Rngs(0)), 1)
    table = _f64(embed.embedding[...])
    ids = np.random.default_rng(0).integers(0, 11, (B, 7))
    np.testing.assert_array_equal(_f64(embed(jnp.asarray(ids, jnp.int32))), table[ids])
    x = _normal(1, (B, 7, 6))
    logits = embed.attend(_f32(x))
    assert logits.shape == (B, 7, 11)
    np.testing.assert_allclose(logits, x @ table.T, **TOL)
    specs = nnx.get_partition_spec(nnx.state(embed, nnx.Param))
    assert tuple(specs["embedding"].get_value()) == ("vocab", "embed")


def test_embed_non_integer_ids_raise():
    embed = _build(lambda: Embed(11, 6, rngs=nnx.Rngs(0)), 1)
    with pytest.raises(ValueError, match="integer ids"):
        embed(jnp.zeros((B, 3), jnp.float32))


def test_embed_bf16_output_dtype():
    embed = _build(lambda: Embed(11, 6, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), 1)
    assert embed(jnp.arange(5)).dtype == jnp.bfloat16


# --------------------------------------------------------------------------------------------
# Norms


def _layer_norm_ref(x, scale, bias, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * scale + bias


def _rms_norm_ref(x, scale, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * scale


def test_layer_norm_module_matches_formula():
    # A large eps (next to the unit variance of x) makes a dropped or misplaced eps visible.
    x = 1.5 * _normal(0, (B, 5, 16)) + 0.7
    for eps in (1e-5, 0.5):
        norm = LayerNorm(16, eps=eps, rngs=nnx.Rngs(0))
        scale, bias = 1 + 0.5 * _normal(1, (16,)), _normal(2, (16,))
        norm.scale[...], norm.bias[...] = _f32(scale), _f32(bias)
        y = norm(_f32(x))
        assert y.dtype == jnp.float32
        np.testing.assert_allclose(y, _layer_norm_ref(x, scale, bias, eps), **TOL)
    no_bias = LayerNorm(16, use_bias=False, rngs=nnx.Rngs(0))
    assert no_bias.bias is None
    np.testing.assert_allclose(no_bias(_f32(x)), _layer_norm_ref(x, 1.0, 0.0, 1e-5), **TOL)


def test_rms_norm_module_matches_formula():
    x = 1.5 * _normal(0, (B, 5, 16)) + 0.7
    for eps in (1e-6, 0.5):
        norm = RMSNorm(16, eps=eps, rngs=nnx.Rngs(0))
        scale = 1 + 0.5 * _normal(1, (16,))
        norm.scale[...] = _f32(scale)
        np.testing.assert_allclose(norm(_f32(x)), _rms_norm_ref(x, scale, eps), **TOL)
    specs = nnx.get_partition_spec(nnx.state(norm, nnx.Param))
    assert tuple(specs["scale"].get_value()) == ("norm",)


def test_norm_output_dtype_follows_dtype_arg():
    x = 1.5 * _normal(0, (B, 5, 16)) + 0.7
    scale, bias = 1 + 0.5 * _normal(1, (16,)), _normal(2, (16,))
    ln = LayerNorm(16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    ln.scale[...], ln.bias[...] = _f32(scale), _f32(bias)
    rms = RMSNorm(16, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    rms.scale[...] = _f32(scale)
    y_ln, y_rms = ln(_f32(x)), rms(_f32(x))
    assert y_ln.dtype == jnp.bfloat16 and y_rms.dtype == jnp.bfloat16
    # Only the final bfloat16 rounding (8 significant bits) separates them from the formula.
    np.testing.assert_allclose(
        _f64(y_ln), _layer_norm_ref(x, scale, bias, 1e-5), rtol=8e-3, atol=8e-3
    )
    np.testing.assert_allclose(_f64(y_rms), _rms_norm_ref(x, scale, 1e-6), rtol=8e-3, atol=8e-3)
    # bf16 inputs with a float32 dtype come out float32.
    assert LayerNorm(16, rngs=nnx.Rngs(0))(jnp.ones((2, 16), jnp.bfloat16)).dtype == jnp.float32


# --------------------------------------------------------------------------------------------
# MLP


def _gelu_exact(x):
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _silu(x):
    return x / (1.0 + np.exp(-x))


_MLP_REFERENCE = {
    "relu": (lambda x: np.maximum(x, 0.0), False),
    "gelu": (_gelu_exact, False),
    "gelu_tanh": (_gelu_tanh, False),
    "silu": (_silu, False),
    "swiglu": (_silu, True),
    "geglu": (_gelu_exact, True),
}


@pytest.mark.parametrize("activation", list(_MLP_REFERENCE))
def test_mlp_matches_reference(activation):
    act, gated = _MLP_REFERENCE[activation]
    mlp = _build(lambda: MLP(16, 24, activation=activation, rngs=nnx.Rngs(0)), 1)
    assert (mlp.wi_gate is not None) == gated
    x = 2.0 * _normal(2, (B, 5, 16))
    y = mlp(_f32(x))

    def proj(dense, h):
        return h @ _f64(dense.kernel[...]) + _f64(dense.bias[...])

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
# MultiHeadAttention


def _rope_ref(x, positions, base):
    """The 'half' layout: feature i pairs with i + Dh/2, angle pos * base ** (-2i / Dh)."""
    dh = x.shape[-1]
    half = dh // 2
    pos = np.broadcast_to(np.asarray(positions, np.float64), x.shape[:2])
    angle = pos[:, :, None, None] * base ** (-2.0 * np.arange(half) / dh)  # [B, T, 1, Dh/2]
    cos, sin = np.cos(angle), np.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _projections(mha, x, context=None):
    """q, k, v ``[B, T, H, Dh]`` in float64 from the module's own kernels and biases."""
    ctx = x if context is None else context

    def proj(kernel, bias, h):
        out = np.tensordot(h, _f64(kernel), axes=1)
        return out if bias is None else out + _f64(bias)

    if mha.fused_qkv:
        w, b = _f64(mha.qkv.kernel[...]), _f64(mha.qkv.bias[...])  # [D, 3, H, Dh], [3, H, Dh]
        return tuple(proj(w[:, i], b[i], x) for i in range(3))
    bias = lambda dense: None if dense.bias is None else dense.bias[...]  # noqa: E731
    return (
        proj(mha.query.kernel[...], bias(mha.query), x),
        proj(mha.key.kernel[...], bias(mha.key), ctx),
        proj(mha.value.kernel[...], bias(mha.value), ctx),
    )


def _mha_reference(mha, x, context=None, *, mask=None, bias=None, causal=False, positions=None):
    q, k, v = _projections(mha, x, context)
    if mha.rope is not None and context is None:
        pos = np.arange(x.shape[1]) if positions is None else positions
        q, k = _rope_ref(q, pos, mha.rope.base), _rope_ref(k, pos, mha.rope.base)
    heads = naive_attention(q, k, v, bias, mask, causal=causal)  # [B, T, H, Dh]
    out = np.tensordot(heads, _f64(mha.out.kernel[...]), axes=2)
    return out if mha.out.bias is None else out + _f64(mha.out.bias[...])


@nnx.jit(static_argnames=("is_causal",))
def _attend(mha, x, context=None, mask=None, bias=None, positions=None, is_causal=False):
    return mha(x, context, mask=mask, bias=bias, positions=positions, is_causal=is_causal)


@nnx.jit
def _decode(mha, x, cache_index):
    return mha(x, is_causal=True, cache_index=cache_index)


def _padding_mask(lengths, s):
    """``[B, 1, 1, S]``: True for the first ``lengths[b]`` keys of each row."""
    return (np.arange(s)[None, :] < np.asarray(lengths)[:, None])[:, None, None, :]


ATTENTION_CASES = {
    # name: (constructor kwargs, call kwargs)
    "self": (dict(), dict()),
    "causal_with_bias": (dict(), dict(is_causal=True, bias=True)),
    "gqa_causal_padding": (dict(num_kv_heads=2), dict(is_causal=True, padding=True)),
    "mqa_head_dim_6_no_bias": (
        dict(num_kv_heads=1, head_dim=6, qkv_bias=False, out_bias=False),
        dict(is_causal=True),
    ),
    "cross_padding": (dict(context_features=24), dict(context=True, padding=True)),
    "fused_qkv_causal": (dict(fused_qkv=True), dict(is_causal=True)),
    "rope_causal": (dict(rope=Rope(base=100.0)), dict(is_causal=True)),
    "rope_gqa_explicit_positions": (
        dict(rope=Rope(base=50.0), num_kv_heads=2),
        dict(positions=True, is_causal=True),
    ),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_matches_numpy_reference(case):
    init_kwargs, call = ATTENTION_CASES[case]
    mha = _build(lambda: MultiHeadAttention(D, H, **init_kwargs, rngs=nnx.Rngs(0)), 1, scale=0.2)
    x = _normal(2, (B, T, D))
    context = _normal(3, (B, 5, 24)) if call.get("context") else None
    kv_len = T if context is None else context.shape[1]
    mask = _padding_mask([kv_len, kv_len - 3], kv_len) if call.get("padding") else None
    bias = _normal(4, (1, H, T, T)) if call.get("bias") else None
    positions = np.array([[3] * T, [11] * T]) + np.arange(T) if call.get("positions") else None
    causal = call.get("is_causal", False)
    y = _attend(
        mha,
        _f32(x),
        None if context is None else _f32(context),
        mask=None if mask is None else jnp.asarray(mask),
        bias=None if bias is None else _f32(bias),
        positions=None if positions is None else jnp.asarray(positions, jnp.int32),
        is_causal=causal,
    )
    assert y.shape == (B, T, D)
    expected = _mha_reference(
        mha, x, context, mask=mask, bias=bias, causal=causal, positions=positions
    )
    np.testing.assert_allclose(y, expected, **TOL)


def test_attention_param_names_and_shapes():
    mha = nnx.eval_shape(lambda: MultiHeadAttention(D, H, num_kv_heads=2, rngs=nnx.Rngs(0)))
    specs = nnx.get_partition_spec(nnx.state(mha, nnx.Param))
    assert tuple(specs["query"]["kernel"].get_value()) == ("embed", "heads", "head_dim")
    assert tuple(specs["key"]["kernel"].get_value()) == ("embed", "kv_heads", "head_dim")
    assert tuple(specs["value"]["kernel"].get_value()) == ("embed", "kv_heads", "head_dim")
    assert tuple(specs["out"]["kernel"].get_value()) == ("heads", "head_dim", "embed")
    assert mha.key.kernel.shape == (D, 2, DH) and mha.out.kernel.shape == (H, DH, D)
    fused = nnx.eval_shape(lambda: MultiHeadAttention(D, H, fused_qkv=True, rngs=nnx.Rngs(0)))
    assert fused.qkv.kernel.shape == (D, 3, H, DH)
    assert fused.qkv.kernel.get_metadata()["out_sharding"] == ("embed", "qkv", "heads", "head_dim")


def test_attention_invalid_configurations_raise():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        MultiHeadAttention(D, H, num_kv_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="fused_qkv"):
        MultiHeadAttention(D, H, num_kv_heads=2, fused_qkv=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="fused_qkv"):
        MultiHeadAttention(D, H, context_features=24, fused_qkv=True, rngs=nnx.Rngs(0))
    mha = _build(lambda: MultiHeadAttention(D, H, rngs=nnx.Rngs(0)), 1)
    with pytest.raises(ValueError, match="batch, length, features"):
        mha(jnp.zeros((T, D)))
    fused = _build(lambda: MultiHeadAttention(D, H, fused_qkv=True, rngs=nnx.Rngs(0)), 2)
    with pytest.raises(ValueError, match="fused_qkv attention is self-attention"):
        fused(jnp.zeros((B, T, D)), jnp.zeros((B, T, D)))


# --------------------------------------------------------------------------------------------
# KV cache


@pytest.mark.parametrize(
    "init_kwargs",
    [dict(), dict(rope=Rope(base=100.0), num_kv_heads=2)],
    ids=["plain", "rope_gqa"],
)
def test_kv_cache_chunked_decode_equals_full_causal_call(init_kwargs):
    seq, max_len, prefill = 10, 12, 5
    mha = _build(lambda: MultiHeadAttention(D, H, **init_kwargs, rngs=nnx.Rngs(0)), 1, scale=0.2)
    x = _normal(2, (B, seq, D))
    full = _attend(mha, _f32(x), is_causal=True)
    expected = _mha_reference(mha, x, causal=True)
    np.testing.assert_allclose(full, expected, **TOL)

    mha.init_cache(B, max_len)
    hk = mha.num_kv_heads
    assert mha.cached_key.shape == (B, hk, max_len, DH)  # heads before positions
    outputs = [_decode(mha, _f32(x[:, :prefill]), jnp.int32(0))]
    for i in range(prefill, seq):
        outputs.append(_decode(mha, _f32(x[:, i : i + 1]), jnp.int32(i)))
    decoded = np.concatenate([np.asarray(o) for o in outputs], axis=1)
    np.testing.assert_allclose(decoded, full, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(decoded, expected, **TOL)

    # The cache holds the (rotated) keys and values of the positions written, zeros after.
    _, k, v = _projections(mha, x)
    if mha.rope is not None:
        k = _rope_ref(k, np.arange(seq), mha.rope.base)
    cached_key, cached_value = (c[...].swapaxes(1, 2) for c in (mha.cached_key, mha.cached_value))
    np.testing.assert_allclose(cached_key[:, :seq], k, **TOL)
    np.testing.assert_allclose(cached_value[:, :seq], v, **TOL)
    np.testing.assert_array_equal(cached_key[:, seq:], 0.0)


def test_decode_without_cache_raises():
    mha = _build(lambda: MultiHeadAttention(D, H, rngs=nnx.Rngs(0)), 1)
    x = jnp.zeros((B, 1, D))
    with pytest.raises(ValueError, match="init_cache"):
        mha(x, is_causal=True, cache_index=jnp.int32(0))
    mha.init_cache(B, 4)
    with pytest.raises(ValueError, match="batch size"):
        mha(jnp.zeros((B + 1, 1, D)), is_causal=True, cache_index=jnp.int32(0))
    with pytest.raises(ValueError, match="takes no context"):
        mha(x, jnp.zeros((B, 3, D)), cache_index=jnp.int32(0))


# --------------------------------------------------------------------------------------------
# Attention dropout and attention_fn


def test_attention_dropout_train_differs_eval_is_deterministic():
    x = _normal(2, (B, T, D))
    mha = _build(lambda: MultiHeadAttention(D, H, dropout_rate=0.5, rngs=nnx.Rngs(0)), 1, scale=0.2)
    without_dropout = _mha_reference(mha, x)

    first, second = np.asarray(_attend(mha, _f32(x))), np.asarray(_attend(mha, _f32(x)))
    assert np.isfinite(first).all()
    assert not np.allclose(first, second)
    assert not np.allclose(first, without_dropout, atol=1e-3)

    mha.eval()
    third, fourth = np.asarray(_attend(mha, _f32(x))), np.asarray(_attend(mha, _f32(x)))
    np.testing.assert_array_equal(third, fourth)
    np.testing.assert_allclose(third, without_dropout, **TOL)
    mha.train()
    assert not np.allclose(np.asarray(_attend(mha, _f32(x))), without_dropout, atol=1e-3)


def test_attention_fn_is_used_with_dropout_arguments():
    calls = []

    def zeros_attention(q, k, v, bias, mask, *, is_causal, dropout_rate, dropout_rng):
        calls.append(
            dict(
                q=q.shape,
                k=k.shape,
                v=v.shape,
                is_causal=is_causal,
                rate=dropout_rate,
                rng=dropout_rng is not None,
                mask=mask is not None,
            )
        )
        return jnp.zeros(q.shape[:3] + v.shape[-1:], q.dtype)

    mha = _build(
        lambda: MultiHeadAttention(
            D,
            H,
            num_kv_heads=2,
            dropout_rate=0.25,
            attention_fn=zeros_attention,
            rngs=nnx.Rngs(0),
        ),
        1,
    )
    mask = jnp.ones((B, 1, 1, T), bool)
    y = mha(_f32(_normal(2, (B, T, D))), mask=mask, is_causal=True)
    # The heads are zero, so only the output bias remains.
    np.testing.assert_allclose(y, np.broadcast_to(_f64(mha.out.bias[...]), (B, T, D)), **TOL)
    assert calls == [
        dict(
            q=(B, T, H, DH),
            k=(B, T, 2, DH),
            v=(B, T, 2, DH),
            is_causal=True,
            rate=0.25,
            rng=True,
            mask=True,
        )
    ]
    mha.eval()
    mha(_f32(_normal(2, (B, T, D))))
    assert calls[-1]["rate"] == 0.0 and not calls[-1]["rng"] and not calls[-1]["is_causal"]


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
    rpb = _build(
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
    table = _f64(rpb.table.embedding[...])  # [num_buckets, H]
    expected = np.moveaxis(table[buckets], -1, 0)[None]  # [1, H, Tq, Tk]
    np.testing.assert_array_equal(_f64(bias), expected)
    # Per-row positions give a per-row bias.
    q_batch = np.stack([q_pos, q_pos + 4])
    batched = _relative_bias(rpb, jnp.asarray(q_batch), jnp.asarray(np.stack([k_pos, k_pos])))
    assert batched.shape == (2, H, 5, 12)
    np.testing.assert_array_equal(_f64(batched[:1]), expected)
    buckets_1 = _t5_bucket(k_pos[None, :] - q_batch[1][:, None], bidirectional, 16, 20)
    np.testing.assert_array_equal(_f64(batched[1]), np.moveaxis(table[buckets_1], -1, 0))


# --------------------------------------------------------------------------------------------
# LayerStack


class _ResidualMLP(nnx.Module):
    def __init__(self, rngs):
        self.norm = LayerNorm(16, rngs=rngs)
        self.mlp = MLP(16, 24, activation="gelu", rngs=rngs)

    def __call__(self, x):
        return x + self.mlp(self.norm(x))


def _residual_stack(**kwargs):
    return LayerStack(2, _ResidualMLP, **kwargs, rngs=nnx.Rngs(0))


def _residual_mlp_ref(state, x):
    """NumPy forward of a scanned stack of _ResidualMLP from its stacked parameters."""
    p = jax.tree.map(_f64, nnx.to_pure_dict(state))
    for i in range(p["norm"]["scale"].shape[0]):
        h = _layer_norm_ref(x, p["norm"]["scale"][i], p["norm"]["bias"][i], 1e-5)
        h = _gelu_exact(h @ p["mlp"]["wi"]["kernel"][i] + p["mlp"]["wi"]["bias"][i])
        x = x + h @ p["mlp"]["wo"]["kernel"][i] + p["mlp"]["wo"]["bias"][i]
    return x


def _tiny_encoder_layer(rngs):
    cfg = ModelConfig.from_preset(
        "bert-tiny",
        d_model=D,
        num_heads=H,
        d_ff=64,
        embedding_dropout=0.0,
        residual_dropout=0.0,
        attention_dropout=0.0,
    )
    return EncoderLayer(cfg, num_layers=2, rngs=rngs)


@nnx.jit
def _run_stacks(stacks, x, mask):
    """Both stacks in one program: one compile instead of two."""
    return [stack(x, mask=mask) for stack in stacks]


def test_scan_and_loop_stacks_compute_the_same_function():
    loop = _build(lambda: LayerStack(2, _tiny_encoder_layer, scan=False, rngs=nnx.Rngs(0)), 1)
    scan = _build(lambda: LayerStack(2, _tiny_encoder_layer, scan=True, rngs=nnx.Rngs(0)), 2)
    x = _f32(_normal(2, (B, T, D)))
    mask = jnp.asarray(_padding_mask([T, T - 4], T))
    y_loop, y_scan_before = map(np.asarray, _run_stacks([loop, scan], x, mask))
    assert not np.allclose(y_scan_before, y_loop)  # different seeds: the update matters

    stacked = stack_layer_states([nnx.state(layer) for layer in loop.layers])
    nnx.update(scan.layers, stacked)
    kernel = stacked["mlp"]["wi"]["kernel"]
    assert kernel.get_metadata()["out_sharding"] == ("layers", "embed", "mlp")
    y_loop_again, y_scan = _run_stacks([loop, scan], x, mask)
    np.testing.assert_array_equal(y_loop_again, y_loop)
    np.testing.assert_allclose(y_scan, y_loop, rtol=1e-5, atol=1e-5)

    # The mask reaches the layers: changing the padded tokens of row 1 leaves its real tokens
    # (and row 0) unchanged, in both stacks.
    x_padding_changed = np.array(x)
    x_padding_changed[1, T - 4 :] = _normal(3, (4, D))
    for y in _run_stacks([loop, scan], _f32(x_padding_changed), mask):
        y = np.asarray(y)
        np.testing.assert_allclose(y[:, : T - 4], y_loop[:, : T - 4], rtol=1e-5, atol=1e-5)
        assert not np.allclose(y[1, T - 4 :], y_loop[1, T - 4 :])


def test_scanned_params_have_leading_layers_axis_name():
    loop = nnx.eval_shape(lambda: _residual_stack(scan=False))
    scan = nnx.eval_shape(lambda: _residual_stack(scan=True))
    loop_params = nnx.to_flat_state(nnx.state(loop.layers[0], nnx.Param))
    scan_params = nnx.to_flat_state(nnx.state(scan.layers, nnx.Param))
    assert [path for path, _ in loop_params] == [path for path, _ in scan_params]
    for (path, one), (_, stacked) in zip(loop_params, scan_params, strict=True):
        names = stacked.get_metadata()["out_sharding"]
        assert names == ("layers", *one.get_metadata()["out_sharding"]), path
        assert stacked.shape == (2, *one.shape), path
    specs = nnx.get_partition_spec(nnx.state(scan, nnx.Param))
    assert tuple(specs["layers"]["mlp"]["wi"]["kernel"].get_value()) == ("layers", "embed", "mlp")


def test_scanned_layers_are_initialized_independently():
    stack = LayerStack(
        3, lambda rngs: Dense(2, 3, names=("a", "b"), rngs=rngs), scan=True, rngs=nnx.Rngs(0)
    )
    kernel = np.asarray(stack.layers.kernel[...])
    assert kernel.shape == (3, 2, 3)
    assert not np.allclose(kernel[0], kernel[1]) and not np.allclose(kernel[1], kernel[2])


@nnx.jit
def _losses_and_grads(stacks, x):
    """``value_and_grad`` of every stack in one program: one compile instead of one each."""

    def loss(stack):
        return jnp.sum(jnp.sin(stack(x)))

    return [nnx.value_and_grad(loss)(stack) for stack in stacks]


def test_remat_policies_give_identical_values_and_gradients():
    x_np = _normal(2, (B, 5, 16))
    policies = ("none", "full", "dots_saveable")
    stacks = [_build(lambda r=r: _residual_stack(scan=True, remat=r), 1) for r in policies]
    params = nnx.state(stacks[0], nnx.Param)
    for stack in stacks[1:]:
        nnx.update(stack, params)
    (value, grads), *others = _losses_and_grads(stacks, _f32(x_np))
    expected = np.sum(np.sin(_residual_mlp_ref(params["layers"], x_np)))
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    for remat, (other_value, other_grads) in zip(policies[1:], others, strict=True):
        assert stacks[policies.index(remat)].remat == remat
        np.testing.assert_allclose(other_value, value, rtol=1e-6)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), other_grads, grads
        )
    assert all(np.abs(np.asarray(g.get_value())).max() > 0 for _, g in nnx.to_flat_state(grads))


def test_unknown_remat_raises():
    with pytest.raises(ValueError, match="remat must be one of"):
        nnx.eval_shape(lambda: _residual_stack(remat="everything"))
