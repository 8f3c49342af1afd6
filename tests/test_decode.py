"""Tests for flaxformer_lite.decode: cached generation against repeated full forward passes,
per-row EOS, sampling filters, seq2seq decoding and beam search, and decoding from text
(decode/text.py).

The references recompute the whole prefix with the model's ordinary (uncached) forward pass on a
fixed-size buffer: a causal model's logits at position p do not depend on later slots, so one
compiled program serves every step of every row.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxformer_lite.decode import (
    beam_search,
    filter_logits,
    generate,
    next_token,
    right_pad,
    seq2seq_generate,
    text,
    until_eos,
)
from flaxformer_lite.models import ModelConfig, build_model

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

VOCAB = 64
SMALL = dict(
    d_model=32,
    num_heads=4,
    d_ff=64,
    vocab_size=VOCAB,
    max_length=32,
    embedding_dropout=0.0,
    attention_dropout=0.0,
    residual_dropout=0.0,
)
PROMPTS = np.random.default_rng(0).integers(3, VOCAB, (3, 6)).astype(np.int32)
PROMPT_LENGTHS = np.array([6, 2, 4])
NEW = 7


def make(preset, **overrides):
    """A tiny model in eval mode with weights scaled up, so greedy outputs vary from step to
    step instead of repeating one token (a stronger check of the cache)."""
    cfg = ModelConfig.from_preset(preset, **{**SMALL, **overrides})
    model = build_model(cfg, rngs=nnx.Rngs(jax.random.key(0, impl="rbg")))
    model.eval()
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x * 3, params))
    return model


@functools.partial(jax.jit, static_argnums=0)
def _lm_logits(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)


def lm_logits(model, tokens):
    return _lm_logits(*nnx.split(model), jnp.asarray(tokens))


def clear_argmax(logits) -> int:
    """The argmax of ``logits [V]``, checked to lead the runner-up by far more than float32
    round-off: the references are compared token for token with the cached decoding, another
    program that sums in another order, where a near-tie could go either way."""
    runner_up, best = np.sort(np.asarray(logits, np.float64))[-2:]
    assert best - runner_up > 1e-4 * max(1.0, abs(best)), f"near-tie: {best} vs {runner_up}"
    return int(np.argmax(logits))


def greedy_reference(model, prompt, new_tokens):
    """Greedy continuation of one prompt by full forward passes (no cache)."""
    length = len(prompt) + new_tokens
    buffer = np.zeros((1, length), np.int32)
    buffer[0, : len(prompt)] = prompt
    for position in range(len(prompt), length):
        logits = lm_logits(model, buffer)[0, position - 1]
        buffer[0, position] = clear_argmax(logits)
    return buffer[0]


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


LM_CONFIGS = {
    "learned": ("gpt2-tiny", {}),
    "rope_gqa": ("llama-tiny", {"num_kv_heads": 2}),
    "alibi_scan": ("gpt2-tiny", {"positions": "alibi", "scan_layers": True}),
    "relative": ("gpt2-tiny", {"positions": "relative"}),
}


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


# ----------------------------------------------------------------------------- seq2seq

SOURCES = np.random.default_rng(1).integers(3, VOCAB, (3, 7)).astype(np.int32)
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


class LetterTokenizer:
    """Each character one id below ``VOCAB``, with the library's special ids."""

    pad_id, sos_id, eos_id = 0, 1, 2

    def encode(self, string):
        return [4 + ord(c) % (VOCAB - 4) for c in string]


def test_text_prompts_continue_as_generate_writes_them():
    model, tokenizer = make("gpt2-tiny"), LetterTokenizer()
    prompts = ["12+34=", "", "a longer prompt"]
    rows = [text.prompt_ids(tokenizer, p, add_bos=False) for p in prompts]
    # An empty prompt still starts with sos_id: generation needs a token to read.
    assert rows[:2] == [tokenizer.encode("12+34="), [tokenizer.sos_id]]
    assert text.prompt_ids(tokenizer, "ab") == [tokenizer.sos_id, *tokenizer.encode("ab")]
    got = text.continue_or_translate(model, tokenizer, prompts, add_bos=False, max_new_tokens=NEW)
    batch, lengths = right_pad(rows, tokenizer.pad_id)
    out = np.asarray(
        generate(model, batch, max_new_tokens=NEW, prompt_lengths=lengths, eos_id=2, pad_id=0)
    )
    # Only each row's new tokens: not the padding after a shorter prompt's continuation.
    assert got == [until_eos(row[n : n + NEW], 2) for row, n in zip(out, lengths, strict=True)]
    with pytest.raises(ValueError, match="prompt of 33 tokens leaves no room below max_length=32"):
        text.continue_or_translate(model, tokenizer, ["x" * 32], add_bos=True, max_new_tokens=1)


def test_text_sources_translate_as_seq2seq_generate_writes_them():
    model, tokenizer = make("transformer-tiny", norm_position="pre"), LetterTokenizer()
    texts = ["forty-two", "x" * 31]
    sources = [text.source_ids(tokenizer, t, max_length=32) for t in texts]
    assert sources[0] == [*tokenizer.encode("forty-two"), 2] and len(sources[1]) == 32
    got = text.continue_or_translate(model, tokenizer, texts, max_new_tokens=NEW)
    batch, lengths = right_pad(sources)
    out = np.asarray(seq2seq_generate(model, batch, max_new_tokens=NEW, src_lengths=lengths))
    assert got == [until_eos(row, 2) for row in out]
    # A source too long for the encoder is refused, as a decoder prompt is (issue 43 item 9).
    too_long = "the source 'xxxxx.*' is 32 tokens; the encoder takes 31 and <eos>"
    for decode in (
        text.continue_or_translate,
        functools.partial(text.translate_beam, beam_size=2, alpha=0.6),
    ):
        with pytest.raises(ValueError, match=too_long):
            decode(model, tokenizer, ["x" * 32], max_new_tokens=NEW)


class DigitTokenizer(LetterTokenizer):
    """Digits only; every other character is ``<unk>``."""

    unk_id = 3

    def encode(self, string):
        return [4 + int(c) if c.isdigit() else self.unk_id for c in string]


def test_what_decoding_changes_from_what_was_asked_is_said():
    """Issue 43 item 9: <unk> while the prompt is echoed as typed; issue 45 item 1: running past
    the context is said once."""
    model, notes = make("gpt2-tiny"), []
    prompts = ["12+3", "12+3", "45"]  # two samples of one prompt: said once
    text.continue_or_translate(
        model, DigitTokenizer(), prompts, max_new_tokens=100, notify=notes.append
    )
    assert notes == [
        "'12+3': 1 of its tokens are not in the tokenizer's vocabulary: <unk>",
        "max_new_tokens=100 runs past the context (max_length=32): past it, each 8 tokens are "
        "generated anew from the last 24",
    ]


def test_printable_escapes_control_characters_but_line_breaks_and_tabs():
    """Issue 43 item 19: a byte-level model's ESC reached the terminal."""
    assert text.printable("a\x1b[31mb\n\tc\x7f\x00é") == "a\\x1b[31mb\n\tc\\x7f\\x00é"


class EndlessTokenizer(LetterTokenizer):
    """No ``eos_id``: every row writes all it is asked for."""

    eos_id = None


def windowed_reference(model, prompt, new_tokens, keep, first):
    """Greedy continuation past the context by full forward passes (no cache): ``first``
    tokens (what the batch's longest prompt leaves), then each window re-reads the last
    ``keep`` tokens from position 0 and fills the context."""
    max_length = model.config.max_length
    row, written = list(prompt), []
    while len(written) < new_tokens:
        context = (row + written)[-keep:] if written else row
        buffer = np.zeros((1, max_length), np.int32)  # causal: later slots change nothing
        buffer[0, : len(context)] = context
        end = max_length if written else len(context) + first
        for position in range(len(context), end):
            token = clear_argmax(lm_logits(model, buffer)[0, position - 1])
            buffer[0, position] = token
            written.append(token)
            if len(written) == new_tokens:
                break
    return written


@pytest.mark.parametrize("case", ["learned", "rope_gqa"])
def test_generation_goes_past_the_context_as_asked(case):
    """Issue 45 item 1: 500 tokens (characters, for this tokenizer) from a 64-position model,
    the cached windows equal to the same windows decoded without a cache; said once."""
    preset, overrides = LM_CONFIGS[case]
    model, tokenizer, notes = make(preset, max_length=64, **overrides), EndlessTokenizer(), []
    prompts = ["ROMEO:", "ab"]
    got = text.continue_or_translate(
        model, tokenizer, prompts, max_new_tokens=500, add_bos=False, notify=notes.append
    )
    assert [len(ids) for ids in got] == [500, 500]
    for prompt, ids in zip(prompts, got, strict=True):
        reference = windowed_reference(model, tokenizer.encode(prompt), 500, keep=48, first=58)
        assert ids == reference
    assert notes == [
        "max_new_tokens=500 runs past the context (max_length=64): past it, each 16 tokens "
        "are generated anew from the last 48"
    ]


def test_sampling_past_the_context_draws_a_key_per_window():
    model, tokenizer = make("gpt2-tiny"), EndlessTokenizer()
    sample = functools.partial(
        text.continue_or_translate,
        model,
        tokenizer,
        ["ab", "c"],
        max_new_tokens=60,
        temperature=1.0,
    )
    first = sample(rng=jax.random.key(1))
    assert [len(ids) for ids in first] == [60, 60] and sample(rng=jax.random.key(1)) == first
    assert sample(rng=jax.random.key(2)) != first


def test_an_encoder_decoder_target_past_its_positions_is_refused_before_decoding():
    """Issue 45 item 1: greedy and beam search say so instead of stopping early."""
    model, tokenizer = make("transformer-tiny", norm_position="pre"), LetterTokenizer()
    message = "max_new_tokens=32: an encoder-decoder's target has at most 31 tokens"
    for decode in (
        text.continue_or_translate,
        functools.partial(text.translate_beam, beam_size=2, alpha=0.6),
    ):
        with pytest.raises(ValueError, match=message):
            decode(model, tokenizer, ["forty-two"], max_new_tokens=32)
