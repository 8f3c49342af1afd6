"""Tests for flaxformer_lite.decode on encoder-decoders: cached greedy and sampled targets
against teacher-forced full forward passes, and beam search."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_cases import (
    NEW,
    SOURCES,
    clear_argmax,
    make,
)
from flax import nnx

from flaxformer_lite.decode import (
    beam_search,
    generate,
    seq2seq_generate,
)

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


SOURCE_LENGTHS = np.array([7, 3, 5])


@functools.partial(jax.jit, static_argnums=0)
def _seq2seq_logits(graphdef, state, src, tgt):
    return nnx.merge(graphdef, state)(src, tgt)


def seq2seq_logits(model, src, tgt):
    return _seq2seq_logits(*nnx.split(model), jnp.asarray(src), jnp.asarray(tgt))


def seq2seq_reference(model, src, new_tokens, sos_id=1):
    """Greedy target of one unpadded source by full teacher-forced forward passes."""
    buffer = np.zeros((1, new_tokens + 1), np.int32)
    buffer[0, 0] = sos_id
    for step in range(new_tokens):
        logits = seq2seq_logits(model, src[None], buffer)[0, step]
        buffer[0, step + 1] = clear_argmax(logits)
    return buffer[0, 1:]


def sequence_log_prob(model, src, target, eos_id):
    """log P(target | src) up to and including the first eos, by one teacher-forced pass."""
    target = list(target)
    if eos_id in target:
        target = target[: target.index(eos_id) + 1]
    tgt = np.array([[1, *target[:-1]]], np.int32)
    logp = jax.nn.log_softmax(seq2seq_logits(model, src[None], tgt)[0].astype(jnp.float32))
    return float(sum(logp[i, t] for i, t in enumerate(target))), len(target)


@pytest.fixture(scope="module", params=["loop", "scan"])
def seq2seq_case(request):
    # Pre-LN: the post-LN tiny model's greedy output repeats one token (a weak check); the
    # decode path is the same for both (tests/test_models_variants.py covers post-LN decoding).
    model = make("transformer-tiny", norm_position="pre", scan_layers=request.param == "scan")
    references = [
        seq2seq_reference(model, SOURCES[b, :n], NEW) for b, n in enumerate(SOURCE_LENGTHS)
    ]
    return model, np.stack(references)


def test_seq2seq_greedy_equals_full_forward_argmax(seq2seq_case):
    model, references = seq2seq_case
    assert len(set(references.ravel().tolist())) >= 4, "degenerate reference"
    out = seq2seq_generate(
        model, SOURCES, max_new_tokens=NEW, src_lengths=SOURCE_LENGTHS, eos_id=None
    )
    np.testing.assert_array_equal(np.asarray(out), references)


def test_seq2seq_eos_and_sampling(seq2seq_case):
    model, references = seq2seq_case
    eos_id = int(references[1, 1])
    out = np.asarray(
        seq2seq_generate(
            model, SOURCES, max_new_tokens=NEW, src_lengths=SOURCE_LENGTHS, eos_id=eos_id
        )
    )
    for row, reference in zip(out, references, strict=True):
        new = list(reference)
        if eos_id in new:
            new = new[: new.index(eos_id) + 1]
        np.testing.assert_array_equal(row, new + [0] * (NEW - len(new)))
    top1 = seq2seq_generate(
        model,
        SOURCES,
        max_new_tokens=NEW,
        src_lengths=SOURCE_LENGTHS,
        eos_id=None,
        temperature=0.7,
        top_k=1,
        rng=jax.random.key(0),
    )
    np.testing.assert_array_equal(np.asarray(top1), references)


def test_beam_size_1_equals_greedy(seq2seq_case):
    model, references = seq2seq_case
    tokens, scores = beam_search(
        model,
        SOURCES,
        max_new_tokens=NEW,
        src_lengths=SOURCE_LENGTHS,
        beam_size=1,
        alpha=0.0,
        eos_id=None,
    )
    assert tokens.shape == (3, 1, NEW) and scores.shape == (3, 1)
    np.testing.assert_array_equal(np.asarray(tokens)[:, 0], references)


def test_beams_are_sorted_and_scored_by_their_length_normalized_log_prob(seq2seq_case):
    model, references = seq2seq_case
    eos_id = int(references[0, 2])
    alpha = 0.6
    tokens, scores = beam_search(
        model,
        SOURCES,
        max_new_tokens=NEW,
        src_lengths=SOURCE_LENGTHS,
        beam_size=4,
        alpha=alpha,
        eos_id=eos_id,
    )
    tokens, scores = np.asarray(tokens), np.asarray(scores)
    assert tokens.shape == (3, 4, NEW)
    assert (np.diff(scores, axis=1) <= 1e-6).all(), scores
    saw_eos = False
    for b, n in enumerate(SOURCE_LENGTHS):
        assert len({tuple(t) for t in tokens[b]}) == 4, "beams must be distinct"
        for beam, score in zip(tokens[b], scores[b], strict=True):
            log_prob, length = sequence_log_prob(model, SOURCES[b, :n], beam, eos_id)
            # Cached and full passes sum in different orders: float32 noise, not a formula slip.
            np.testing.assert_allclose(score, log_prob / ((5 + length) / 6) ** alpha, rtol=1e-3)
            if eos_id in beam.tolist():
                saw_eos = True
                assert (beam[beam.tolist().index(eos_id) + 1 :] == 0).all()
    assert saw_eos

    # The best beam is at least as good as the greedy hypothesis, both scored by the same full
    # pass: the search's own (cached) score sums in another order, by a CPU-dependent amount.
    def full_pass_score(src, target):
        log_prob, length = sequence_log_prob(model, src, target, eos_id)
        return log_prob / ((5 + length) / 6) ** alpha

    for b, n in enumerate(SOURCE_LENGTHS):
        best = full_pass_score(SOURCES[b, :n], tokens[b, 0])
        greedy = full_pass_score(SOURCES[b, :n], references[b])
        # Equal when the best beam is the greedy hypothesis; otherwise the search ranked it
        # higher, and two nearly tied hypotheses may swap within float32 round-off.
        assert best >= greedy - 1e-5 * abs(greedy), (best, greedy)


def test_seq2seq_bad_arguments():
    model = make("transformer-tiny")
    with pytest.raises(ValueError, match="beam_size"):
        beam_search(model, SOURCES, max_new_tokens=2, beam_size=0)
    with pytest.raises(ValueError, match="alpha"):
        beam_search(model, SOURCES, max_new_tokens=2, alpha=-1.0)
    with pytest.raises(ValueError, match="src_lengths"):
        seq2seq_generate(model, SOURCES, max_new_tokens=2, src_lengths=[8, 1, 1])
    with pytest.raises(ValueError, match="takes a DecoderLM, got EncoderDecoder"):
        generate(model, SOURCES, max_new_tokens=2)
    with pytest.raises(ValueError, match="takes a EncoderDecoder, got DecoderLM"):
        beam_search(make("gpt2-tiny"), SOURCES, max_new_tokens=2)
