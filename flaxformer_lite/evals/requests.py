"""Requests, the unit every task is scored in: tokens of a context and of a continuation whose
log-likelihood is summed (and whether each of its tokens is the greedy choice). They are made
from text as lm-evaluation-harness's Hugging Face model makes them from our export (its
``loglikelihood``, ``_encode_pair`` and rolling windows), and packed several to a row.

    request = encode_pair(tokenizer, "Question: 2+2=?\\nAnswer:", " 4")
    for batch, requests in pack([request, ...], rows=8, length=64): ...

Tokens: a run's inputs start with ``<sos>`` (``tokenizer.add_bos``; an imported Hugging Face
tokenizer says whether its own do), so a context is ``<sos>`` and its text's tokens; the
continuation is the tokens of ``context + continuation`` past the context's (a tokenizer may
merge across the boundary), and the context's trailing spaces move to the continuation. An
empty context is ``<sos>`` alone. A request longer than ``length + 1`` tokens is cut from the
left, as lm-eval cuts it: the continuation is kept, the context's first tokens dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from flaxformer_lite.data.tokenizers import Tokenizer


@dataclasses.dataclass(frozen=True)
class Request:
    """Tokens to score: ``continuation``'s log-likelihood given ``context`` (never empty)."""

    context: tuple[int, ...]
    continuation: tuple[int, ...]

    def check(self, length: int) -> None:
        """Raises ValueError unless the request can be scored in a row of ``length``: a
        context, and a continuation of at most ``length`` tokens."""
        if not self.context:
            raise ValueError("a request needs a context, <sos> at least")
        if len(self.continuation) > length:
            raise ValueError(
                f"the continuation is {len(self.continuation)} tokens, more than the {length} "
                "positions a row scores"
            )

    def tokens(self, length: int) -> tuple[int, ...]:
        """The request's last ``length + 1`` tokens: a row's ``length`` inputs and targets."""
        return (self.context + self.continuation)[-(length + 1) :]

    def cut(self, length: int) -> bool:
        """Whether the context loses tokens in a row of ``length``."""
        return len(self.context) + len(self.continuation) > length + 1


def text_ids(tokenizer: Tokenizer, text: str) -> tuple[int, ...]:
    """``text``'s tokens as a model's input starts: after ``<sos>`` where the tokenizer's
    inputs start with it."""
    head = (tokenizer.sos_id,) if tokenizer.add_bos else ()
    return (*head, *tokenizer.encode(text))


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> Request:
    """The request that scores ``continuation`` after ``context`` (lm-eval's
    ``LM.loglikelihood``: ``_encode_pair``, and ``<sos>`` for an empty context).

    Raises:
      ValueError: ``continuation`` adds no token.
    """
    if not context:
        ids = tuple(tokenizer.encode(continuation))
        request = Request((tokenizer.sos_id,), ids)
        if ids[:1] == (tokenizer.sos_id,):
            request = Request(ids[:1], ids[1:])
    else:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = text_ids(tokenizer, context + continuation)
        head = text_ids(tokenizer, context)
        # A context of spaces alone, with no <sos> to start it: <sos> alone, as an empty one.
        request = Request(head or (tokenizer.sos_id,), whole[len(head) :])
    if not request.continuation:
        raise ValueError(f"the continuation {continuation!r} adds no token to its context")
    return request


def rolling_requests(ids: Sequence[int], prefix: int, length: int) -> list[Request]:
    """The requests that score every token of ``ids`` once, in windows of ``length`` (lm-eval's
    ``get_rolling_token_windows`` with ``context_len=1`` and ``make_disjoint_window``): the
    first predicts ``ids[:length]`` after ``prefix``, each next one the next ``length`` tokens
    (the last one fewer) after the tokens before them that fill its row."""
    ids = tuple(ids)
    if not ids:
        return []
    requests = [Request((prefix,), ids[:length])]
    done = min(length, len(ids))
    while done < len(ids):
        end = min(done + length, len(ids))
        requests.append(Request(ids[end - length - 1 : done], ids[done:end]))
        done = end
    return requests


def pack(
    requests: Sequence[Request], *, rows: int, length: int
) -> Iterator[tuple[dict[str, np.ndarray], list[int]]]:
    """``(batch, indices)``: batches of ``rows x length`` positions holding ``requests``, several
    to a row (longest first, each row filled until the next one does not fit), and the index
    in ``requests`` of the request each batch's ``request`` id ``k`` names (``indices[k]``).

    A batch is an ``lm`` batch (``inputs``, ``targets``, ``weights`` 1 at the continuation's
    targets, ``segment_ids`` and ``positions`` of packed rows) with ``request`` int ``[B, T]``;
    the last batch's unused rows are padding (weight 0).

    Raises:
      ValueError: a request that :meth:`Request.check` refuses.
    """
    for request in requests:
        request.check(length)
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i].tokens(length)))
    batch, indices, row, used = _empty(rows, length), [], 0, 0
    for index in order:
        request = requests[index]
        tokens = request.tokens(length)
        size = len(tokens) - 1
        if used + size > length:
            row, used = row + 1, 0
        if row == rows:
            yield batch, indices
            batch, indices, row = _empty(rows, length), [], 0
        span = slice(used, used + size)
        batch["inputs"][row, span] = tokens[:-1]
        batch["targets"][row, span] = tokens[1:]
        batch["weights"][row, used + size - len(request.continuation) : used + size] = 1.0
        batch["segment_ids"][row, span] = batch["segment_ids"][row].max() + 1
        batch["positions"][row, span] = np.arange(size)
        batch["request"][row, span] = len(indices)
        indices.append(index)
        used += size
    if indices:
        yield batch, indices


def _empty(rows: int, length: int) -> dict[str, np.ndarray]:
    ids = {key: np.zeros((rows, length), np.int32) for key in ("inputs", "targets")}
    packed = {key: np.zeros((rows, length), np.int32) for key in ("segment_ids", "positions")}
    return {
        **ids,
        "weights": np.zeros((rows, length), np.float32),
        **packed,
        "request": np.zeros((rows, length), np.int32),
    }
