"""Tests for decoding from text (flaxformer_lite.decode.text): prompts and sources as
`generate` writes them, what decoding changed from what was asked, and generation past the
model's context."""

import functools

import jax
import numpy as np
import pytest
from decode_cases import (
    LM_CONFIGS,
    NEW,
    VOCAB,
    clear_argmax,
    lm_logits,
    make,
)

from flaxformer_lite.decode import (
    generate,
    right_pad,
    seq2seq_generate,
    text,
    until_eos,
)

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


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
