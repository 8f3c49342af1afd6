"""Text in, tokens out: prompts and sources built from text with a tokenizer, decoded as one
right-padded batch, each row's new tokens cut at ``eos_id``. ``flaxformer-lite generate`` /
``sample.py`` and the training loop's decoded evaluation and sampled continuations all decode
through here.

Token ids come from the tokenizer: a prompt is ``[sos_id] + encode(text)`` when the model was
trained that way (``add_bos``; a run's rows start with ``<sos>``, a Hugging Face checkpoint's only
when its tokenizer adds a ``bos``), an encoder input is ``encode(text) + [eos_id]``, and a target
is decoded from ``sos_id`` until ``eos_id``. ``tokenizer`` is a
:class:`flaxformer_lite.data.tokenizers.Tokenizer` (or a Hugging Face checkpoint's): ``encode``,
``pad_id``, ``sos_id``, ``eos_id`` are all that is read.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable

import jax
import numpy as np

from flaxformer_lite.decode.generate import generate, right_pad, until_eos
from flaxformer_lite.decode.seq2seq import beam_search, seq2seq_generate
from flaxformer_lite.models import DecoderLM, EncoderDecoder


def printable(text: str) -> str:
    """``text`` with its control characters (ESC and the like, which a byte-level model may
    write) as ``\\x1b`` escapes, so that printing a sample cannot drive the terminal; line
    breaks and tabs are kept."""
    return "".join(
        f"\\x{ord(c):02x}" if unicodedata.category(c) == "Cc" and c not in "\n\t" else c
        for c in text
    )


def prompt_ids(tokenizer, text: str, *, add_bos: bool = True) -> list[int]:
    """``[sos_id] + encode(text)`` if ``add_bos`` (or if ``text`` encodes to nothing, since a
    prompt needs a token), else ``encode(text)``."""
    ids = tokenizer.encode(text)
    return [tokenizer.sos_id, *ids] if add_bos or not ids else ids


def source_ids(tokenizer, text: str, max_length: int) -> list[int]:
    """An encoder input: ``encode(text)`` cut to ``max_length - 1`` tokens, then ``eos_id``."""
    return [*tokenizer.encode(text)[: max_length - 1], tokenizer.eos_id]


def new_tokens(
    model: DecoderLM | EncoderDecoder,
    tokenizer,
    rows: list[list[int]],
    *,
    max_new_tokens: int,
    **sampling,
) -> list[np.ndarray]:
    """What the model writes for each token list in ``rows``, ``max_new_tokens`` tokens each
    (``pad_id`` after an ``eos_id``): a ``DecoderLM`` the tokens
    :func:`~flaxformer_lite.decode.generate` adds to each prompt, an ``EncoderDecoder`` the target
    :func:`~flaxformer_lite.decode.seq2seq_generate` decodes from ``sos_id`` for each source.
    ``sampling``: ``temperature``, ``top_k``, ``top_p``, ``min_tokens_to_keep``, ``rng`` of
    ``generate`` (default greedy)."""
    batch, lengths = right_pad(rows, tokenizer.pad_id)
    if isinstance(model, EncoderDecoder):
        ids = _seq2seq_ids(tokenizer, lengths, max_new_tokens)
        return list(np.asarray(seq2seq_generate(model, batch, **ids, **sampling)))
    out = generate(
        model,
        batch,
        max_new_tokens=max_new_tokens,
        prompt_lengths=lengths,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        **sampling,
    )
    return [row[n : n + max_new_tokens] for row, n in zip(np.asarray(out), lengths, strict=True)]


def continue_or_translate(
    model: DecoderLM | EncoderDecoder,
    tokenizer,
    texts: list[str],
    *,
    max_new_tokens: int,
    add_bos: bool = True,
    notify: Callable[[str], None] | None = None,
    **sampling,
) -> list[list[int]]:
    """Greedy (or sampled, ``sampling`` as in :func:`new_tokens`) token ids a ``DecoderLM``
    adds to each prompt of ``texts`` (:func:`prompt_ids`, ``add_bos``), or an ``EncoderDecoder``
    writes as each one's target (:func:`source_ids`), each up to (not including) its first
    ``eos_id``. A ``DecoderLM`` writes all ``max_new_tokens``: past ``model.config.max_length``
    it continues from the last tokens that fit (:func:`continue_in_windows`); ``notify`` hears
    of that once, and of text that encoded to ``<unk>``.

    Raises:
      ValueError: if the longest prompt leaves no room for a new token, a source does not fit
        the encoder, or an ``EncoderDecoder`` is asked for more than ``max_length - 1`` target
        tokens (its target positions).
    """
    max_length = model.config.max_length
    if isinstance(model, EncoderDecoder):
        rows = _whole_sources(tokenizer, texts, max_length)
        check_target_length(max_new_tokens, max_length)
        _say_unknown(tokenizer, texts, rows, notify)
        outputs = new_tokens(model, tokenizer, rows, max_new_tokens=max_new_tokens, **sampling)
        return [until_eos(ids, tokenizer.eos_id) for ids in outputs]
    rows = [prompt_ids(tokenizer, text, add_bos=add_bos) for text in texts]
    room = max_length - max(map(len, rows))
    if room < 1:
        raise ValueError(
            f"a prompt of {max_length - room} tokens leaves no room below max_length={max_length}"
        )
    _say_unknown(tokenizer, texts, rows, notify)
    if max_new_tokens > room and notify is not None:
        keep = window_kept(max_length)
        notify(
            f"max_new_tokens={max_new_tokens} runs past the context (max_length={max_length}): "
            f"past it, each {max_length - keep} tokens are generated anew from the last {keep}"
        )
    return continue_in_windows(model, tokenizer, rows, max_new_tokens=max_new_tokens, **sampling)


def window_kept(max_length: int) -> int:
    """The tokens :func:`continue_in_windows` keeps as the next window's prompt: three quarters
    of the context, so every new token still reads at least that much while the prompt is
    re-read once per quarter (nanoGPT re-reads ``max_length - 1`` tokens for every token)."""
    return max(1, max_length - max_length // 4)


def continue_in_windows(
    model: DecoderLM,
    tokenizer,
    rows: list[list[int]],
    *,
    max_new_tokens: int,
    rng=None,
    **sampling,
) -> list[list[int]]:
    """The tokens a ``DecoderLM`` adds to each prompt in ``rows``, up to its first ``eos_id``,
    ``max_new_tokens`` of them even past ``model.config.max_length``: the first window fills
    the context; each next one re-reads the last :func:`window_kept` tokens of each row from
    position 0 (so learned positions, RoPE and relative ones alike) and fills the rest with a
    fresh KV cache. Sampling draws the first window with ``rng`` (as :func:`new_tokens` would),
    window ``i`` after it with ``fold_in(rng, i)``."""
    max_length = model.config.max_length
    keep = window_kept(max_length)
    written = [[] for _ in rows]
    done = [False] * len(rows)
    contexts, window = rows, 0
    while not all(done):
        left = max_new_tokens - min(len(w) for w, d in zip(written, done, strict=True) if not d)
        # Past the first window every call has one shape ([B, keep] in, max_length - keep
        # out), so it compiles once; the surplus of the last one is dropped.
        room = max_length - max(map(len, contexts))
        key = rng if rng is None or window == 0 else jax.random.fold_in(rng, window)
        outputs = new_tokens(
            model,
            tokenizer,
            contexts,
            max_new_tokens=min(room, left) if window == 0 else room,
            rng=key,
            **sampling,
        )
        for i, ids in enumerate(outputs):
            if done[i]:
                continue
            ids = until_eos(ids, tokenizer.eos_id)
            done[i] = len(ids) < len(outputs[i]) or len(written[i]) + len(ids) >= max_new_tokens
            written[i] += ids[: max_new_tokens - len(written[i])]
        contexts = [(row + new)[-keep:] for row, new in zip(rows, written, strict=True)]
        window += 1
    return written


def check_target_length(max_new_tokens: int, max_length: int) -> None:
    """An ``EncoderDecoder``'s target has ``max_length - 1`` positions after ``sos``: a longer
    one is refused before decoding (a translation ends at ``eos``; it is not continued)."""
    if max_new_tokens > max_length - 1:
        raise ValueError(
            f"max_new_tokens={max_new_tokens}: an encoder-decoder's target has at most "
            f"{max_length - 1} tokens (max_length={max_length})"
        )


def _whole_sources(tokenizer, texts: list[str], max_length: int) -> list[list[int]]:
    """The encoder inputs of ``texts``, refusing one that :func:`source_ids` would cut, as a
    decoder prompt too long is refused.

    Raises:
      ValueError: naming the text and its length.
    """
    for text in texts:
        if (count := len(tokenizer.encode(text))) > max_length - 1:
            raise ValueError(
                f"the source {text[:40]!r}{'...' * (len(text) > 40)} is {count} tokens; the "
                f"encoder takes {max_length - 1} and <eos> (max_length={max_length})"
            )
    return [source_ids(tokenizer, text, max_length) for text in texts]


def _say_unknown(tokenizer, texts, rows, notify) -> None:
    """Tells ``notify`` of tokens of the text that became ``<unk>`` (the text is shown as
    typed)."""
    if notify is None:
        return
    unk_id = getattr(tokenizer, "unk_id", None)
    unknown = {text: row.count(unk_id) for text, row in zip(texts, rows, strict=True)}
    for text, count in unknown.items():
        if unk_id is not None and count:
            notify(f"{text!r}: {count} of its tokens are not in the tokenizer's vocabulary: <unk>")


def translate_beam(
    model: EncoderDecoder,
    tokenizer,
    texts: list[str],
    *,
    beam_size: int,
    alpha: float,
    max_new_tokens: int,
    notify: Callable[[str], None] | None = None,
) -> tuple[list[list[list[int]]], list[list[float]]]:
    """Beam search: per text, ``beam_size`` hypotheses (best first, each up to its ``eos_id``)
    and their length-penalized scores, of up to ``max_new_tokens`` tokens (``notify`` as in
    :func:`continue_or_translate`).

    Raises:
      ValueError: a source that does not fit the encoder, or ``max_new_tokens`` past the
        target's ``model.config.max_length - 1`` positions.
    """
    max_length = model.config.max_length
    sources = _whole_sources(tokenizer, texts, max_length)
    check_target_length(max_new_tokens, max_length)
    _say_unknown(tokenizer, texts, sources, notify)
    batch, lengths = right_pad(sources, tokenizer.pad_id)
    ids = _seq2seq_ids(tokenizer, lengths, max_new_tokens)
    tokens, scores = beam_search(model, batch, beam_size=beam_size, alpha=alpha, **ids)
    beams = [[until_eos(b, tokenizer.eos_id) for b in row] for row in np.asarray(tokens)]
    return beams, np.asarray(scores).tolist()


def _seq2seq_ids(tokenizer, src_lengths: np.ndarray, max_new_tokens: int) -> dict:
    """The arguments greedy, sampled and beam decoding of an encoder-decoder share."""
    return dict(
        max_new_tokens=max_new_tokens,
        src_lengths=src_lengths,
        sos_id=tokenizer.sos_id,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
    )
