"""Tests for flaxformer_lite.decode: cached generation against repeated full forward passes,
per-row EOS, sampling filters, seq2seq decoding and beam search, and decoding from text
(decode/text.py).

The references recompute the whole prefix with the model's ordinary (uncached) forward pass on a
fixed-size buffer: a causal model's logits at position p do not depend on later slots, so one
compiled program serves every step of every row.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_cases import (
    LM_CONFIGS,
    NEW,
    VOCAB,
    greedy_reference,
    make,
)
from flax import nnx

from flaxformer_lite.decode import (
    filter_logits,
    generate,
    next_token,
)

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

PROMPTS = np.random.default_rng(0).integers(3, VOCAB, (3, 6)).astype(np.int32)
PROMPT_LENGTHS = np.array([6, 2, 4])


def expected_rows(references, lengths, total, eos_id=None):
    """Left-aligned rows: prompt + new tokens (cut after eos) + padding."""
    rows = np.zeros((len(references), total), np.int32)
    for b, (reference, length) in enumerate(zip(references, lengths, strict=True)):
        new = list(reference[length:])
        if eos_id is not None and eos_id in new:
            new = new[: new.index(eos_id) + 1]
        row = list(reference[:length]) + new
        rows[b, : len(row)] = row
    return rows


@pytest.fixture(scope="module", params=list(LM_CONFIGS))
def lm_case(request):
    preset, overrides = LM_CONFIGS[request.param]
    model = make(preset, **overrides)
    references = [
        greedy_reference(model, PROMPTS[b, :n], NEW) for b, n in enumerate(PROMPT_LENGTHS)
    ]
    return model, references


def test_cached_greedy_equals_full_forward_argmax(lm_case):
    model, references = lm_case
    generated = [set(r[n:].tolist()) for r, n in zip(references, PROMPT_LENGTHS, strict=True)]
    assert max(len(g) for g in generated) >= 3, "degenerate reference: the check would be weak"
    out = generate(model, PROMPTS, max_new_tokens=NEW, prompt_lengths=PROMPT_LENGTHS)
    expected = expected_rows(references, PROMPT_LENGTHS, PROMPTS.shape[1] + NEW)
    np.testing.assert_array_equal(np.asarray(out), expected)


def test_eos_stops_rows_independently(lm_case):
    model, references = lm_case
    eos_id = int(references[0][PROMPT_LENGTHS[0] + 2])  # row 0 stops after 3 new tokens
    out = generate(model, PROMPTS, max_new_tokens=NEW, prompt_lengths=PROMPT_LENGTHS, eos_id=eos_id)
    expected = expected_rows(references, PROMPT_LENGTHS, PROMPTS.shape[1] + NEW, eos_id)
    np.testing.assert_array_equal(np.asarray(out), expected)
    assert (np.asarray(out)[0, PROMPT_LENGTHS[0] + 3 :] == 0).all()


def test_equal_length_prompts_without_lengths():
    model = make("gpt2-tiny")
    references = [greedy_reference(model, p, NEW) for p in PROMPTS]
    out = generate(model, PROMPTS, max_new_tokens=NEW)
    np.testing.assert_array_equal(np.asarray(out), np.stack(references))


def test_generate_leaves_the_model_unchanged():
    model = make("gpt2-tiny")
    params = lambda: jax.tree.map(np.asarray, nnx.state(model, nnx.Param))  # noqa: E731
    before = params()
    generate(model, PROMPTS, max_new_tokens=2)
    assert model.decode_state is None
    assert not nnx.state(model, nnx.Cache)
    jax.tree.map(np.testing.assert_array_equal, before, params())


def test_top_k_1_and_tiny_top_p_equal_greedy():
    model = make("gpt2-tiny")
    greedy = generate(model, PROMPTS, max_new_tokens=NEW, prompt_lengths=PROMPT_LENGTHS)
    for sampling in (dict(top_k=1), dict(top_p=1e-6)):
        sampled = generate(
            model,
            PROMPTS,
            max_new_tokens=NEW,
            prompt_lengths=PROMPT_LENGTHS,
            temperature=1.5,
            rng=jax.random.key(3),
            **sampling,
        )
        np.testing.assert_array_equal(np.asarray(sampled), np.asarray(greedy))


def test_sampling_is_reproducible_and_depends_on_the_key():
    model = make("gpt2-tiny")

    def run(seed):
        return np.asarray(
            generate(model, PROMPTS, max_new_tokens=NEW, temperature=2.0, rng=jax.random.key(seed))
        )

    np.testing.assert_array_equal(run(0), run(0))
    assert (run(0) != run(1)).any()
    np.testing.assert_array_equal(run(0)[:, :6], PROMPTS)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = np.array([0.05, 0.5, 0.15, 0.3])  # sorted: 0.5, 0.3, 0.15, 0.05
    logits = jnp.log(jnp.asarray(probs))[None]
    kept = lambda p: np.isfinite(np.asarray(filter_logits(logits, top_p=p))[0])  # noqa: E731
    np.testing.assert_array_equal(kept(0.5), [False, True, False, False])
    np.testing.assert_array_equal(kept(0.8), [False, True, False, True])
    np.testing.assert_array_equal(kept(0.81), [False, True, True, True])
    np.testing.assert_array_equal(kept(1.0), [True, True, True, True])
    np.testing.assert_array_equal(kept(1e-9), [False, True, False, False])


def test_top_k_keeps_the_k_largest():
    logits = jnp.asarray([[0.0, 3.0, 1.0, 2.0, -1.0]])
    kept = np.isfinite(np.asarray(filter_logits(logits, top_k=2)))[0]
    np.testing.assert_array_equal(kept, [False, True, False, True, False])


def test_sampled_frequencies_follow_the_filtered_distribution():
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    logits = jnp.log(jnp.asarray(probs))[None].repeat(20000, axis=0)
    draws = np.asarray(next_token(jax.random.key(0), logits, temperature=1.0, top_k=3))
    counts = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(counts, [4 / 9, 3 / 9, 2 / 9, 0], atol=0.015)
    draws = np.asarray(next_token(jax.random.key(1), logits, temperature=1.0, top_p=0.65))
    counts = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(counts, [4 / 7, 3 / 7, 0, 0], atol=0.015)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=2, prompt_lengths=[1, 2]), "prompt_lengths"),
        (dict(max_new_tokens=2, prompt_lengths=[0, 2, 3]), "prompt_lengths"),
        (dict(max_new_tokens=2, temperature=1.0), "rng"),
        (dict(max_new_tokens=2, top_p=1.5, temperature=1.0, rng=jax.random.key(0)), "top_p"),
        (dict(max_new_tokens=2, top_k=0, temperature=1.0, rng=jax.random.key(0)), "top_k"),
        (dict(max_new_tokens=30), "max_length"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    model = make("gpt2-tiny", positions="learned")
    with pytest.raises(ValueError, match=match):
        generate(model, PROMPTS, **kwargs)
