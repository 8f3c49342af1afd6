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
    ``eos_id``. ``max_new_tokens`` is capped so that prompt and continuation, or the target, fit
    in ``model.config.max_length``; ``notify`` hears of that, and of text that encoded to
    ``<unk>``.

    Raises:
      ValueError: if the longest prompt leaves no room for a new token, or a source does not
        fit the encoder.
    """
    max_length = model.config.max_length
    if isinstance(model, EncoderDecoder):
        rows = _whole_sources(tokenizer, texts, max_length)
        room = max_length - 1
    else:
        rows = [prompt_ids(tokenizer, text, add_bos=add_bos) for text in texts]
        room = max_length - max(map(len, rows))
        if room < 1:
            raise ValueError(
                f"a prompt of {max_length - room} tokens leaves no room below "
                f"max_length={max_length}"
            )
    _say_changes(tokenizer, texts, rows, max_new_tokens, room, max_length, notify)
    outputs = new_tokens(
        model, tokenizer, rows, max_new_tokens=min(max_new_tokens, room), **sampling
    )
    return [until_eos(ids, tokenizer.eos_id) for ids in outputs]


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


def _say_changes(tokenizer, texts, rows, max_new_tokens, room, max_length, notify) -> None:
    """Tells ``notify`` what decoding changes from what was asked: tokens of the text that
    became ``<unk>`` (the text is shown as typed), and ``max_new_tokens`` lowered to fit."""
    if notify is None:
        return
    unk_id = getattr(tokenizer, "unk_id", None)
    unknown = {text: row.count(unk_id) for text, row in zip(texts, rows, strict=True)}
    for text, count in unknown.items():
        if unk_id is not None and count:
            notify(f"{text!r}: {count} of its tokens are not in the tokenizer's vocabulary: <unk>")
    if max_new_tokens > room:
        notify(
            f"max_new_tokens={max_new_tokens} lowered to {room}, what fits in "
            f"max_length={max_length}"
        )


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
    and their length-penalized scores; at most ``model.config.max_length - 1`` tokens
    (``notify`` as in :func:`continue_or_translate`).

    Raises:
      ValueError: a source that does not fit the encoder.
    """
    max_length = model.config.max_length
    sources = _whole_sources(tokenizer, texts, max_length)
    _say_changes(tokenizer, texts, sources, max_new_tokens, max_length - 1, max_length, notify)
    batch, lengths = right_pad(sources, tokenizer.pad_id)
    new = min(max_new_tokens, max_length - 1)
    tokens, scores = beam_search(
        model, batch, beam_size=beam_size, alpha=alpha, **_seq2seq_ids(tokenizer, lengths, new)
    )
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
