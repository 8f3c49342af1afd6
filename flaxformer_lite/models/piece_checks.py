"""A user's pieces (:mod:`.pieces`) checked before a model is built: each one not built in is
imported (in trusted code) and traced on small inputs, so that a piece that fails or returns the
wrong shape is named, by its setting, in one line before a run writes anything."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from flaxformer_lite import ops

if TYPE_CHECKING:
    from flaxformer_lite.models.config import ModelConfig

from flaxformer_lite.choices import ATTENTION, FEED_FORWARDS, NORMS, POSITION_BIASES
from flaxformer_lite.models.pieces import piece_settings, user_pieces
from flaxformer_lite.registry import first_line


def check_pieces(cfg: ModelConfig) -> None:
    """Imports (in trusted code) and traces each piece of ``cfg`` that is not built in on
    ``[2, T, D]`` inputs (T at most 8): called where a model is built.

    Raises:
      ValueError: one line naming the setting: its code is not trusted or does not import, or
        it fails or returns the wrong shape when traced.
    """
    pieces = user_pieces(cfg)
    objects = tuple(
        (setting, registry.resolve(pieces[setting]))
        for registry, _ in piece_settings(cfg)
        if (setting := registry.setting) in pieces
    )
    if objects:
        _check_traced(cfg, objects)


@functools.lru_cache(maxsize=64)
def _check_traced(cfg: ModelConfig, objects: tuple) -> None:
    """The traces of :func:`check_pieces`, once per config and objects."""
    registries = {registry.setting: registry for registry, _ in piece_settings(cfg)}
    for setting, obj in objects:
        registry, value = registries[setting], getattr(cfg, setting.removeprefix("model."))
        given, wanted, piece = _probe(setting, obj, cfg)
        try:
            out = jax.eval_shape(piece)
        except Exception as error:  # the user's code may raise anything
            raise ValueError(
                f"{setting}={value!r} fails on {given} ({type(error).__name__}: "
                f"{first_line(error)}); expected {registry.contract}"
            ) from error
        _check_output(setting, value, registry.contract, out, wanted, given)


def _probe(setting: str, obj, cfg: ModelConfig) -> tuple[str, tuple, Callable[[], Any]]:
    """``(the inputs in words, the wanted output shape, a function running the piece on
    them)``: two rows of at most 8 positions, causal in a decoder."""
    b, t, dtype = 2, min(8, cfg.max_length), jnp.dtype(cfg.dtype)
    causal = cfg.kind.generates
    num_layers = max(cfg.num_encoder_layers, cfg.num_decoder_layers)
    x = jnp.zeros((b, t, cfg.d_model), dtype)

    def rngs():
        return nnx.Rngs(params=0, dropout=1)

    if setting == ATTENTION.setting:
        q = jnp.zeros((b, t, cfg.num_heads, cfg.head_dim), dtype)
        kv = jnp.zeros((b, t, cfg.num_kv_heads, cfg.head_dim), dtype)
        value = cfg.attention_implementation
        return (
            f"query {list(q.shape)}, key and value {list(kv.shape)}",
            q.shape,
            lambda: ops.dot_product_attention(q, kv, kv, is_causal=causal, implementation=value),
        )
    if setting == POSITION_BIASES.setting:
        positions = jnp.arange(t)
        return (
            f"positions [{t}] and [{t}]",
            (1, cfg.num_heads, t, t),
            lambda: obj(cfg, bidirectional=not causal, rngs=rngs())(positions, positions),
        )
    given = f"x {list(x.shape)} {dtype}"
    if setting == NORMS.setting:
        return given, x.shape, lambda: obj(cfg, rngs=rngs())(x)
    if setting == FEED_FORWARDS.setting:
        return given, x.shape, lambda: obj(cfg, num_layers=num_layers, rngs=rngs())(x)
    options = dict(mask=None, bias=None, positions=None, cache_index=None, segment_ids=None)
    return (
        given,
        x.shape,
        lambda: obj(cfg, num_layers=num_layers, rngs=rngs())(x, is_causal=causal, **options),
    )


def _check_output(setting, value, contract, out, wanted: tuple, given: str) -> None:
    """Raises a ValueError unless ``out`` is a float array of the ``wanted`` shape (a position
    bias may be shared by the heads: ``[1, 1, T, S]``)."""
    shape = tuple(getattr(out, "shape", ()))
    ok = hasattr(out, "dtype") and jnp.issubdtype(out.dtype, jnp.floating)
    if setting == POSITION_BIASES.setting:
        ok = ok and len(shape) == 4 and shape[1] in (1, wanted[1])
        ok = ok and shape[0] == 1 and shape[2:] == wanted[2:]
    else:
        ok = ok and shape == tuple(wanted)
    if not ok:
        got = f"{out.dtype}{list(shape)}" if hasattr(out, "dtype") else type(out).__name__
        raise ValueError(
            f"{setting}={value!r} returns {got} for {given}, expected a float "
            f"{list(wanted)} ({contract})"
        )


class PieceError(ValueError):
    """A user's piece failed in a run's first step (bad input: nothing of the run is kept)."""


def failed_with_pieces(error: Exception, cfg: ModelConfig) -> PieceError | None:
    """The one-line error for ``error``, raised by the first train step of a model of ``cfg``
    whose pieces include a user's (they passed :func:`check_pieces` on small inputs, not at the
    run's shapes): it names them; None for a model of built-in pieces only."""
    pieces = user_pieces(cfg)
    if not pieces:
        return None
    named = ", ".join(f"{setting}={value!r}" for setting, value in pieces.items())
    return PieceError(
        f"the first train step failed ({type(error).__name__}: {first_line(error)}) in a model "
        f"with code of yours, {named}: it traced on small inputs, not on the run's "
        f"(train.batch_size x data.seq_len); check it at those shapes"
    )
