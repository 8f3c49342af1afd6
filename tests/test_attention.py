"""dot_product_attention and attention_weights: backends, dropout, errors and properties.

Equality with ``ops.reference_attention`` case by case is in test_attention_reference.py.
"""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import ATOL, CASES, build_case, make_qkv, naive
from attention_reference import naive_attention, naive_attention_probs

from flaxformer_lite import ops
from flaxformer_lite.ops import AttentionMask, attention_choice, cudnn_attention
from flaxformer_lite.ops.attention_inputs import AttentionCall, target_platform

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

# jit everywhere: eager JAX compiles every primitive separately, which dominates test time.
attend = jax.jit(
    ops.dot_product_attention,
    static_argnames=("scale", "is_causal", "local_window", "dropout_rate", "implementation"),
)


@pytest.mark.parametrize(
    "case", ["plain", "causal", "mqa", "mask_and_bias", "padding", "window", "window_mostly_ahead"]
)
def test_matches_jax_nn(case):
    q, k, v, inputs, flags = build_case(CASES[case])
    ours = attend(q, k, v, **inputs, **flags, implementation="xla")
    theirs = jax.nn.dot_product_attention(
        q,
        k,
        v,
        inputs["bias"],
        inputs["mask"],
        is_causal=flags.get("is_causal", False),
        local_window_size=flags.get("local_window"),
    )
    real_rows = None
    if inputs["mask"] is not None:  # jax.nn leaves fully masked rows undefined; compare the rest
        real_rows = np.broadcast_to(inputs["mask"], (2, 4, 9, 9)).any(-1)
        real_rows = np.transpose(real_rows, (0, 2, 1))[..., None]
        ours, theirs = np.where(real_rows, ours, 0), np.where(real_rows, theirs, 0)
    np.testing.assert_allclose(ours, theirs, atol=ATOL)


def test_jax_nn_delegation_follows_our_conventions():
    # The cuDNN path goes through jax_nn_attention; on CPU the same code runs with "xla", which
    # checks the argument translation (GQA, scale, mask, bias, zeroed masked rows).
    q, k, v, inputs, _ = build_case(dict(mask=True, bias=True))
    mask = np.array(inputs["mask"])
    mask[0, :, 2, :] = False
    kwargs = dict(scale=0.3, is_causal=True, local_window=(4, 0))
    ours = attend(q, k, v, inputs["bias"], mask, **kwargs, implementation="xla")
    delegate = functools.partial(cudnn_attention.jax_nn_attention, **kwargs, implementation="xla")
    delegated = jax.jit(delegate)(q, k, v, inputs["bias"], mask)
    np.testing.assert_allclose(delegated, ours, atol=ATOL)
    assert np.all(np.asarray(delegated)[0, 2] == 0)


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_bfloat16_computes_in_float32(implementation):
    q, k, v, inputs, flags = build_case(CASES["mask_and_bias"])
    # An ALiBi-sized float32 bias: rounding it to bf16 before the softmax would show.
    inputs["bias"] = 3 * inputs["bias"] + 100
    q, k, v = (np.asarray(x).astype(jnp.bfloat16) for x in (q, k, v))
    out = attend(*map(jnp.asarray, (q, k, v)), **inputs, implementation=implementation)
    assert out.dtype == jnp.bfloat16
    # Against float64 math on the same bf16-rounded inputs: only the output rounding and the
    # bf16 weights·value product may differ.
    expected = naive(*(x.astype(np.float32) for x in (q, k, v)), inputs, flags)
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_fully_masked_rows_are_zero_with_finite_gradients(implementation):
    q, k, v = make_qkv(1)
    mask = np.ones((2, 1, 9, 9), bool)
    mask[:, :, 3] = False
    mask[1] = False
    run = functools.partial(attend, mask=jnp.asarray(mask), implementation=implementation)
    out = np.asarray(run(q, k, v))
    assert np.all(out[:, 3] == 0) and np.all(out[1] == 0) and np.isfinite(out).all()
    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(run(q, k, v) ** 2), argnums=(0, 1, 2)))(
        q, k, v
    )
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert np.all(np.asarray(grads[0])[1] == 0)


def test_scale_argument():
    q, k, v = make_qkv(2)
    out = attend(q, k, v, scale=0.1, implementation="xla")
    np.testing.assert_allclose(out, naive_attention(q, k, v, scale=0.1), atol=ATOL)


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_jit_vmap_grad(implementation):
    q, k, v, inputs, flags = build_case(CASES["causal_window"])
    run = functools.partial(
        ops.dot_product_attention, **inputs, **flags, implementation=implementation
    )
    np.testing.assert_allclose(jax.jit(run)(q, k, v), naive(q, k, v, inputs, flags), atol=ATOL)
    # vmap over an extra leading axis: each slice equals the unbatched call. Doubled inputs make
    # logits four times and values twice as large, and their round-off with them.
    stacked = [jnp.stack([x, 2 * x]) for x in (q, k, v)]
    batched = jax.jit(jax.vmap(run))(*stacked)
    np.testing.assert_allclose(batched[1], naive(2 * q, 2 * k, 2 * v, inputs, flags), atol=8 * ATOL)
    # grad against the float64 formula through finite differences along a random direction (the
    # projection onto it summed in float64, so that only the gradient's round-off remains).
    direction = np.random.default_rng(3).standard_normal(q.shape)
    grad = jax.jit(jax.grad(lambda q: jnp.sum(jnp.sin(run(q, k, v)))))(q)
    analytic = np.vdot(np.asarray(grad, np.float64), direction)
    qd = np.asarray(q, np.float64)

    def ref_loss(q):
        return np.sum(np.sin(naive(q, k, v, inputs, flags)))

    eps = 1e-4
    numeric = (ref_loss(qd + eps * direction) - ref_loss(qd - eps * direction)) / (2 * eps)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-4)


def test_xla_dropout_keeps_one_minus_rate():
    # Uniform weights (q = 0) over ones: the output is the kept fraction / (1 - rate).
    q = jnp.zeros((1, 8, 2, 4), jnp.float32)
    ones = jnp.ones((1, 4096, 2, 4), jnp.float32)
    out = attend(
        q, ones, ones, dropout_rate=0.3, dropout_rng=jax.random.key(0), implementation="xla"
    )
    kept_fraction = np.asarray(out) * (1 - 0.3)
    np.testing.assert_allclose(kept_fraction.mean(), 0.7, atol=0.01)


def test_xla_dropout_is_unbiased_and_reproducible():
    q, k, v = make_qkv(4, b=1, tq=4, tk=64, hq=2, hk=2)
    run = functools.partial(attend, dropout_rate=0.3, implementation="xla")
    rng = jax.random.key(5)
    first = run(q, k, v, dropout_rng=rng)
    np.testing.assert_array_equal(first, run(q, k, v, dropout_rng=rng))
    assert not np.allclose(first, run(q, k, v, dropout_rng=jax.random.key(6)))
    sample = jax.jit(jax.vmap(lambda r: run(q, k, v, dropout_rng=r)))
    samples = sample(jax.random.split(rng, 4000))
    no_dropout = attend(q, k, v, implementation="xla")
    np.testing.assert_allclose(samples.mean(0), no_dropout, atol=0.03)


def test_attention_weights():
    q, k, _, inputs, flags = build_case(CASES["causal_window"])
    weights = jax.jit(functools.partial(ops.attention_weights, **flags))(q, k, **inputs)
    assert weights.shape == (2, 4, 9, 9) and weights.dtype == jnp.float32
    expected = naive_attention_probs(
        q, k, inputs["bias"], inputs["mask"], causal=True, window=(3, 0)
    )
    np.testing.assert_allclose(weights, expected, atol=ATOL)
    row_sums = np.asarray(weights.sum(-1))
    assert np.all((np.abs(row_sums - 1) < 1e-5) | (row_sums == 0))


@pytest.mark.parametrize(
    "shapes, kwargs, message",
    [
        (((2, 4, 8), (2, 4, 2, 8), (2, 4, 2, 8)), {}, "query must be"),
        (((2, 0, 4, 8), (2, 4, 2, 8), (2, 4, 2, 8)), {}, "at least one position"),
        (((2, 4, 4, 8), (2, 4, 2, 6), (2, 4, 2, 6)), {}, "head_dim differ"),
        (((2, 4, 4, 8), (2, 4, 3, 8), (2, 4, 3, 8)), {}, "multiple of key/value heads"),
        (((2, 4, 4, 8), (2, 5, 2, 8), (2, 4, 2, 8)), {}, "key and value must agree"),
        (((2, 4, 4, 8), (3, 4, 2, 8), (3, 4, 2, 8)), {}, "batch sizes differ"),
        (
            ((2, 4, 4, 8), (2, 5, 2, 8), (2, 5, 2, 8)),
            {"mask": np.ones((2, 1, 4, 4), bool)},
            r"mask of shape \(2, 1, 4, 4\)",
        ),
        (
            ((2, 4, 4, 8), (2, 5, 2, 8), (2, 5, 2, 8)),
            {"bias": np.zeros((3, 4, 5))},
            r"bias of shape \(3, 4, 5\)",
        ),
        (((2, 4, 4, 8), (2, 4, 2, 8), (2, 4, 2, 8)), {"mask": np.ones((4, 4))}, "must be boolean"),
        (((2, 4, 4, 8), (2, 4, 2, 8), (2, 4, 2, 8)), {"dropout_rate": 0.1}, "needs a dropout_rng"),
        (
            ((2, 4, 4, 8), (2, 4, 2, 8), (2, 4, 2, 8)),
            {"dropout_rate": 0.1, "dropout_rng": np.zeros((3, 2), np.uint32)},
            "one PRNG key",
        ),
        (((2, 4, 4, 8), (2, 4, 2, 8), (2, 4, 2, 8)), {"dropout_rate": 1.0}, "dropout_rate"),
        (((2, 4, 4, 0), (2, 4, 2, 0), (2, 4, 2, 8)), {}, "at least one position"),
        (((2, 4, 4, 8), (2, 4, 2, 8), (2, 4, 2, 8)), {"local_window": (2, -1)}, "local_window"),
        (
            ((2, 4, 4, 8), (2, 4, 2, 8), (2, 4, 2, 8)),
            {"implementation": "flash"},
            "implementation must be",
        ),
    ],
)
@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_bad_inputs_raise_value_error_naming_shapes(shapes, kwargs, message, implementation):
    q, k, v = (jnp.asarray(np.zeros(s, np.float32)) for s in shapes)
    kwargs = {"implementation": implementation, **kwargs}
    with pytest.raises(ValueError, match=message):
        ops.dot_product_attention(q, k, v, **kwargs)


def test_integer_inputs_and_traced_dropout_rate_are_rejected():
    q = jnp.zeros((1, 4, 2, 8), jnp.int32)
    with pytest.raises(ValueError, match="floating-point"):
        ops.dot_product_attention(q, q, q)
    x = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match="Python float"):
        jax.jit(lambda rate: ops.dot_product_attention(x, x, x, dropout_rate=rate))(0.1)


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_gradient_with_respect_to_a_learned_scale(implementation):
    q, k, v = make_qkv(12)

    def loss(scale, implementation):
        out = ops.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, implementation=implementation
        )
        return jnp.sum(jnp.sin(out))

    grad = jax.jit(jax.grad(loss), static_argnums=1)(0.4, implementation)

    def naive_loss(scale):
        return np.sum(np.sin(naive_attention(q, k, v, scale=scale, causal=True)))

    # float64 central differences (error ~eps² ≈ 1e-8): float32 ones would carry the round-off
    # of a 576-term loss divided by 2 * eps.
    eps = 1e-4
    numeric = (naive_loss(0.4 + eps) - naive_loss(0.4 - eps)) / (2 * eps)
    np.testing.assert_allclose(grad, numeric, rtol=1e-4)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the non-GPU behaviour")
def test_cudnn_off_gpu_is_a_clear_error_and_never_chosen():
    q, k, v = make_qkv(0, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="needs a GPU"):
        attend(q, k, v, implementation="cudnn")
    assert choose(q, k, v, AttentionMask(is_causal=True)) == "xla"


def choose(query, key, value, mask):
    """The implementation the automatic choice picks for these inputs (arrays or shapes)."""
    call = AttentionCall(query, key, value, None, mask, target_platform())
    return attention_choice.choose(call).backend


def gpu_shapes(tq=8, tk=8, d=64, dtype=jnp.bfloat16, dv=None):
    return (
        jax.ShapeDtypeStruct((2, tq, 4, d), dtype),
        jax.ShapeDtypeStruct((2, tk, 2, d), dtype),
        jax.ShapeDtypeStruct((2, tk, 2, dv or d), dtype),
    )


@pytest.mark.parametrize(
    "shapes, extra, reason",
    [
        (gpu_shapes(), {}, ""),
        (gpu_shapes(), {"is_causal": True, "local_window": (3, 0)}, ""),
        (gpu_shapes(dtype=jnp.float32), {}, "bfloat16 or float16"),
        (gpu_shapes(d=160), {}, "head dims"),
        (gpu_shapes(dv=32), {}, "head dims"),
        (gpu_shapes(), {"dropout_rate": 0.1}, "dropout"),
        (gpu_shapes(tq=1, tk=8), {"is_causal": True}, "align differently"),
        (gpu_shapes(), {"local_window": (2, 2)}, "right window"),
        (gpu_shapes(tq=7, tk=7), {"mask": True}, "even lengths"),
    ],
)
def test_cudnn_eligibility_rules(shapes, extra, reason):
    # The rules the automatic choice applies on a GPU, checked without one.
    extra = {"is_causal": False, "local_window": None, "dropout_rate": 0.0, **extra}
    explicit = jnp.ones((1, 1, 1, shapes[1].shape[1]), bool) if extra.pop("mask", False) else None
    rate = extra.pop("dropout_rate")
    mask = AttentionMask(**extra, explicit=explicit)
    call = AttentionCall(*shapes, None, mask, "gpu", dropout_rate=rate)
    found = cudnn_attention.cudnn_unsupported_reason(call)
    assert (reason in found and found) if reason else found is None


def test_automatic_choice_by_size(caplog):
    def shapes(t):
        return (jax.ShapeDtypeStruct((1, t, 8, 64), jnp.float32),) * 3

    causal = AttentionMask(is_causal=True)
    with caplog.at_level(logging.DEBUG, logger="flaxformer_lite.ops.attention"):
        assert choose(*shapes(1024), causal) == "xla"
        assert choose(*shapes(8192), causal) == "chunked"
    assert "chunked" in caplog.text and "xla" in caplog.text


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_causality_future_keys_change_nothing(implementation):
    q, k, v = make_qkv(5, tq=12, tk=12)
    rng = np.random.default_rng(6)
    k2 = k.at[:, 7:].set(jnp.asarray(rng.standard_normal(k[:, 7:].shape), jnp.float32))
    v2 = v.at[:, 7:].set(jnp.asarray(rng.standard_normal(v[:, 7:].shape), jnp.float32))
    before = attend(q, k, v, is_causal=True, implementation=implementation)
    after = attend(q, k2, v2, is_causal=True, implementation=implementation)
    np.testing.assert_array_equal(before[:, :7], after[:, :7])
    assert not np.allclose(before[:, 7:], after[:, 7:])


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_permuting_keys_changes_nothing_and_queries_permute_outputs(implementation):
    q, k, v = make_qkv(7, tq=6, tk=10)
    key_order = np.random.default_rng(8).permutation(10)
    query_order = np.random.default_rng(9).permutation(6)
    out = attend(q, k, v, implementation=implementation)
    permuted_keys = attend(q, k[:, key_order], v[:, key_order], implementation=implementation)
    permuted_queries = attend(q[:, query_order], k, v, implementation=implementation)
    np.testing.assert_allclose(permuted_keys, out, atol=ATOL)  # summed in another order
    np.testing.assert_allclose(permuted_queries, out[:, query_order], atol=ATOL)


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_packed_sequences_equal_separate_sequences(implementation):
    # Two sequences of lengths 5 and 7 packed into one row of 12 with segment ids.
    q, k, v = make_qkv(10, b=1, tq=12, tk=12)
    segment_ids = jnp.asarray([[1] * 5 + [2] * 7])
    packed = attend(
        q, k, v, mask=ops.segment_mask(segment_ids), is_causal=True, implementation=implementation
    )
    first = attend(q[:, :5], k[:, :5], v[:, :5], is_causal=True, implementation=implementation)
    second = attend(q[:, 5:], k[:, 5:], v[:, 5:], is_causal=True, implementation=implementation)
    np.testing.assert_allclose(packed, jnp.concatenate([first, second], axis=1), atol=ATOL)


@pytest.mark.parametrize("implementation", ["xla", "chunked", None])
def test_segment_ids_equal_their_mask_beside_a_key_padding_mask(implementation):
    # "xla", "chunked" (and "cudnn") fold the ids into the mask; the models pass ids.
    q, k, v = make_qkv(11, tq=6, tk=6, hq=4, hk=2)
    ids = jnp.asarray([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]])
    valid = jnp.asarray([[True] * 6, [True] * 5 + [False]])[:, None, None, :]
    by_ids = attend(
        q, k, v, mask=valid, is_causal=True, segment_ids=(ids, ids), implementation=implementation
    )
    mask = ops.combine_masks(valid, ops.segment_mask(ids))
    by_mask = attend(q, k, v, mask=mask, is_causal=True, implementation=implementation)
    np.testing.assert_allclose(by_ids, by_mask, atol=ATOL, rtol=0)


def test_an_attention_mask_at_a_cache_offset_equals_its_explicit_mask():
    # A KV cache's write index (traced under jit) as the query offset: the same attention as
    # the causal and window masks written out at the cache positions.
    q, k, v = make_qkv(7, tq=3, tk=9)
    offset, window = jnp.int32(4), (2, 0)
    pieces = AttentionMask(
        is_causal=True, local_window=window, global_tokens=1, query_offset=offset
    )
    explicit = ops.combine_masks(
        ops.causal_mask(3, 9, offset),
        ops.local_window_mask(3, 9, window, offset) | ops.global_tokens_mask(3, 9, 1, offset),
    )
    for implementation in ("xla", "chunked"):
        got = jax.jit(functools.partial(ops.dot_product_attention, implementation=implementation))(
            q, k, v, mask=pieces
        )
        np.testing.assert_allclose(got, ops.reference_attention(q, k, v, mask=explicit), atol=ATOL)
    with pytest.raises(ValueError, match="not beside it"):
        ops.dot_product_attention(q, k, v, mask=pieces, is_causal=True)


def test_the_choices_of_a_trace_are_recorded_with_the_reasons_passed_over():
    q, k, v = make_qkv(0)
    with attention_choice.recorded_choices() as choices:
        jax.jit(functools.partial(ops.dot_product_attention, implementation="pallas")).lower(
            q, k, v
        )
        jax.jit(ops.dot_product_attention).lower(q, k, v)
    assert [(c.requested, c.backend) for c in choices] == [("pallas", "xla"), (None, "xla")]
    assert ("pallas", f"needs a TPU or GPU, the platform is {target_platform()!r}") in choices[
        0
    ].passed_over
    assert [name for name, _ in choices[1].passed_over] == ["cudnn", "pallas", "chunked"]
