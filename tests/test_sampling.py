"""Tests for the sampling filters at their boundaries: top-p against a float64 computation of the
smallest set reaching p, the float32 rounding case from Hugging Face's ``TopPLogitsWarper``, and
``min_tokens_to_keep``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.decode import filter_logits, next_token
from flaxformer_lite.decode.sampling import check_sampling

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


def kept(logits, **filters) -> np.ndarray:
    return np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), **filters)))


def smallest_set_reaching(probs: np.ndarray, p: float) -> np.ndarray:
    """float64: the fewest most likely tokens whose probabilities sum to at least ``p``."""
    order = np.argsort(-probs, kind="stable")
    total = np.cumsum(probs[order])
    count = int(np.searchsorted(total, p - 1e-12)) + 1  # the first prefix sum that reaches p
    keep = np.zeros(len(probs), bool)
    keep[order[:count]] = True
    return keep


def test_top_p_at_a_float32_boundary_keeps_what_hugging_face_keeps():
    logits = np.log(np.array([[0.3, 0.1, 0.1, 0.5]], np.float32))
    np.testing.assert_array_equal(kept(logits, top_p=0.8), [[True, False, False, True]])
    np.testing.assert_array_equal(kept(logits, top_p=0.5), [[False, False, False, True]])
    # 0.9 is reached with one of the tied 0.1s (the first); 0.81 and 0.95 need one and both.
    np.testing.assert_array_equal(kept(logits, top_p=0.9), [[True, True, False, True]])
    np.testing.assert_array_equal(kept(logits, top_p=0.81), [[True, True, False, True]])
    np.testing.assert_array_equal(kept(logits, top_p=0.95), [[True, True, True, True]])


@pytest.mark.parametrize("seed", range(4))
def test_top_p_equals_a_float64_computation_at_and_beside_each_prefix_sum(seed):
    rng = np.random.default_rng(seed)
    vocab = 12
    probs = rng.dirichlet(np.full(vocab, 0.7))
    logits = np.log(probs).astype(np.float32)[None]
    prefix_sums = np.cumsum(np.sort(probs)[::-1])[:-1]
    # Each prefix sum exactly (p reached with that many tokens), and just above and below it.
    for p in np.concatenate([prefix_sums, prefix_sums + 1e-4, prefix_sums - 1e-4]):
        if not 0 < p < 1:
            continue
        np.testing.assert_array_equal(
            kept(logits, top_p=float(p))[0], smallest_set_reaching(probs, p), err_msg=f"p={p}"
        )


def test_top_p_on_random_logits_equals_float64_for_every_row():
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(64, 50)) * 2
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    got = kept(logits.astype(np.float32), top_p=0.9)
    want = np.stack([smallest_set_reaching(row, 0.9) for row in probs])
    np.testing.assert_array_equal(got, want)


def test_hugging_face_top_p_warper_keeps_the_same_tokens():
    torch = pytest.importorskip("torch")
    warpers = pytest.importorskip("transformers.generation.logits_process")
    rng = np.random.default_rng(3)
    logits = np.concatenate(
        [np.log(np.array([[0.3, 0.1, 0.1, 0.5, 0.0, 0.0]]) + 1e-30), rng.normal(size=(16, 6))]
    ).astype(np.float32)
    # min_tokens_to_keep never decides between tied tokens here: the two sorts break ties apart.
    for p, keep_at_least in ((0.8, 1), (0.5, 1), (0.3, 2), (0.95, 2)):
        warper = warpers.TopPLogitsWarper(top_p=p, min_tokens_to_keep=keep_at_least)
        theirs = np.isfinite(warper(None, torch.from_numpy(logits.copy())).numpy())
        ours = kept(logits, top_p=p, min_tokens_to_keep=keep_at_least)
        np.testing.assert_array_equal(ours, theirs, err_msg=f"p={p}")


def test_min_tokens_to_keep_widens_top_p_and_top_k():
    logits = np.log(np.array([[0.05, 0.6, 0.15, 0.2]], np.float32))
    np.testing.assert_array_equal(kept(logits, top_p=0.5), [[False, True, False, False]])
    np.testing.assert_array_equal(
        kept(logits, top_p=0.5, min_tokens_to_keep=3), [[False, True, True, True]]
    )
    np.testing.assert_array_equal(
        kept(logits, top_k=1, min_tokens_to_keep=2), [[False, True, False, True]]
    )
    # A set that already reaches p with more tokens is not cut to min_tokens_to_keep.
    np.testing.assert_array_equal(
        kept(logits, top_p=0.9, min_tokens_to_keep=2), [[False, True, True, True]]
    )


def test_sampling_with_min_tokens_to_keep_draws_only_the_kept_tokens():
    logits = jnp.log(jnp.asarray([[0.7, 0.2, 0.06, 0.04]])).repeat(4000, axis=0)
    draws = np.asarray(
        next_token(jax.random.key(0), logits, temperature=1.0, top_p=0.5, min_tokens_to_keep=2)
    )
    counts = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(counts, [7 / 9, 2 / 9, 0, 0], atol=0.03)


def test_min_tokens_to_keep_below_one_is_named():
    with pytest.raises(ValueError, match="min_tokens_to_keep"):
        check_sampling(1.0, None, 0.9, jax.random.key(0), min_tokens_to_keep=0)
