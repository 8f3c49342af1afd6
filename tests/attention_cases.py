"""Inputs and tolerances shared by the attention tests.

The tolerances hold for float32 in any summation order (AVX2 and AVX-512 machines sum in
different orders): the round-off of Dh-term logits and S-term outputs of values up to ~4 is
~1e-6 here, a tenth of them, while a wrong mask, scale or head grouping moves outputs by 1e-2.
"""

import re

import jax.numpy as jnp
import numpy as np
from attention_reference import naive_attention

ATOL = 1e-5  # attention outputs and weights, float32 against any reference
# Gradients, relative to their largest element (see assert_close_to_scale): the backward sums run
# over T, S and Dh terms larger than their results, ~2e-6 of the largest gradient here.
GRAD_REL = 2e-5
# bfloat16 gradients against float32 ones, relative to the largest: bfloat16's 8-bit significand
# puts them within 0.8% (measured, xla and chunked); 2% still fails a 3% error in every element.
BF16_GRAD_REL = 0.02


def assert_close_to_scale(actual, expected, rel=GRAD_REL):
    """``|actual - expected| <= rel * max|expected|`` everywhere.

    The round-off of a float32 sum scales with its largest terms, not with the sum, which may
    cancel to near 0: a relative tolerance per element would fail there on some machine.
    """
    expected = np.asarray(expected, np.float64)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=rel * np.abs(expected).max())


def dense_bool_shapes(text, rows, cols):
    """The bool buffers of a lowered or compiled program's text whose last axes are [rows, cols]."""
    stablehlo = re.findall(rf"tensor<(?:\d+x)*{rows}x{cols}xi1>", text)
    hlo = re.findall(rf"pred\[(?:\d+,)*{rows},{cols}\]", text)
    return stablehlo + hlo


def make_qkv(seed, b=2, tq=9, tk=9, hq=4, hk=2, d=8, dv=None, dtype=np.float32):
    """NumPy-drawn query ``[B, T, H, Dh]``, key ``[B, S, Hk, Dh]`` and value ``[B, S, Hk, Dv]``."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, tq, hq, d)).astype(dtype)
    k = rng.standard_normal((b, tk, hk, d)).astype(dtype)
    v = rng.standard_normal((b, tk, hk, dv or d)).astype(dtype)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)


def random_mask(seed, shape, p=0.7):
    return jnp.asarray(np.random.default_rng(seed).random(shape) < p)


CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "gqa_causal_short_query": dict(tq=4, tk=11, is_causal=True),
    "long_query_causal": dict(tq=11, tk=6, is_causal=True),
    "long_query_unmasked": dict(tq=11, tk=6),  # cross-attention to a shorter source
    "mqa": dict(hk=1),
    "mask_and_bias": dict(mask=True, bias=True),
    "padding": dict(padding=True, is_causal=True),
    "fully_masked_rows": dict(empty_rows=True, bias=True),
    "window": dict(local_window=(2, 1)),
    "causal_window": dict(is_causal=True, local_window=(3, 0), mask=True),
    "value_dim_differs": dict(dv=5, bias=True),
    "causal_window_looking_ahead": dict(is_causal=True, local_window=(2, 3)),
    "window_mostly_ahead": dict(local_window=(1, 3)),
    "window_short_query": dict(tq=5, tk=9, local_window=(2, 1), bias=True),
}


def build_case(case, seed=0):
    """``(q, k, v, inputs, flags)``: ``inputs`` holds ``bias`` and ``mask``, ``flags`` the
    keyword arguments (``is_causal``, ``local_window``) left in ``case``."""
    case = dict(case)
    shape_args = {k: case.pop(k) for k in ("tq", "tk", "hk", "dv") if k in case}
    q, k, v = make_qkv(seed, **shape_args)
    b, tq, hq, _ = q.shape
    tk = k.shape[1]
    inputs = dict(bias=None, mask=None)
    if case.pop("bias", False):
        inputs["bias"] = jnp.asarray(np.random.default_rng(seed + 7).standard_normal((hq, tq, tk)))
    if case.pop("mask", False):
        inputs["mask"] = random_mask(seed + 8, (b, hq, tq, tk))
    if case.pop("padding", False):
        q_valid = np.arange(tq) < np.array([[tq], [tq - 3]])
        kv_valid = np.arange(tk) < np.array([[tk - 2], [tk]])
        inputs["mask"] = jnp.asarray(q_valid[:, None, :, None] & kv_valid[:, None, None, :])
    if case.pop("empty_rows", False):  # query 3 of every head sees nothing, nor does batch row 1
        mask = np.array(random_mask(seed + 8, (b, hq, tq, tk)))
        mask[:, :, 3] = False
        mask[1] = False
        inputs["mask"] = jnp.asarray(mask)
    return q, k, v, inputs, case


def naive(q, k, v, inputs, flags):
    """The float64 NumPy formula of ``attention_reference`` for a case built by ``build_case``."""
    return naive_attention(
        q,
        k,
        v,
        inputs["bias"],
        inputs["mask"],
        causal=flags.get("is_causal", False),
        window=flags.get("local_window"),
    )
