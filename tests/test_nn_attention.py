"""flaxformer_lite.nn.MultiHeadAttention (self, cross, GQA/MQA, fused q/k/v, RoPE), its KV
cache, dropout and the arguments it passes ``ops.dot_product_attention``, against float64 NumPy
references.

Every reference here reads the module's parameters and recomputes the output with NumPy only
(``attention_reference.naive_attention`` for the softmax attention itself), so a bug in ``ops``
cannot cancel out. Inputs and modules come from ``nn_numpy.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import naive_attention
from flax import nnx
from nn_numpy import DH, TOL, B, D, H, T, build, f32, f64, normal, padding_mask

from flaxformer_lite import ops
from flaxformer_lite.nn import MultiHeadAttention, Rope

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


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
        out = np.tensordot(h, f64(kernel), axes=1)
        return out if bias is None else out + f64(bias)

    if mha.fused_qkv and mha.qkv.kernel.ndim == 4:
        w, b = f64(mha.qkv.kernel[...]), f64(mha.qkv.bias[...])  # [D, 3, H, Dh], [3, H, Dh]
        return tuple(proj(w[:, i], b[i], x) for i in range(3))
    if mha.fused_qkv:  # [D, H + 2 Hk, Dh]: the query heads, then the key heads, then the values
        w, b, hk = f64(mha.qkv.kernel[...]), f64(mha.qkv.bias[...]), mha.num_kv_heads
        h = w.shape[1] - 2 * hk
        return tuple(proj(w[:, s], b[s], x) for s in np.split(np.arange(h + 2 * hk), [h, h + hk]))
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
    out = np.tensordot(heads, f64(mha.out.kernel[...]), axes=2)
    return out if mha.out.bias is None else out + f64(mha.out.bias[...])


@nnx.jit(static_argnames=("is_causal",))
def _attend(mha, x, context=None, mask=None, bias=None, positions=None, is_causal=False):
    return mha(x, context, mask=mask, bias=bias, positions=positions, is_causal=is_causal)


@nnx.jit
def _decode(mha, x, cache_index):
    return mha(x, is_causal=True, cache_index=cache_index)


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
    "fused_qkv_gqa_causal_padding": (
        dict(fused_qkv=True, num_kv_heads=2),
        dict(is_causal=True, padding=True),
    ),
    "fused_qkv_mqa_rope": (dict(fused_qkv=True, num_kv_heads=1, rope=Rope(base=100.0)), dict()),
    "rope_causal": (dict(rope=Rope(base=100.0)), dict(is_causal=True)),
    "rope_gqa_explicit_positions": (
        dict(rope=Rope(base=50.0), num_kv_heads=2),
        dict(positions=True, is_causal=True),
    ),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_attention_matches_numpy_reference(case):
    init_kwargs, call = ATTENTION_CASES[case]
    mha = build(lambda: MultiHeadAttention(D, H, **init_kwargs, rngs=nnx.Rngs(0)), 1, scale=0.2)
    x = normal(2, (B, T, D))
    context = normal(3, (B, 5, 24)) if call.get("context") else None
    kv_len = T if context is None else context.shape[1]
    mask = padding_mask([kv_len, kv_len - 3], kv_len) if call.get("padding") else None
    bias = normal(4, (1, H, T, T)) if call.get("bias") else None
    positions = np.array([[3] * T, [11] * T]) + np.arange(T) if call.get("positions") else None
    causal = call.get("is_causal", False)
    y = _attend(
        mha,
        f32(x),
        None if context is None else f32(context),
        mask=None if mask is None else jnp.asarray(mask),
        bias=None if bias is None else f32(bias),
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


def test_fused_gqa_kernel_names_shapes_and_parameter_count():
    def make(fused):
        return MultiHeadAttention(D, H, num_kv_heads=2, fused_qkv=fused, rngs=nnx.Rngs(0))

    fused, separate = nnx.eval_shape(lambda: make(True)), nnx.eval_shape(lambda: make(False))
    assert fused.qkv.kernel.shape == (D, H + 2 * 2, DH)
    assert fused.qkv.kernel.get_metadata()["out_sharding"] == ("embed", "qkv_heads", "head_dim")
    assert fused.qkv.bias.get_metadata()["out_sharding"] == ("qkv_heads", "head_dim")

    def count(module):
        return sum(p.size for p in jax.tree.leaves(nnx.state(module, nnx.Param)))

    assert count(fused) == count(separate)


def test_fused_gqa_equals_separate_projections_with_the_same_weights():
    def make(fused):
        return MultiHeadAttention(
            D, H, num_kv_heads=2, fused_qkv=fused, rope=Rope(base=100.0), rngs=nnx.Rngs(0)
        )

    separate = build(lambda: make(False), 1, scale=0.2)
    fused = build(lambda: make(True), 2)
    parts = (separate.query, separate.key, separate.value)
    fused.qkv.kernel[...] = jnp.concatenate([p.kernel[...] for p in parts], axis=1)
    fused.qkv.bias[...] = jnp.concatenate([p.bias[...] for p in parts], axis=0)
    fused.out.kernel[...], fused.out.bias[...] = separate.out.kernel[...], separate.out.bias[...]
    x = f32(normal(2, (B, T, D)))
    expected = _attend(separate, x, is_causal=True)
    np.testing.assert_allclose(_attend(fused, x, is_causal=True), expected, rtol=1e-6, atol=1e-6)


def test_fused_gqa_initializes_each_projection_with_its_own_fans():
    # Xavier's bound sqrt(6 / (fan_in + fan_out)) differs for the query and key/value pieces.
    mha = MultiHeadAttention(64, 8, num_kv_heads=1, fused_qkv=True, rngs=nnx.Rngs(0))
    kernel = np.asarray(mha.qkv.kernel[...])  # [64, 8 + 2, 8]
    query_bound, kv_bound = np.sqrt(6 / (64 + 64)), np.sqrt(6 / (64 + 8))
    assert np.abs(kernel[:, :8]).max() <= query_bound < np.abs(kernel[:, 8:]).max() <= kv_bound


def test_attention_invalid_configurations_raise():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        MultiHeadAttention(D, H, num_kv_heads=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="fused_qkv"):
        MultiHeadAttention(D, H, num_kv_heads=2, fused_qkv=True, cross=True, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="fused_qkv"):
        MultiHeadAttention(D, H, context_features=24, fused_qkv=True, rngs=nnx.Rngs(0))
    mha = build(lambda: MultiHeadAttention(D, H, rngs=nnx.Rngs(0)), 1)
    with pytest.raises(ValueError, match="batch, length, features"):
        mha(jnp.zeros((T, D)))
    fused = build(lambda: MultiHeadAttention(D, H, fused_qkv=True, rngs=nnx.Rngs(0)), 2)
    with pytest.raises(ValueError, match="fused_qkv attention is self-attention"):
        fused(jnp.zeros((B, T, D)), jnp.zeros((B, T, D)))


# --------------------------------------------------------------------------------------------
# KV cache


@pytest.mark.parametrize(
    "init_kwargs",
    [
        dict(),
        dict(rope=Rope(base=100.0), num_kv_heads=2),
        dict(rope=Rope(base=100.0), num_kv_heads=2, fused_qkv=True),
    ],
    ids=["plain", "rope_gqa", "rope_fused_gqa"],
)
def test_kv_cache_chunked_decode_equals_full_causal_call(init_kwargs):
    seq, max_len, prefill = 10, 12, 5
    mha = build(lambda: MultiHeadAttention(D, H, **init_kwargs, rngs=nnx.Rngs(0)), 1, scale=0.2)
    x = normal(2, (B, seq, D))
    full = _attend(mha, f32(x), is_causal=True)
    expected = _mha_reference(mha, x, causal=True)
    np.testing.assert_allclose(full, expected, **TOL)

    mha.init_cache(B, max_len)
    hk = mha.num_kv_heads
    assert mha.cached_key.shape == (B, hk, max_len, DH)  # heads before positions
    outputs = [_decode(mha, f32(x[:, :prefill]), jnp.int32(0))]
    for i in range(prefill, seq):
        outputs.append(_decode(mha, f32(x[:, i : i + 1]), jnp.int32(i)))
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
    mha = build(lambda: MultiHeadAttention(D, H, rngs=nnx.Rngs(0)), 1)
    x = jnp.zeros((B, 1, D))
    with pytest.raises(ValueError, match="init_cache"):
        mha(x, is_causal=True, cache_index=jnp.int32(0))
    mha.init_cache(B, 4)
    with pytest.raises(ValueError, match="batch size"):
        mha(jnp.zeros((B + 1, 1, D)), is_causal=True, cache_index=jnp.int32(0))
    with pytest.raises(ValueError, match="takes no context"):
        mha(x, jnp.zeros((B, 3, D)), cache_index=jnp.int32(0))


# --------------------------------------------------------------------------------------------
# Attention dropout and what ops.dot_product_attention gets


def test_attention_dropout_train_differs_eval_is_deterministic():
    x = normal(2, (B, T, D))
    mha = build(lambda: MultiHeadAttention(D, H, dropout_rate=0.5, rngs=nnx.Rngs(0)), 1, scale=0.2)
    without_dropout = _mha_reference(mha, x)

    first, second = np.asarray(_attend(mha, f32(x))), np.asarray(_attend(mha, f32(x)))
    assert np.isfinite(first).all()
    assert not np.allclose(first, second)
    assert not np.allclose(first, without_dropout, atol=1e-3)

    mha.eval()
    third, fourth = np.asarray(_attend(mha, f32(x))), np.asarray(_attend(mha, f32(x)))
    np.testing.assert_array_equal(third, fourth)
    np.testing.assert_allclose(third, without_dropout, **TOL)
    mha.train()
    assert not np.allclose(np.asarray(_attend(mha, f32(x))), without_dropout, atol=1e-3)


def test_attention_gets_the_dropout_arguments(monkeypatch):
    calls = []

    def zeros_attention(q, k, v, bias, mask, *, dropout_rate, dropout_rng, **kwargs):
        calls.append(
            dict(
                q=q.shape,
                k=k.shape,
                v=v.shape,
                is_causal=mask.is_causal,
                rate=dropout_rate,
                rng=dropout_rng is not None,
                mask=mask.explicit is not None,
            )
        )
        return jnp.zeros(q.shape[:3] + v.shape[-1:], q.dtype)

    mha = build(
        lambda: MultiHeadAttention(D, H, num_kv_heads=2, dropout_rate=0.25, rngs=nnx.Rngs(0)), 1
    )
    monkeypatch.setattr(ops, "dot_product_attention", zeros_attention)
    mask = jnp.ones((B, 1, 1, T), bool)
    y = mha(f32(normal(2, (B, T, D))), mask=mask, is_causal=True)
    # The heads are zero, so only the output bias remains.
    np.testing.assert_allclose(y, np.broadcast_to(f64(mha.out.bias[...]), (B, T, D)), **TOL)
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
    mha(f32(normal(2, (B, T, D))))
    assert calls[-1]["rate"] == 0.0 and not calls[-1]["rng"] and not calls[-1]["is_causal"]
