"""ops.reference_attention against the float64 NumPy formula, and every implementation of
dot_product_attention (above all "xla", its optimisation) against ops.reference_attention."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import ATOL, CASES, assert_close_to_scale, build_case, make_qkv, naive

from flaxformer_lite import ops
from flaxformer_lite.ops import xla_attention as xla_module

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

reference = jax.jit(ops.reference_attention, static_argnames=("scale", "is_causal", "local_window"))


def loss_and_grads(attend, q, k, v, bias, mask):
    """The output, and the gradients of a scalar loss w.r.t. q, k, v (and bias), jitted."""

    def loss(q, k, v, bias):
        out = attend(q, k, v, bias, mask)
        return jnp.sum(jnp.sin(out) * jnp.arange(1, v.shape[-1] + 1)), out

    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(q, k, v, bias)
    return out, grads


# ---------------------------------------------------------------- the reference itself


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_reference_matches_naive_formula(case):
    q, k, v, inputs, flags = build_case(case)
    out = reference(q, k, v, **inputs, **flags)
    assert out.shape == q.shape[:3] + v.shape[-1:] and out.dtype == q.dtype
    np.testing.assert_allclose(out, naive(q, k, v, inputs, flags), atol=ATOL)


@pytest.mark.parametrize("case", ["causal_window", "padding", "value_dim_differs"])
def test_reference_gradients_match_naive_finite_differences(case):
    q, k, v, inputs, flags = build_case(CASES[case])
    direction = [
        np.random.default_rng(seed).standard_normal(x.shape) for seed, x in enumerate((q, k, v))
    ]
    grads = jax.jit(
        jax.grad(lambda *qkv: jnp.sum(jnp.sin(reference(*qkv, **inputs, **flags))), (0, 1, 2))
    )(q, k, v)
    analytic = sum(
        np.vdot(np.asarray(g, np.float64), d) for g, d in zip(grads, direction, strict=True)
    )
    qkv = [np.asarray(x, np.float64) for x in (q, k, v)]

    def naive_loss(step):
        moved = [x + step * d for x, d in zip(qkv, direction, strict=True)]
        return np.sum(np.sin(naive(*moved, inputs, flags)))

    eps = 1e-4  # float64 central differences: error ~eps² ≈ 1e-8
    numeric = (naive_loss(eps) - naive_loss(-eps)) / (2 * eps)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-4)


def test_reference_fully_masked_rows_are_zero_with_zero_gradients():
    q, k, v, inputs, flags = build_case(CASES["fully_masked_rows"])
    out = np.asarray(reference(q, k, v, **inputs, **flags))
    assert np.all(out[:, 3] == 0) and np.all(out[1] == 0)
    dq = jax.jit(jax.grad(lambda q: jnp.sum(jnp.sin(reference(q, k, v, **inputs)))))(q)
    assert np.isfinite(dq).all() and np.all(np.asarray(dq)[1] == 0)


def test_reference_checks_its_inputs():
    x = jnp.zeros((2, 4, 3, 8))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        ops.reference_attention(x, jnp.zeros((2, 4, 2, 8)), jnp.zeros((2, 4, 2, 8)))


# ---------------------------------------------------------------- implementations against it


@pytest.mark.parametrize("implementation", ["xla", "chunked", None])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_implementations_equal_reference(case, implementation):
    q, k, v, inputs, flags = build_case(case)
    attend = jax.jit(
        functools.partial(ops.dot_product_attention, **flags, implementation=implementation)
    )
    out = attend(q, k, v, **inputs)
    assert out.shape == q.shape[:3] + v.shape[-1:] and out.dtype == q.dtype
    np.testing.assert_allclose(out, reference(q, k, v, **inputs, **flags), atol=ATOL)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_xla_gradients_equal_reference(case):
    q, k, v, inputs, flags = build_case(case)
    xla = functools.partial(ops.dot_product_attention, **flags, implementation="xla")
    plain = functools.partial(ops.reference_attention, **flags)
    out, grads = loss_and_grads(xla, q, k, v, inputs["bias"], inputs["mask"])
    expected_out, expected_grads = loss_and_grads(plain, q, k, v, inputs["bias"], inputs["mask"])
    np.testing.assert_allclose(out, expected_out, atol=ATOL)
    for got, expected in zip(grads, expected_grads, strict=True):
        assert got.shape == expected.shape
        assert_close_to_scale(got, expected)


# ---------------------------------------------------------------- "xla"'s query blocks


@pytest.mark.parametrize(
    "q_len, kv_len, is_causal, window",
    [
        (13, 13, True, None),
        (13, 13, False, (2, 1)),
        (13, 13, True, (3, 5)),
        (5, 13, True, None),  # decoding a chunk against a longer cache
        (13, 6, True, None),  # more queries than keys: the first blocks see none
        (13, 13, False, None),
        (4, 13, True, None),  # at most one block of queries
    ],
)
@pytest.mark.parametrize("max_blocks", [8, 2])  # 2: fewer, larger blocks than QUERY_BLOCK_ROWS
@pytest.mark.parametrize("global_tokens", [0, 3])
def test_query_blocks_hold_every_visible_key(
    monkeypatch, q_len, kv_len, is_causal, window, max_blocks, global_tokens
):
    monkeypatch.setattr(xla_module, "QUERY_BLOCK_ROWS", 4)
    monkeypatch.setattr(xla_module, "MAX_QUERY_BLOCKS", max_blocks)
    blocks = xla_module._query_blocks(q_len, kv_len, is_causal, window, global_tokens)
    position = np.arange(q_len)[:, None] + kv_len - q_len  # of each query; keys are at 0..
    key = np.arange(kv_len)[None, :]
    visible = np.ones((q_len, kv_len), bool)
    if window is not None:
        visible &= (key >= position - window[0]) & (key <= position + window[1])
        visible |= (key < global_tokens) | (position < global_tokens)
    if is_causal:
        visible &= key <= position
    rows = [q for (q0, q1), _ in blocks for q in range(q0, q1)]
    assert rows == list(range(q_len))  # the blocks tile the queries in order
    inside = np.zeros_like(visible)
    for (q0, q1), key_ranges in blocks:
        assert all(0 <= k0 < k1 <= kv_len for k0, k1 in key_ranges)
        assert all(a[1] < b[0] for a, b in itertools.pairwise(key_ranges))  # disjoint, ordered
        for k0, k1 in key_ranges:
            inside[q0:q1, k0:k1] = True
    assert not (visible & ~inside).any()  # no visible key falls outside its block's ranges
    if (is_causal or window) and q_len > 4:
        assert inside.sum() < inside.size  # and the hidden keys are skipped


def test_default_query_blocks_skip_a_quarter_of_causal_logits_at_256():
    blocks = xla_module._query_blocks(256, 256, True, None)
    assert blocks == [((0, 128), ((0, 128),)), ((128, 256), ((0, 256),))]
    assert len(xla_module._query_blocks(8192, 8192, True, None)) == 8  # larger blocks


@pytest.mark.parametrize("max_blocks", [8, 2])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_query_blocks_equal_reference(monkeypatch, case, max_blocks):
    monkeypatch.setattr(xla_module, "QUERY_BLOCK_ROWS", 4)
    monkeypatch.setattr(xla_module, "MAX_QUERY_BLOCKS", max_blocks)
    q, k, v, inputs, flags = build_case(case)
    out = jax.jit(functools.partial(ops.dot_product_attention, **flags, implementation="xla"))(
        q, k, v, **inputs
    )
    np.testing.assert_allclose(out, reference(q, k, v, **inputs, **flags), atol=ATOL)


def test_query_blocks_keep_gradients_and_dropout(monkeypatch):
    q, k, v, inputs, flags = build_case(CASES["causal_window"] | dict(tq=13, tk=13))
    run = functools.partial(
        ops.dot_product_attention,
        **inputs,
        **flags,
        dropout_rate=0.2,
        dropout_rng=jax.random.key(1),
        implementation="xla",
    )

    def grads():
        return jax.jit(jax.grad(lambda *qkv: jnp.sum(jnp.sin(run(*qkv))), argnums=(0, 1, 2)))(
            q, k, v
        )

    whole = grads()
    monkeypatch.setattr(xla_module, "QUERY_BLOCK_ROWS", 4)
    blocked = grads()
    for a, b in zip(whole, blocked, strict=True):
        assert_close_to_scale(b, a)


def test_query_blocks_at_the_default_size_equal_reference():
    # 300 causal queries: blocks of QUERY_BLOCK_ROWS = 128 rows and a tail of 44.
    q, k, v = make_qkv(11, b=1, tq=300, tk=300, hq=2, hk=1)
    out = jax.jit(
        functools.partial(ops.dot_product_attention, is_causal=True, implementation="xla")
    )(q, k, v)
    np.testing.assert_allclose(out, reference(q, k, v, is_causal=True), atol=ATOL)
