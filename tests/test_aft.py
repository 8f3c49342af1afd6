"""``ops.aft`` against a float64 NumPy transcription of the AFT formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import ops
from flaxformer_lite.ops import attention_free

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


def numpy_aft(q, k, v, w=None, *, is_causal=False, local_window=None, mask=None, segment_ids=None):
    """``Y_t = sigmoid(Q_t) * sum_t' exp(K_t' + w_tt') V_t' / sum_t' exp(K_t' + w_tt')``,
    term by term in float64 (each exponent shifted by its own row maximum)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, length, _ = q.shape
    w = np.zeros((length, length)) if w is None else np.asarray(w, np.float64)
    w = np.broadcast_to(w, (batch, length, length))
    if local_window is not None:
        t, s = np.indices((length, length))
        w = np.where(np.abs(t - s) < local_window, w, 0.0)
    out = np.zeros_like(q)
    for b in range(batch):
        for t in range(length):
            keys = [
                s
                for s in range(length)
                if (not is_causal or s <= t)
                and (mask is None or mask[b, s])
                and (segment_ids is None or segment_ids[b, s] == segment_ids[b, t])
            ]
            if not keys:
                continue
            logits = k[b, keys] + w[b, t, keys][:, None]  # [S', D]
            e = np.exp(logits - logits.max(axis=0))
            out[b, t] = (e * v[b, keys]).sum(0) / e.sum(0)
    return 1 / (1 + np.exp(-q)) * out


def inputs(seed=0, batch=2, length=7, features=5, key_scale=1.0, key_shift=0.0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(batch, length, features)).astype(np.float32) for _ in range(3))
    w = rng.normal(size=(length, length)).astype(np.float32)
    return q, (k * key_scale + key_shift).astype(np.float32), v, w


VARIANTS = [
    dict(),
    dict(is_causal=True),
    dict(bias=True),
    dict(bias=True, is_causal=True),
    dict(bias=True, local_window=2),
    dict(bias=True, local_window=3, is_causal=True),
]


def call(fn, q, k, v, w, variant, **inputs):
    kwargs = {k: x for k, x in variant.items() if k != "bias"}
    return fn(q, k, v, w if variant.get("bias") else None, **inputs, **kwargs)


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_aft_matches_the_float64_formula(variant):
    q, k, v, w = inputs()
    got = call(ops.aft, *map(jnp.asarray, (q, k, v, w)), variant)
    np.testing.assert_allclose(got, call(numpy_aft, q, k, v, w, variant), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_aft_drops_masked_keys(variant):
    q, k, v, w = inputs(seed=1)
    mask = np.ones(q.shape[:2], bool)
    mask[0, 4:] = False
    mask[1, :2] = False  # the first causal rows of row 1 see no key: zeros
    got = call(ops.aft, *map(jnp.asarray, (q, k, v, w)), variant, mask=jnp.asarray(mask))
    want = call(numpy_aft, q, k, v, w, variant, mask=mask)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_aft_keeps_packed_segments_apart(variant):
    q, k, v, w = inputs(seed=8, length=9)
    segments = np.array([[1, 1, 1, 2, 2, 3, 3, 3, 3], [1, 1, 1, 1, 1, 1, 2, 2, 0]])
    rows_bias = np.stack([w, w.T])  # one bias per row, as packed rows' positions give
    args = (q, k, v, rows_bias)
    got = call(ops.aft, *map(jnp.asarray, args), variant, segment_ids=jnp.asarray(segments))
    want = call(numpy_aft, *args, variant, segment_ids=segments)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("key_scale", [3.0, 80.0])
@pytest.mark.parametrize("length", [7, 37], ids=["one_block", "three_blocks"])
@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_aft_is_stable_for_large_keys(variant, length, key_scale):
    # exp(80) overflows float32's range of sums; the maxima subtracted keep it finite. With
    # keys spread by 80 sigma, causal rows see keys far below the sequence's maximum.
    q, k, v, w = inputs(seed=2, length=length, key_scale=key_scale, key_shift=80.0)
    got = call(ops.aft, *map(jnp.asarray, (q, k, v, w)), variant)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(got, call(numpy_aft, q, k, v, w, variant), atol=2e-6, rtol=2e-5)


def test_causal_aft_simple_keeps_a_running_maximum():
    # Early keys far below later ones (a spread of ~400): a global maximum would underflow.
    q, k, v, _ = inputs(seed=3, length=6)
    k = k + np.linspace(-200, 200, 6, dtype=np.float32)[None, :, None]
    got = ops.aft(*map(jnp.asarray, (q, k, v)), is_causal=True)
    np.testing.assert_allclose(got, numpy_aft(q, k, v, is_causal=True), atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_aft_gradients_match_float64(variant):
    q, k, v, w = (jnp.asarray(x) for x in inputs(seed=4, length=5, features=3))
    mask = jnp.asarray(np.arange(5)[None, :] < np.array([[5], [3]]))
    probe = jnp.asarray(np.random.default_rng(5).normal(size=q.shape), jnp.float32)

    def loss(q, k, v, w):
        return jnp.sum(call(ops.aft, q, k, v, w, variant, mask=mask) * probe)

    got = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, w)
    with jax.enable_x64():
        args64 = [jnp.asarray(x, jnp.float64) for x in (q, k, v, w)]

        def loss64(q, k, v, w):
            logits = k[:, None, :, :] + (w if variant.get("bias") else 0 * w)[None, :, :, None]
            if variant.get("local_window"):
                t, s = jnp.indices(w.shape)
                near = (jnp.abs(t - s) < variant["local_window"])[None, :, :, None]
                logits = jnp.where(near, logits, k[:, None, :, :])
            keep = mask[:, None, :, None]
            if variant.get("is_causal"):
                keep = keep & jnp.tril(jnp.ones(w.shape, bool))[None, :, :, None]
            weights = jax.nn.softmax(jnp.where(keep, logits, -jnp.inf), axis=2)
            out = jax.nn.sigmoid(q) * jnp.einsum("btsd,bsd->btd", weights, v)
            return jnp.sum(out * probe.astype(jnp.float64))

        want = jax.grad(loss64, argnums=(0, 1, 2, 3))(*args64)
        want = [np.asarray(x) for x in want]
    for g, x in zip(got, want, strict=True):
        np.testing.assert_allclose(g, x, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_aft_takes_bfloat16(variant):
    q, k, v, w = inputs(seed=6)
    got = call(ops.aft, *(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, w)), variant)
    assert got.dtype == jnp.bfloat16
    rounded = [np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32) for x in (q, k, v, w)]
    want = call(numpy_aft, *rounded, variant)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_causal_aft_simple_chunks_across_segments_and_padding(chunk):
    # Segments and dropped keys across chunk borders, a length no multiple of the chunk.
    q, k, v, _ = inputs(seed=9, length=11)
    k = k + np.linspace(-150, 150, 11, dtype=np.float32)[None, :, None]
    segments = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3], [4, 4, 4, 4, 4, 4, 4, 4, 4, 5, 5]])
    mask = np.ones((2, 11), bool)
    mask[0, [0, 3, 4]] = False
    mask[1, 8:] = False
    state = attention_free.initial_aft_state(2, 5)
    got, _ = attention_free.aft_simple_step(
        state, *map(jnp.asarray, (q, k, v, mask, segments)), chunk=chunk
    )
    want = numpy_aft(q, k, v, is_causal=True, mask=mask, segment_ids=segments)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-5)


def test_aft_simple_step_continues_the_causal_sum():
    q, k, v, _ = inputs(seed=7, length=8)
    mask = jnp.asarray(np.arange(8)[None, :] >= np.array([[0], [2]]))  # row 1 left-padded
    full = ops.aft(*map(jnp.asarray, (q, k, v)), is_causal=True, mask=mask)
    batch, _, features = q.shape
    state = attention_free.initial_aft_state(batch, features)
    outs = []
    for start, stop in [(0, 3), (3, 4), (4, 5), (5, 8)]:
        piece = slice(start, stop)
        out, state = attention_free.aft_simple_step(
            state, q[:, piece], k[:, piece], v[:, piece], mask[:, piece]
        )
        outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(local_window=2), "local_window needs a pairwise_bias"),
        (dict(pairwise_bias=jnp.zeros((3, 3))), "pairwise_bias"),
        (dict(mask=jnp.ones((2, 3), bool)), "mask"),
    ],
)
def test_aft_refuses_bad_arguments(kwargs, message):
    x = jnp.zeros((2, 7, 5))
    with pytest.raises(ValueError, match=message):
        ops.aft(x, x, x, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("is_causal", [False, True], ids=["bidirectional", "causal"])
def test_aft_simple_memory_grows_linearly_with_length(is_causal):
    # XLA's compiled temporary memory, forward and backward: 4x the length takes at most ~4x
    # the memory (a [T, T] matrix would take 16x).
    def temp_bytes(length):
        x = jax.ShapeDtypeStruct((1, length, 16), jnp.float32)

        def loss(q, k, v):
            return ops.aft(q, k, v, is_causal=is_causal).sum()

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return grad.lower(x, x, x).compile().memory_analysis().temp_size_in_bytes

    short, long = temp_bytes(256), temp_bytes(1024)
    assert long <= 4.5 * max(short, 1) and long < 4 * 1024**2, (short, long)


@pytest.mark.parametrize("offset", [0, 5])
def test_cached_causal_aft_equals_the_formula_at_any_offset(offset):
    # New positions [offset, offset + 6) against a cache of 16 slots; slots after them hold
    # stale keys (dropped by causality), keys spread by 80 sigma, a dropped key in the middle.
    q, k, v, w = inputs(seed=10, length=16, key_scale=80.0, key_shift=80.0)
    mask = np.ones((2, 16), bool)
    mask[1, 3] = False
    new = slice(offset, offset + 6)
    got = attention_free.cached_causal_aft(
        jnp.asarray(q[:, new]),
        jnp.asarray(k),
        jnp.asarray(v),
        jnp.asarray(np.broadcast_to(w[new], (2, 6, 16))),
        offset=jnp.asarray(offset),
        key_mask=jnp.asarray(mask),
    )
    want = numpy_aft(q, k, v, w, is_causal=True, mask=mask)[:, new]
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=2e-5)
