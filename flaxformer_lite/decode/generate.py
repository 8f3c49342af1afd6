"""Autoregressive generation for :class:`~flaxformer_lite.models.DecoderLM` through a fixed-size
KV cache, the whole loop compiled into one program.

Prompts of different lengths share a batch: each row is right-aligned in the cache (padding
slots first, masked out of attention) and carries its own positions, so one prefill call reads
every prompt and all rows then decode in lockstep. Rows that emit ``eos_id`` stop and are padded
from there on; the loop ends when every row has stopped or ``max_new_tokens`` are made.

Under :func:`compile_only` the decoding programs are compiled, not run.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxformer_lite.decode.sampling import check_sampling, next_token
from flaxformer_lite.models import DecoderLM


def generate(
    model,
    prompt_tokens,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_tokens_to_keep: int = 1,
    eos_id: int | None = None,
    rng: jax.Array | None = None,
    prompt_lengths=None,
    pad_id: int = 0,
) -> jax.Array:
    """Continues each prompt by up to ``max_new_tokens`` tokens.

    Args:
      model: a ``DecoderLM`` (any positions, GQA, scanned or looped layers); it is not changed.
      prompt_tokens: int ``[B, T]``; row ``b`` holds its prompt in the first
        ``prompt_lengths[b]`` entries (the rest is ignored).
      max_new_tokens: N, the most tokens to add to each row.
      temperature: 0 picks the most likely token (greedy); above 0 samples from
        ``softmax(logits / temperature)`` restricted by ``top_k`` / ``top_p``.
      top_k, top_p: keep the k most likely tokens / the smallest set reaching probability p.
      min_tokens_to_keep: ``top_k`` and ``top_p`` keep at least this many tokens.
      eos_id: a row stops after emitting this token (it is kept; ``pad_id`` follows).
      rng: a ``jax.random.key``, needed when sampling; the same key gives the same tokens.
      prompt_lengths: int ``[B]`` in ``[1, T]``; default ``T`` for every row.
      pad_id: written after a row's last token.

    Returns:
      int32 ``[B, T + max_new_tokens]``: row ``b`` is its prompt, its new tokens, then ``pad_id``.
    """
    check_model(model, DecoderLM, "generate")
    prompt_tokens = jnp.asarray(prompt_tokens)
    if prompt_tokens.ndim != 2 or not jnp.issubdtype(prompt_tokens.dtype, jnp.integer):
        raise ValueError(
            f"prompt_tokens must be int [batch, length], got {prompt_tokens.dtype}"
            f"{prompt_tokens.shape}"
        )
    batch, length = prompt_tokens.shape
    lengths = check_lengths(prompt_lengths, batch, length, "prompt")
    check_new_tokens(max_new_tokens)
    check_sampling(temperature, top_k, top_p, rng, min_tokens_to_keep)
    graphdef, state = nnx.split(model)
    return run_program(
        _generate,
        graphdef,
        state,
        prompt_tokens.astype(jnp.int32),
        jnp.asarray(lengths, jnp.int32),
        jax.random.key(0) if rng is None else rng,
        max_new_tokens=max_new_tokens,
        sampling=(float(temperature), top_k, top_p, min_tokens_to_keep),
        eos_id=eos_id,
        pad_id=pad_id,
    )


@functools.partial(
    jax.jit, static_argnames=("graphdef", "max_new_tokens", "sampling", "eos_id", "pad_id")
)
def _generate(graphdef, state, prompt, lengths, rng, *, max_new_tokens, sampling, eos_id, pad_id):
    batch, length = prompt.shape
    shift = length - lengths  # padding slots before each right-aligned prompt
    slots = jnp.arange(length)[None, :]
    aligned = jnp.take_along_axis(prompt, jnp.maximum(slots - shift[:, None], 0), axis=1)
    valid = slots >= shift[:, None]
    aligned = jnp.where(valid, aligned, pad_id)

    model = nnx.merge(graphdef, state)
    model.eval()
    model.init_cache(batch, length + max_new_tokens)
    positions = jnp.maximum(slots - shift[:, None], 0)
    logits = model(aligned, positions=positions, padding_mask=valid, decode=True)[:, -1]
    cache_graph, cache, rest = nnx.split(model, nnx.Cache, ...)

    def forward(state, tokens, step):
        step_model = nnx.merge(cache_graph, *state)
        logits = step_model(tokens[:, None], positions=(lengths + step)[:, None], decode=True)
        return (nnx.state(step_model, nnx.Cache), state[1]), logits[:, 0]

    new_tokens = sampling_loop(
        forward,
        (cache, rest),
        logits,
        rng,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        eos_id=eos_id,
        pad_id=pad_id,
    )
    # Back to left-aligned rows: prompt, new tokens, padding.
    joined = jnp.concatenate([aligned, new_tokens], axis=1)
    source = jnp.arange(length + max_new_tokens)[None, :] + shift[:, None]
    inside = source < length + max_new_tokens
    out = jnp.take_along_axis(joined, jnp.where(inside, source, 0), axis=1)
    return jnp.where(inside, out, pad_id)


_compiling = threading.local()


@contextlib.contextmanager
def compile_only():
    """Within the block, on this thread, :func:`generate`, ``seq2seq_generate`` and
    ``beam_search`` compile their program for their inputs' shapes and shardings, into JAX's
    caches, and return zeros of its result's shape instead of running it: a caller's whole
    decoding path runs through, on a model whose state may be ``jax.ShapeDtypeStruct``s, and a
    later call with inputs like these runs without compiling."""
    outer, _compiling.on = getattr(_compiling, "on", False), True
    try:
        yield
    finally:
        _compiling.on = outer


def run_program(program, *args, **static):
    """``program(*args, **static)`` for a jitted ``program``; under :func:`compile_only`, its
    compilation, and numpy zeros shaped like its result."""
    if not getattr(_compiling, "on", False):
        return program(*args, **static)
    compiled = program.lower(*args, **static).compile()
    return jax.tree.map(lambda out: np.zeros(out.shape, out.dtype), compiled.out_info)


def sampling_loop(
    forward: Callable,
    state,
    logits: jax.Array,
    rng: jax.Array,
    *,
    max_new_tokens: int,
    sampling: tuple[float, int | None, float | None, int],
    eos_id: int | None,
    pad_id: int,
) -> jax.Array:
    """Picks a token from ``logits [B, V]``, feeds it with ``forward(state, tokens [B], step) ->
    (state, logits)``, and repeats in a ``lax.while_loop`` until every row has emitted ``eos_id``
    or ``max_new_tokens`` steps have run. ``sampling`` is ``(temperature, top_k, top_p,
    min_tokens_to_keep)`` of :func:`next_token`.

    Returns int32 ``[B, max_new_tokens]``, ``pad_id`` after each row's ``eos_id``.
    """
    temperature, top_k, top_p, min_tokens_to_keep = sampling
    batch = logits.shape[0]
    tokens = jnp.full((batch, max_new_tokens), pad_id, jnp.int32)
    done = jnp.zeros((batch,), jnp.bool_)

    def keep_going(carry):
        step, _, _, _, done, _ = carry
        return (step < max_new_tokens) & ~jnp.all(done)

    def one_step(carry):
        step, state, logits, tokens, done, rng = carry
        rng, key = jax.random.split(rng)
        picked = next_token(
            key,
            logits,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_tokens_to_keep=min_tokens_to_keep,
        )
        token = jnp.where(done, pad_id, picked)
        tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, step))
        if eos_id is not None:
            done = done | (token == eos_id)
        state, logits = forward(state, token, step)
        return step + 1, state, logits, tokens, done, rng

    # The model's state travels in the carry: closing over it from the enclosing trace would
    # hand nnx.scan (scanned layers) variables of another trace level.
    carry = (jnp.zeros((), jnp.int32), state, logits, tokens, done, rng)
    return jax.lax.while_loop(keep_going, one_step, carry)[3]


def check_lengths(lengths, batch: int, length: int, what: str) -> np.ndarray:
    """``lengths`` as int ``[B]`` in ``[1, length]`` (default: all ``length``)."""
    if lengths is None:
        return np.full((batch,), length, np.int32)
    lengths = np.asarray(lengths)
    if lengths.shape != (batch,) or not np.issubdtype(lengths.dtype, np.integer):
        got = f"{lengths.dtype}{lengths.shape}"
        raise ValueError(f"{what}_lengths must be int [{batch}], got {got}")
    if lengths.min() < 1 or lengths.max() > length:
        raise ValueError(f"{what}_lengths must be in [1, {length}], got {lengths.tolist()}")
    return lengths.astype(np.int32)


def check_model(model, expected: type, what: str) -> None:
    if not isinstance(model, expected):
        raise ValueError(f"{what} takes a {expected.__name__}, got {type(model).__name__}")


def check_new_tokens(max_new_tokens: int) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")


def right_pad(rows, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token lists of different lengths -> int32 ``[B, max_len]`` (padded after each row) and
    their lengths ``[B]``: the ``prompt_tokens`` / ``prompt_lengths`` of :func:`generate`."""
    rows = [list(r) for r in rows]
    if not rows or not all(rows):
        raise ValueError("need at least one row, and no empty row")
    batch = np.full((len(rows), max(len(r) for r in rows)), pad_id, np.int32)
    for i, row in enumerate(rows):
        batch[i, : len(row)] = row
    return batch, np.array([len(r) for r in rows], np.int32)


def until_eos(ids, eos_id: int | None) -> list[int]:
    """The tokens of one generated row before its first ``eos_id``."""
    ids = np.asarray(ids).tolist()
    return ids[: ids.index(eos_id)] if eos_id in ids else ids
