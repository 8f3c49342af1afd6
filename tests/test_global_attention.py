"""Global + local sparse attention (Longformer/BigBird): ``dot_product_attention(local_window=,
global_tokens=)`` in "xla" and "chunked" equals attention under the explicit mask, values and
gradients, against a float64 NumPy reference that builds that mask pair by pair."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import ATOL, assert_close_to_scale, make_qkv

from flaxformer_lite import ops
from flaxformer_lite.ops import AttentionMask, attention_choice
from flaxformer_lite.ops.attention_inputs import AttentionCall
from flaxformer_lite.ops.chunked import _Geometry
from flaxformer_lite.ops.cudnn_attention import cudnn_unsupported_reason

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


def reference_mask(tq, tk, window, global_tokens, causal):
    """bool ``[T, S]``, pair by pair: query ``i`` at position ``i + S - T`` sees key ``j`` in its
    window, or if either is among the first ``global_tokens`` positions; never a later key
    when ``causal``."""
    left, right = window
    mask = np.zeros((tq, tk), bool)
    for i in range(tq):
        position = i + tk - tq
        for j in range(tk):
            in_window = position - left <= j <= position + right
            is_global = j < global_tokens or position < global_tokens
            mask[i, j] = (in_window or is_global) and (not causal or j <= position)
    return mask


def reference_attention64(q, k, v, mask):
    """float64 softmax attention ``[B, T, H, Dv]`` under a ``[T, S]`` mask; empty rows are 0."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    logits = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    logits = np.where(mask, logits, -np.inf)
    row_max = np.max(logits, axis=-1, keepdims=True)
    weights = np.exp(logits - np.where(np.isfinite(row_max), row_max, 0.0))
    sums = weights.sum(-1, keepdims=True)
    weights = weights / np.where(sums > 0, sums, 1.0)
    return np.einsum("bhts,bshd->bthd", weights, v)


# name: (T, S, window, G, causal, chunked blocks). T > 128 runs "xla" in query blocks.
CASES = {
    "causal": (12, 12, (2, 0), 3, True, (4, 4)),
    "bidirectional": (12, 12, (2, 1), 2, False, (3, 5)),
    "bidirectional_global_beyond_right": (10, 10, (1, 0), 7, False, (2, 3)),
    "causal_decode_shape": (3, 14, (2, 0), 4, True, (2, 4)),
    "more_queries_than_keys": (9, 6, (1, 1), 2, False, (4, 2)),
    "blocked_causal": (300, 300, (16, 0), 5, True, (32, 32)),
    "blocked_bidirectional": (260, 260, (8, 8), 130, False, (64, 32)),
}


def inputs(tq, tk, seed=0):
    q, k, v = make_qkv(seed, b=1, tq=tq, tk=tk, hq=4, hk=2, d=8)
    cotangent = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(q.shape), jnp.float32)
    return q, k, v, cotangent


def attend(implementation, window, global_tokens, causal, blocks):
    def run(q, k, v):
        if implementation == "chunked":
            return ops.chunked_attention(
                q,
                k,
                v,
                is_causal=causal,
                local_window=window,
                global_tokens=global_tokens,
                block_q=blocks[0],
                block_k=blocks[1],
            )
        return ops.dot_product_attention(
            q,
            k,
            v,
            is_causal=causal,
            local_window=window,
            global_tokens=global_tokens,
            implementation=implementation,
        )

    return jax.jit(run)


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(name, marks=pytest.mark.slow) if name.startswith("blocked") else name
        for name in CASES
    ],
)
def test_global_local_equals_the_explicit_mask(case, implementation):
    tq, tk, window, global_tokens, causal, blocks = CASES[case]
    q, k, v, cotangent = inputs(tq, tk)
    mask = reference_mask(tq, tk, window, global_tokens, causal)
    fn = attend(implementation, window, global_tokens, causal, blocks)
    np.testing.assert_allclose(fn(q, k, v), reference_attention64(q, k, v, mask), atol=ATOL)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * cotangent)

    grads = jax.grad(loss(fn), argnums=(0, 1, 2))(q, k, v)
    masked = jax.jit(lambda q, k, v: ops.reference_attention(q, k, v, mask=jnp.asarray(mask)))
    expected = jax.grad(loss(masked), argnums=(0, 1, 2))(q, k, v)
    for actual, wanted in zip(grads, expected, strict=True):
        assert_close_to_scale(actual, wanted)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_attention_takes_global_tokens(causal):
    q, k, v, _ = inputs(7, 7, seed=2)
    mask = reference_mask(7, 7, (1, 1), 2, causal)
    out = ops.reference_attention(q, k, v, is_causal=causal, local_window=(1, 1), global_tokens=2)
    np.testing.assert_allclose(out, reference_attention64(q, k, v, mask), atol=ATOL)
    weights = ops.attention_weights(q, k, is_causal=causal, local_window=(1, 1), global_tokens=2)
    assert np.array_equal(np.asarray(weights[0, 0]) > 0, mask)


@pytest.mark.parametrize("implementation", ["xla", "chunked"])
def test_no_global_tokens_is_plain_local_attention(implementation):
    q, k, v, _ = inputs(10, 10, seed=3)
    run = dict(is_causal=True, local_window=(2, 0), implementation=implementation)
    np.testing.assert_array_equal(
        ops.dot_product_attention(q, k, v, global_tokens=0, **run),
        ops.dot_product_attention(q, k, v, **run),
    )
    # Without a window every key is visible: global tokens change nothing.
    plain = ops.dot_product_attention(q, k, v, implementation=implementation)
    np.testing.assert_allclose(
        ops.dot_product_attention(q, k, v, global_tokens=3, implementation=implementation),
        plain,
        atol=ATOL,
    )


def test_chunked_skips_hidden_blocks_and_keeps_global_ones():
    geometry = _Geometry(
        q_len=64,
        kv_len=64,
        block_q=8,
        block_k=8,
        left=8,
        right=0,
        dropout_rate=0.0,
        causal=True,
        global_tokens=4,
    )
    ranges = [(int(lo), int(hi)) for lo, hi in geometry.key_blocks(5)]  # rows 40..47
    assert ranges == [(0, 1), (4, 6)]  # the global block, then the band of keys 32..47
    assert [(int(lo), int(hi)) for lo, hi in geometry.key_blocks(0)] == [(0, 0), (0, 1)]
    # Key block 0 holds the global keys: every query block sees it; block 3 only its band.
    assert [(int(lo), int(hi)) for lo, hi in geometry.query_blocks(0)] == [(0, 0), (0, 8)]
    assert [(int(lo), int(hi)) for lo, hi in geometry.query_blocks(3)] == [(0, 0), (3, 5)]
    bidirectional = _Geometry(
        q_len=64,
        kv_len=64,
        block_q=8,
        block_k=8,
        left=8,
        right=8,
        dropout_rate=0.0,
        global_tokens=4,
    )
    # Without causality the global queries (block 0) see every key block too.
    assert [(int(lo), int(hi)) for lo, hi in bidirectional.query_blocks(3)] == [(0, 1), (2, 5)]
    assert [(int(lo), int(hi)) for lo, hi in bidirectional.key_blocks(0)] == [(0, 0), (0, 8)]


def test_bad_global_tokens_are_refused():
    q, k, v, _ = inputs(4, 4)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="global_tokens must be a non-negative int"):
            ops.dot_product_attention(q, k, v, local_window=(1, 0), global_tokens=bad)


def test_pallas_falls_back_with_the_reason_logged(caplog):
    attention_choice.log_once.cache_clear()
    q, k, v, _ = inputs(8, 8, seed=4)
    run = dict(is_causal=True, local_window=(2, 0), global_tokens=2)
    with caplog.at_level(logging.INFO, logger="flaxformer_lite.ops.attention"):
        out = ops.dot_product_attention(q, k, v, implementation="pallas", **run)
    assert 'implementation="pallas" falls back (global tokens are not supported)' in caplog.text
    np.testing.assert_allclose(out, ops.reference_attention(q, k, v, **run), atol=ATOL)
    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    mask = AttentionMask(is_causal=True, local_window=(2, 0), global_tokens=2)
    reason = cudnn_unsupported_reason(AttentionCall(*bf16, None, mask, "gpu"))
    assert reason == "global tokens are not supported"


def test_self_attention_module_equals_the_explicit_mask_with_and_without_a_cache():
    from flax import nnx

    from flaxformer_lite.nn import MultiHeadAttention

    mha = MultiHeadAttention(
        16, 4, num_kv_heads=2, local_window=(1, 0), global_tokens=2, rngs=nnx.Rngs(0)
    )
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 9, 16)), jnp.float32)
    sparse = mha(x, is_causal=True)
    mask = jnp.asarray(reference_mask(9, 9, (1, 0), 2, causal=True))
    mha.local_window, mha.global_tokens = None, 0
    np.testing.assert_allclose(sparse, mha(x, mask=mask), atol=ATOL)
    mha.local_window, mha.global_tokens = (1, 0), 2
    mha.init_cache(2, 12)
    steps = [mha(x[:, :3], is_causal=True, cache_index=jnp.int32(0))]
    steps += [mha(x[:, i : i + 1], is_causal=True, cache_index=jnp.int32(i)) for i in range(3, 9)]
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), sparse, atol=ATOL)


def test_model_config_global_tokens():
    import yaml

    from flaxformer_lite.models import ModelConfig

    cfg = ModelConfig.from_preset("gpt2-tiny", local_window=[4, 0], global_tokens=2)
    assert cfg.local_window == (4, 0)
    assert ModelConfig.from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="global_tokens=2 needs model.local_window"):
        ModelConfig.from_preset("gpt2-tiny", global_tokens=2)
    with pytest.raises(ValueError, match="model.global_tokens must be a non-negative int"):
        ModelConfig.from_preset("gpt2-tiny", local_window=[4, 0], global_tokens=-1)
    with pytest.raises(ValueError, match="model.local_window must be"):
        ModelConfig.from_preset("gpt2-tiny", local_window=[4])


def test_the_local_global_ablation_config_loads():
    from flaxformer_lite.train.config import load_config

    config = load_config("configs/ablations/local_global.yaml")
    assert (config.model.local_window, config.model.global_tokens) == ((8, 0), 4)
    assert config.data.generator == "arithmetic"


def test_global_tokens_refuse_packed_rows_and_hugging_face_export(tmp_path):
    """Global tokens are a row's first slots: a packed row's later documents have none, so
    segment ids are refused; Hugging Face's attention has no window to export into."""
    from flax import nnx

    from flaxformer_lite.interop import save_hf
    from flaxformer_lite.models import ModelConfig, build_model

    cfg = ModelConfig.from_preset("gpt2-tiny", local_window=[4, 0], global_tokens=2)
    model = build_model(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.ones((2, 8), jnp.int32)
    model(tokens)  # unpacked rows: fine
    with pytest.raises(ValueError, match=r"global_tokens=2 .*data.packing=false"):
        model(tokens, segment_ids=jnp.ones((2, 8), jnp.int32))
    with pytest.raises(ValueError, match=r"save_hf: model.local_window=\[4, 0\]"):
        save_hf(model, cfg, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
