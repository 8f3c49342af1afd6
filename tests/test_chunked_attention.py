"""chunked_attention equals ops.reference_attention in values and gradients, in O(T) memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import ATOL, BF16_GRAD_REL, assert_close_to_scale, dense_bool_shapes
from attention_reference import naive_attention

from flaxformer_lite import ops

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

CASES = {
    "plain": dict(),
    "causal_gqa": dict(is_causal=True),
    "causal_short_query": dict(is_causal=True, tq=5),
    "causal_long_query": dict(is_causal=True, tk=7),
    "window": dict(local_window=(3, 2)),
    "causal_window_mask": dict(is_causal=True, local_window=(4, 0), mask=True),
    "causal_window_looking_ahead": dict(is_causal=True, local_window=(2, 3)),
    "window_mostly_ahead": dict(local_window=(1, 3)),
    "window_long_query": dict(local_window=(3, 1), tk=7),
}

BIAS_SHAPES = {
    "none": None,
    "per_head": lambda b, h, tq, tk: (h, tq, tk),
    "per_example": lambda b, h, tq, tk: (b, 1, tq, tk),
    "per_key": lambda b, h, tq, tk: (1, h, 1, tk),
    "shared": lambda b, h, tq, tk: (tq, tk),
}

# (case, (block_q, block_k), bias): every case and every bias layout, with blocks that divide
# the lengths, blocks that do not, and blocks larger than the lengths.
COMBINATIONS = [
    ("plain", (4, 4), "none"),
    ("plain", (3, 5), "per_head"),
    ("causal_gqa", (4, 4), "per_head"),
    ("causal_gqa", (3, 5), "per_example"),
    ("causal_gqa", (64, 64), "shared"),
    ("causal_short_query", (2, 4), "per_key"),
    ("causal_short_query", (3, 5), "none"),
    ("causal_long_query", (4, 3), "per_head"),
    ("causal_long_query", (5, 2), "shared"),
    ("window", (4, 4), "per_example"),
    ("window", (5, 3), "per_key"),
    ("causal_window_mask", (3, 5), "per_head"),
    ("causal_window_mask", (4, 4), "none"),
    ("causal_window_looking_ahead", (3, 4), "per_head"),
    ("window_mostly_ahead", (2, 4), "none"),
    ("window_mostly_ahead", (1, 1), "per_key"),
    ("window_long_query", (2, 3), "shared"),
]


def setup(case, bias_shape, seed=0):
    case = dict(case)
    b, hq, hk, d = 2, 4, 2, 8
    tq, tk = case.pop("tq", 12), case.pop("tk", 12)
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, tq, hq, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, tk, hk, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, tk, hk, d)), jnp.float32)
    bias = None
    if bias_shape is not None:
        bias = jnp.asarray(rng.standard_normal(bias_shape(b, hq, tq, tk)), jnp.float32)
    mask = jnp.asarray(rng.random((b, 1, tq, tk)) < 0.75) if case.pop("mask", False) else None
    return q, k, v, bias, mask, case


def loss_and_grads(attend, q, k, v, bias, mask):
    """The output, and the gradients of a scalar loss w.r.t. q, k, v (and bias), jitted."""

    def loss(q, k, v, bias):
        out = attend(q, k, v, bias, mask)
        return jnp.sum(jnp.cos(out) * jnp.arange(v.shape[-1])), out

    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(q, k, v, bias)
    return out, grads


@pytest.mark.parametrize("case, blocks, bias_name", COMBINATIONS, ids=str)
def test_values_and_gradients_equal_reference(case, blocks, bias_name):
    q, k, v, bias, mask, flags = setup(CASES[case], BIAS_SHAPES[bias_name])
    reference = functools.partial(ops.reference_attention, **flags)
    chunked = functools.partial(
        ops.chunked_attention, **flags, block_q=blocks[0], block_k=blocks[1]
    )
    out_reference, grads_reference = loss_and_grads(reference, q, k, v, bias, mask)
    out_chunked, grads_chunked = loss_and_grads(chunked, q, k, v, bias, mask)
    np.testing.assert_allclose(out_chunked, out_reference, atol=ATOL)
    for g_chunked, g_reference in zip(grads_chunked, grads_reference, strict=True):
        assert g_chunked.shape == g_reference.shape
        assert_close_to_scale(g_chunked, g_reference)


# (flags, (block_q, block_k)) of packed rows: causal with grouped heads, blocks that divide the
# lengths and blocks that do not (padded keys and rows), windows, global tokens, a key padding
# mask beside the ids, and queries at given positions.
SEGMENT_CASES = {
    "causal_gqa": (dict(is_causal=True), (4, 4)),
    "causal_padded_blocks": (dict(is_causal=True), (5, 3)),
    "window": (dict(local_window=(3, 2)), (4, 5)),
    "causal_window_global": (dict(is_causal=True, local_window=(2, 0), global_tokens=2), (3, 4)),
    "key_padding": (dict(is_causal=True, key_padding=True), (5, 5)),
    "short_query": (dict(is_causal=True, tq=5), (2, 4)),
    "query_positions": (dict(is_causal=True, query_positions=True), (4, 5)),
}


def packed_ids(rng, b, length):
    """int ``[B, length]``: each row cut into up to four segments, 0 first (as padding is)."""
    return np.sort(rng.integers(0, 4, (b, length)), axis=1).astype(np.int32)


@pytest.mark.parametrize("case", SEGMENT_CASES)
def test_segment_ids_equal_their_dense_mask_in_values_and_gradients(case):
    """The kernel masks each block by its slice of the ids: the values and gradients of the
    reference with the segments' whole ``[T, S]`` mask, and a float64 formula's values."""
    flags, (block_q, block_k) = SEGMENT_CASES[case]
    flags = dict(flags)
    key_padding, at_positions = flags.pop("key_padding", False), flags.pop("query_positions", 0)
    q, k, v, _, _, flags = setup(flags, None)
    b, tq, tk = q.shape[0], q.shape[1], k.shape[1]
    rng = np.random.default_rng(1)
    kv_ids = packed_ids(rng, b, tk)
    rows = np.arange(tk - tq, tk)
    if at_positions:  # the queries of one shard of a zig-zag layout: positions 0-5 and 18-23
        q, rows = q[:, :6].repeat(2, axis=1), np.r_[0:6, 18:24]
        k, v, kv_ids = (jnp.concatenate([x, x], axis=1) for x in (k, v, kv_ids))
        flags["query_positions"] = jnp.asarray(rows)
    segment_ids = (jnp.asarray(np.asarray(kv_ids)[:, rows]), jnp.asarray(kv_ids))
    mask = jnp.asarray(rng.random((b, 1, 1, k.shape[1])) < 0.8) if key_padding else None
    whole = ops.AttentionMask(**flags, segment_ids=segment_ids, explicit=mask)
    reference = lambda q, k, v, bias, mask: ops.reference_attention(q, k, v, mask=whole)  # noqa: E731
    chunked = functools.partial(
        ops.chunked_attention, **flags, segment_ids=segment_ids, block_q=block_q, block_k=block_k
    )
    out_reference, grads_reference = loss_and_grads(reference, q, k, v, None, None)
    out_chunked, grads_chunked = loss_and_grads(chunked, q, k, v, None, mask)
    np.testing.assert_allclose(out_chunked, out_reference, atol=ATOL)
    for g_chunked, g_reference in zip(grads_chunked, grads_reference, strict=True):
        assert_close_to_scale(g_chunked, g_reference)
    if case in ("causal_gqa", "causal_padded_blocks", "key_padding"):
        allowed = np.asarray(segment_ids[0])[:, None, :, None] == kv_ids[:, None, None, :]
        if mask is not None:
            allowed = allowed & np.asarray(mask)
        expected = naive_attention(q, k, v, mask=allowed, causal=True)
        np.testing.assert_allclose(out_chunked, expected, atol=ATOL)


def test_segment_ids_build_no_dense_mask():
    """Packed rows of 4096 tokens: chunked's forward and backward hold the segments' mask only
    block by block, never as a ``[T, S]`` array (the dispatch passes the ids as ids)."""
    t = 4096
    x = jax.ShapeDtypeStruct((1, t, 2, 16), jnp.float32)
    ids = jax.ShapeDtypeStruct((1, t), jnp.int32)

    def loss(q, ids):
        attend = functools.partial(ops.dot_product_attention, implementation="chunked")
        return jnp.sum(attend(q, q, q, is_causal=True, segment_ids=(ids, ids)))

    text = jax.jit(jax.value_and_grad(loss)).lower(x, ids).as_text()
    assert dense_bool_shapes(text, 512, 512)  # the blocks' masks are there
    assert dense_bool_shapes(text, t, t) == []
    folded = jax.jit(lambda ids: ops.segment_mask(ids, ids)).lower(ids).as_text()
    assert dense_bool_shapes(folded, t, t)  # the check sees a dense mask where there is one


def test_bfloat16_gradients_close_to_float32():
    q, k, v, bias, mask, flags = setup(CASES["causal_gqa"], BIAS_SHAPES["per_head"])
    chunked = functools.partial(ops.chunked_attention, **flags, block_q=4, block_k=4)
    _, grads32 = loss_and_grads(chunked, q, k, v, bias, mask)
    low = [jnp.asarray(np.asarray(x).astype(jnp.bfloat16)) for x in (q, k, v)]
    out16, grads16 = loss_and_grads(chunked, *low, bias, mask)
    assert out16.dtype == jnp.bfloat16 and grads16[0].dtype == jnp.bfloat16
    for g16, g32 in zip(grads16, grads32, strict=True):
        assert_close_to_scale(g16.astype(jnp.float32), g32, rel=BF16_GRAD_REL)
        with pytest.raises(AssertionError):  # a gradient 3% off everywhere fails
            assert_close_to_scale(1.03 * g16.astype(jnp.float32), g32, rel=BF16_GRAD_REL)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def chunked_keep_mask(rng, rate, shape, block_q, block_k):
    """Reassembles the per-block dropout masks that chunked_attention draws: [B, Hq, Tq, Tk]."""
    b, hk, g, tq, tk = shape
    rows = []
    for i in range(-(-tq // block_q)):
        row = []
        for j in range(-(-tk // block_k)):
            block_rng = jax.random.fold_in(jax.random.fold_in(rng, i), j)
            row.append(jax.random.bernoulli(block_rng, 1 - rate, (b, hk, g, block_q, block_k)))
        rows.append(jnp.concatenate(row, axis=-1))
    keep = jnp.concatenate(rows, axis=-2)[..., :tq, :tk]
    return keep.reshape(b, hk * g, tq, tk)


def test_dropout_matches_explicit_mask_in_values_and_gradients():
    q, k, v, _, _, flags = setup(CASES["causal_gqa"], None)
    rate, rng = 0.3, jax.random.key(11)
    attend = functools.partial(
        ops.chunked_attention, **flags, dropout_rate=rate, block_q=5, block_k=4
    )
    keep = np.asarray(chunked_keep_mask(rng, rate, (2, 2, 2, 12, 12), 5, 4))
    assert 0.6 < keep.mean() < 0.8
    out = jax.jit(attend)(q, k, v, dropout_rng=rng)
    np.testing.assert_array_equal(out, jax.jit(attend)(q, k, v, dropout_rng=rng))
    expected = naive_attention(q, k, v, causal=True, keep=keep, dropout_rate=rate)
    np.testing.assert_allclose(out, expected, atol=ATOL)

    # The backward pass must redraw the same mask: compare with autodiff of the explicit-mask
    # formula (the xla path with dropout folded into a multiplicative mask on the weights).
    def explicit(q, k, v):
        weights = ops.attention_weights(q, k, is_causal=True)
        weights = jnp.where(keep, weights / (1 - rate), 0.0)
        v_per_head = jnp.repeat(v, 2, axis=2)
        return jnp.einsum("bhqk,bkhd->bqhd", weights, v_per_head)

    def grads_of(f):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v))), (0, 1, 2)))

    grads = grads_of(functools.partial(attend, dropout_rng=rng))(q, k, v)
    expected_grads = grads_of(explicit)(q, k, v)
    for g, e in zip(grads, expected_grads, strict=True):
        assert_close_to_scale(g, e)


def test_vmap_of_grad():
    q, k, v, bias, _, flags = setup(CASES["causal_gqa"], BIAS_SHAPES["per_head"])
    attend = functools.partial(ops.chunked_attention, **flags, block_q=5, block_k=5)
    grad_fn = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v, bias) ** 2), (0, 1, 2))
    batched = jax.jit(jax.vmap(grad_fn))(*(jnp.stack([x, -x]) for x in (q, k, v)))
    single = jax.jit(grad_fn)(-q, -k, -v)
    for g_batched, g_single in zip(batched, single, strict=True):
        assert_close_to_scale(g_batched[1], g_single)


def temp_bytes(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_backward_memory_is_linear_in_length():
    b, h, d = 1, 2, 16

    def grad_temp_bytes(t, implementation):
        q = jax.ShapeDtypeStruct((b, t, h, d), jnp.float32)
        attend = (
            functools.partial(ops.chunked_attention, is_causal=True, block_q=128, block_k=128)
            if implementation == "chunked"
            else functools.partial(ops.dot_product_attention, is_causal=True, implementation="xla")
        )
        grad = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v)), (0, 1, 2))
        return temp_bytes(grad, q, q, q)

    chunked_small, chunked_large = (
        grad_temp_bytes(1024, "chunked"),
        grad_temp_bytes(4096, "chunked"),
    )
    xla_large = grad_temp_bytes(4096, "xla")
    assert chunked_large < 5 * chunked_small  # linear: 4x the length, ~4x the memory
    assert chunked_large * 16 < xla_large  # and far below the quadratic reference


def test_block_sizes_must_be_positive_ints():
    x = jnp.zeros((1, 8, 2, 4))
    for block_q, block_k in [(0, 4), (4.0, 4), (4, -1)]:
        with pytest.raises(ValueError, match="block sizes must be positive ints"):
            ops.chunked_attention(x, x, x, block_q=block_q, block_k=block_k)
