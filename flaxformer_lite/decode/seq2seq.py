"""Decoding for :class:`~flaxformer_lite.models.EncoderDecoder`: the encoder runs once, its keys
and values for cross-attention are projected once into the cache, then the target is decoded
token by token — greedy or sampled (:func:`seq2seq_generate`), or by beam search
(:func:`beam_search`, the paper's beam 4 and length penalty alpha 0.6).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from flaxformer_lite.decode.generate import (
    check_lengths,
    check_model,
    check_new_tokens,
    run_program,
    sampling_loop,
)
from flaxformer_lite.decode.sampling import check_sampling
from flaxformer_lite.models import EncoderDecoder


def seq2seq_generate(
    model,
    src,
    *,
    max_new_tokens: int,
    src_lengths=None,
    sos_id: int = 1,
    eos_id: int | None = 2,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_tokens_to_keep: int = 1,
    rng: jax.Array | None = None,
    pad_id: int = 0,
) -> jax.Array:
    """Greedy (``temperature=0``) or sampled target sequences for each source.

    Args:
      model: an ``EncoderDecoder`` with a token vocabulary on the target side.
      src: int ``[B, S]`` sources (or float ``[B, S, input_dim]``); row ``b`` is its first
        ``src_lengths[b]`` positions, the rest is padding.
      max_new_tokens: N, the longest target.
      src_lengths: int ``[B]``; default ``S``.
      sos_id: the token the decoder starts from (the training data's shift token).
      eos_id: a row stops after emitting it.
      temperature, top_k, top_p, min_tokens_to_keep, rng: as in
        :func:`flaxformer_lite.decode.generate`.
      pad_id: written after a row's last token.

    Returns:
      int32 ``[B, max_new_tokens]``: the targets (without ``sos_id``), ``pad_id`` after ``eos_id``.
    """
    check_model(model, EncoderDecoder, "seq2seq_generate")
    src, src_mask = _source(src, src_lengths)
    check_new_tokens(max_new_tokens)
    check_sampling(temperature, top_k, top_p, rng, min_tokens_to_keep)
    graphdef, state = nnx.split(model)
    return run_program(
        _seq2seq_generate,
        graphdef,
        state,
        src,
        src_mask,
        jax.random.key(0) if rng is None else rng,
        max_new_tokens=max_new_tokens,
        sampling=(float(temperature), top_k, top_p, min_tokens_to_keep),
        sos_id=sos_id,
        eos_id=eos_id,
        pad_id=pad_id,
    )


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "max_new_tokens", "sampling", "sos_id", "eos_id", "pad_id"),
)
def _seq2seq_generate(
    graphdef, state, src, src_mask, rng, *, max_new_tokens, sampling, sos_id, eos_id, pad_id
):
    batch = src.shape[0]
    cache, logits, forward = _start_decoding(
        graphdef, state, src, src_mask, batch, max_new_tokens, sos_id
    )
    return sampling_loop(
        forward,
        cache,
        logits,
        rng,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        eos_id=eos_id,
        pad_id=pad_id,
    )


def beam_search(
    model,
    src,
    *,
    max_new_tokens: int,
    beam_size: int = 4,
    alpha: float = 0.6,
    src_lengths=None,
    sos_id: int = 1,
    eos_id: int | None = 2,
    pad_id: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """The ``beam_size`` best targets for each source, by length-normalized log-probability.

    A hypothesis ``Y`` scores ``log P(Y | src) / lp(Y)`` with the GNMT length penalty
    ``lp(Y) = ((5 + |Y|) / 6) ** alpha`` (``|Y|`` counts ``eos_id``); the paper used beam 4 and
    alpha 0.6. Each step extends the live beams by every token, keeps ``2 * beam_size``
    candidates (so ``beam_size`` of them are not finished), moves those ending in ``eos_id``
    into the finished set, and stops once no live beam can beat the worst finished one.
    Hypotheses still live at ``max_new_tokens`` compete with the finished ones.

    Args:
      model, src, src_lengths, sos_id, eos_id, pad_id: as in :func:`seq2seq_generate`.
      max_new_tokens: N, the longest target.
      beam_size: K.
      alpha: the length penalty exponent, >= 0 (0 ranks by log-probability).

    Returns:
      ``(tokens, scores)``: int32 ``[B, beam_size, max_new_tokens]`` targets (``pad_id`` after
      ``eos_id``) and float32 ``[B, beam_size]`` scores, best first.
    """
    check_model(model, EncoderDecoder, "beam_search")
    src, src_mask = _source(src, src_lengths)
    check_new_tokens(max_new_tokens)
    if not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"beam_size must be a positive int, got {beam_size!r}")
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    graphdef, state = nnx.split(model)
    return run_program(
        _beam_search,
        graphdef,
        state,
        src,
        src_mask,
        max_new_tokens=max_new_tokens,
        beam_size=beam_size,
        alpha=float(alpha),
        sos_id=sos_id,
        eos_id=eos_id,
        pad_id=pad_id,
        scanned=model.config.scan_layers,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "graphdef",
        "max_new_tokens",
        "beam_size",
        "alpha",
        "sos_id",
        "eos_id",
        "pad_id",
        "scanned",
    ),
)
def _beam_search(
    graphdef,
    state,
    src,
    src_mask,
    *,
    max_new_tokens,
    beam_size,
    alpha,
    sos_id,
    eos_id,
    pad_id,
    scanned,
):
    batch, k, n = src.shape[0], beam_size, max_new_tokens
    # Every source is repeated K times: row b * K + j is beam j of source b.
    src = jnp.repeat(src, k, axis=0)
    src_mask = jnp.repeat(src_mask, k, axis=0)
    cache, logits, forward = _start_decoding(graphdef, state, src, src_mask, batch * k, n, sos_id)

    def penalty(length):
        return ((5.0 + length) / 6.0) ** alpha

    def keep_going(carry):
        step, _, _, _, alive_logp, _, finished_scores = carry
        best_alive = alive_logp[:, 0] / penalty(n)  # no live beam can end better than this
        beaten = finished_scores[:, -1] >= best_alive
        return (step < n) & ~jnp.all(beaten)

    def one_step(carry):
        step, cache, logits, alive, alive_logp, finished, finished_scores = carry
        vocab = logits.shape[-1]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32)).reshape(batch, k, vocab)
        candidates = (alive_logp[:, :, None] + logp).reshape(batch, k * vocab)
        top_logp, top_index = jax.lax.top_k(candidates, 2 * k)
        parent, token = top_index // vocab, (top_index % vocab).astype(jnp.int32)
        seqs = jnp.take_along_axis(alive, parent[:, :, None], axis=1)
        seqs = jax.lax.dynamic_update_slice(seqs, token[:, :, None], (0, 0, step))
        ended = (token == eos_id) if eos_id is not None else jnp.zeros_like(token, jnp.bool_)

        new_scores = jnp.where(ended, top_logp / penalty(step + 1), -jnp.inf)
        finished, finished_scores = _best(
            jnp.concatenate([finished, seqs], axis=1),
            jnp.concatenate([finished_scores, new_scores], axis=1),
            k,
        )
        alive_logp, keep = jax.lax.top_k(jnp.where(ended, -jnp.inf, top_logp), k)
        alive = jnp.take_along_axis(seqs, keep[:, :, None], axis=1)
        rows = (jnp.arange(batch)[:, None] * k + jnp.take_along_axis(parent, keep, 1)).reshape(-1)
        cache = (_reorder_cache(cache[0], rows, scanned), cache[1])
        cache, logits = forward(cache, jnp.take_along_axis(token, keep, 1).reshape(-1), step)
        return step + 1, cache, logits, alive, alive_logp, finished, finished_scores

    alive = jnp.full((batch, k, n), pad_id, jnp.int32)
    # Only beam 0 is live at the start: the others would repeat its candidates.
    alive_logp = jnp.where(jnp.arange(k) == 0, 0.0, -jnp.inf)[None].repeat(batch, axis=0)
    finished_scores = jnp.full((batch, k), -jnp.inf)
    carry = (jnp.zeros((), jnp.int32), cache, logits, alive, alive_logp, alive, finished_scores)
    step, _, _, alive, alive_logp, finished, finished_scores = jax.lax.while_loop(
        keep_going, one_step, carry
    )
    return _best(
        jnp.concatenate([finished, alive], axis=1),
        jnp.concatenate([finished_scores, alive_logp / penalty(step)], axis=1),
        k,
    )


def _best(seqs, scores, k):
    """The ``k`` highest-scoring of ``seqs [B, candidates, length]`` / ``scores [B, candidates]``,
    best first."""
    scores, index = jax.lax.top_k(scores, k)
    return jnp.take_along_axis(seqs, index[:, :, None], axis=1), scores


def _reorder_cache(cache, rows, scanned: bool):
    """Gathers the cache's batch rows (``rows [B * beam_size]``: the parent beam of each new beam).

    Attention caches are ``[B * beam_size, Hk, S, Dh]`` (``[L, B * beam_size, ...]`` for scanned
    layers), the decode state's slot mask ``[B * beam_size, S]``; its scalar index is shared.
    """

    def gather(path, x):
        if x.ndim == 0:
            return x
        axis = 1 if scanned and "decode_state" not in path else 0
        return jnp.take(x, rows, axis=axis)

    return jax.tree.map_with_path(lambda path, x: gather(jax.tree_util.keystr(path), x), cache)


def _start_decoding(graphdef, state, src, src_mask, batch, max_new_tokens, sos_id):
    """Encodes ``src``, fills the cross-attention cache with the first decoder call (``sos``).

    Returns the loop state ``(cache, rest of the model state)``, the first logits ``[batch, V]``
    and ``forward(state, tokens [B], step) -> (state, logits [B, V])`` for :func:`sampling_loop`.
    """
    model = nnx.merge(graphdef, state)
    model.eval()
    encoded = model.encode(src, padding_mask=src_mask)
    # sos, then one slot per new token (the last one is fed but never read).
    model.init_cache(batch, max_new_tokens + 1, source_length=src.shape[1])
    start = jnp.full((batch, 1), sos_id, jnp.int32)
    logits = model.decode(start, encoded, padding_mask=src_mask, decode=True)[:, 0]
    cache_graph, cache, rest = nnx.split(model, nnx.Cache, ...)

    def forward(state, tokens, step):
        step_model = nnx.merge(cache_graph, *state)
        logits = step_model.decode(tokens[:, None], None, padding_mask=src_mask, decode=True)
        return (nnx.state(step_model, nnx.Cache), state[1]), logits[:, 0]

    return (cache, rest), logits, forward


def _source(src, src_lengths):
    """``src`` as an array and its padding mask ``[B, S]`` from ``src_lengths``."""
    src = jnp.asarray(src)
    if src.ndim not in (2, 3):
        raise ValueError(
            f"src must be [batch, length] tokens or [batch, length, features], "
            f"got {src.dtype}{src.shape}"
        )
    batch, length = src.shape[:2]
    lengths = check_lengths(src_lengths, batch, length, "src")
    return src, jnp.arange(length)[None, :] < jnp.asarray(lengths)[:, None]
