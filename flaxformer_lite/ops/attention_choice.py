"""The implementations of attention, what each can run, and which one a call runs.

Each :class:`Backend` says why it cannot take a call (a reason, or ``None``) and how to run it;
the registry :data:`~flaxformer_lite.choices.ATTENTION` holds them by name, the built-in ones
and those a user adds with :func:`register_attention` (an attention function of their own:
sigmoid attention, a softmax with a +1), run wherever ``implementation=`` names them.
:func:`choose` returns a :class:`Choice`: the implementation that runs and why it passed over
the others. The choice is logged at trace time under the logger ``flaxformer_lite.ops.attention``
(that of :func:`flaxformer_lite.ops.dot_product_attention`, where users look for it), and
:func:`recorded_choices` hands the choices of a trace to a caller (``aot`` reports them).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator

import jax

from flaxformer_lite.choices import ATTENTION
from flaxformer_lite.ops.attention_inputs import AttentionCall
from flaxformer_lite.ops.chunked import chunked_attention
from flaxformer_lite.ops.cudnn_attention import cudnn_attention, cudnn_unsupported_reason
from flaxformer_lite.ops.pallas_attention import pallas_attention, pallas_unsupported_reason
from flaxformer_lite.ops.xla_attention import xla_attention, xla_weights

logger = logging.getLogger("flaxformer_lite.ops.attention")

# From this many float32 logits per call (B·H·T·S, 128 MiB of them) the automatic choice on
# CPU/TPU is "chunked": its memory stays O(T) for a little more time, where the O(T·S) buffers
# of "xla" would grow past hundreds of MiB.
CHUNKED_MIN_LOGITS = 8 * 2048 * 2048


def _no_reason(call: AttentionCall) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Backend:
    """One implementation of :func:`flaxformer_lite.ops.dot_product_attention`.

    Attributes:
      name: its ``implementation`` name.
      run: ``[B, T, H, Dv]`` of a call it can run.
      unsupported: why it cannot run a call, or ``None`` if it can.
      not_automatic: why the automatic choice passes over it for a call, or ``None``.
      home: the platform whose own kernel it is: passed over there, it is logged once at INFO.
      falls_back: a request for it that it cannot run falls back on the automatic choice
        (else it is a ValueError).
      weights: float32 ``[B, H, T, S]``, the attention weights of a call (for attention maps;
        softmax's for the built-in ones), or ``None`` if it has none to show.
      takes_query_positions: it reads ``call.mask.query_positions`` itself; the others see
        calls with them folded into the explicit mask (``AttentionCall.positions_folded``).
    """

    name: str
    run: Callable[[AttentionCall], jax.Array]
    unsupported: Callable[[AttentionCall], str | None] = _no_reason
    not_automatic: Callable[[AttentionCall], str | None] = _no_reason
    home: str | None = None
    falls_back: bool = False
    weights: Callable[[AttentionCall], jax.Array] | None = xla_weights
    takes_query_positions: bool = False

    def sees(self, call: AttentionCall) -> AttentionCall:
        """``call`` as this implementation takes it."""
        return call if self.takes_query_positions else call.positions_folded()

    def __call__(self, call: AttentionCall) -> jax.Array:
        """``[B, T, H, Dv]``: ``call`` run by this implementation."""
        return self.run(self.sees(call))


def _not_on_tpu(call: AttentionCall) -> str | None:
    return None if call.platform == "tpu" else "chosen automatically on TPU only"


def _small(call: AttentionCall) -> str | None:
    b, t, h, _ = call.query.shape
    logits = b * h * t * call.key.shape[1]
    return f"{logits} logits < {CHUNKED_MIN_LOGITS}" if logits < CHUNKED_MIN_LOGITS else None


def _chunked(call: AttentionCall) -> jax.Array:
    # Segment ids go in as ids: the kernel masks each block by them, where folded into the
    # mask they would be a dense [B, 1, T, S] array.
    args, flags = call.arguments(takes_segment_ids=True)
    dropout = dict(dropout_rate=call.dropout_rate, dropout_rng=call.dropout_rng)
    mask = call.mask
    return chunked_attention(
        *args,
        **flags,
        global_tokens=mask.global_tokens,
        query_positions=mask.query_positions,
        **dropout,
    )


# The built-in implementations, named in :data:`~flaxformer_lite.choices.ATTENTION` in the order
# the automatic choice tries them: the first that runs a call and is not passed over
# automatically runs it.
CUDNN = Backend("cudnn", cudnn_attention, cudnn_unsupported_reason, home="gpu")
PALLAS = Backend(
    "pallas", pallas_attention, pallas_unsupported_reason, _not_on_tpu, home="tpu", falls_back=True
)
CHUNKED = Backend("chunked", _chunked, not_automatic=_small, takes_query_positions=True)
XLA = Backend("xla", xla_attention)
IMPLEMENTATIONS = ATTENTION.builtin  # "xla", the last, runs every call


def named_backend(name: str, fn: Callable[[AttentionCall], jax.Array] | Backend) -> Backend:
    """The :class:`Backend` that runs ``fn`` wherever ``name`` is asked for (an import path's
    function, with its ``weights`` attribute if it has one)."""
    if isinstance(fn, Backend):
        return fn
    return Backend(name, fn, not_automatic=_named_only, weights=getattr(fn, "weights", None))


def register_attention(
    name: str,
    fn: Callable[[AttentionCall], jax.Array],
    *,
    weights: Callable[[AttentionCall], jax.Array] | None = None,
) -> None:
    """Makes ``fn`` the attention implementation ``name``: ``ops.dot_product_attention(...,
    implementation=name)`` and ``model.attention_implementation=name`` run it, in training,
    evaluation, KV-cache decoding, sharded meshes and sweeps. Registering a name again replaces
    it; the automatic choice never picks it.

    Args:
      name: a name of letters, digits, ``_``, ``-`` and ``.`` other than a built-in one.
      fn: ``fn(call) -> [B, T, H, Dv]`` in the query's dtype: the attention of one
        :class:`~.attention_inputs.AttentionCall` (its docstring says what it holds: queries,
        keys and values after RoPE, the bias, the mask with ``call.dense_mask()``, the scale,
        dropout, and the KV cache when decoding). A pure function of its arrays: it is traced
        under ``jit``, ``grad``, ``vmap`` and ``scan``.
      weights: ``weights(call) -> float32 [B, H, T, S]``, the weights ``fn`` gives each key,
        for attention maps (default: ``fn.weights`` if ``fn`` has that attribute, as a function
        named by an import path may); without one, maps of this implementation are refused.

    Raises:
      ValueError: ``name`` is built in or not such a name; ``fn`` or ``weights`` not callable.
    """
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "_-." for c in name):
        raise ValueError(
            "an attention implementation's name is letters, digits, _, - and . (an import path "
            f"module:attr needs no registering), got {name!r}"
        )
    if name in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation {name!r} is built in; choose another name")
    for what, value in (("fn", fn), ("weights", weights)):
        if value is not None and not callable(value):
            raise ValueError(f"register_attention({name!r}): {what} is not callable: {value!r}")
    weights = getattr(fn, "weights", None) if weights is None else weights
    ATTENTION.register(name, Backend(name, fn, not_automatic=_named_only, weights=weights))


def _named_only(call: AttentionCall) -> str:
    return "runs only when named"


@dataclasses.dataclass(frozen=True)
class Choice:
    """The implementation a call runs (``backend``), the one it asked for (``requested``,
    ``None`` for the automatic choice), and ``(implementation, reason)`` for each passed over,
    in the order tried."""

    backend: str
    requested: str | None
    passed_over: tuple[tuple[str, str], ...] = ()


def choose(call: AttentionCall, implementation: str | None = None) -> Choice:
    """The implementation that runs ``call``, when ``implementation`` is requested (``None``:
    the automatic choice); logged, and recorded for :func:`recorded_choices`.

    Raises:
      ValueError: an unknown implementation, or one that cannot run ``call`` and does not fall
        back.
    """
    passed_over = []
    if implementation is not None:
        if implementation not in ATTENTION.entries:
            raise ValueError(
                f"implementation must be one of {tuple(ATTENTION.entries)} or None (others are "
                f"added by ops.register_attention), got {implementation!r}"
            )
        backend = ATTENTION.resolve(implementation)
        reason = backend.unsupported(backend.sees(call))
        if reason is None:
            return _recorded(Choice(implementation, implementation), call)
        if not backend.falls_back:
            raise ValueError(f'implementation="{implementation}" cannot run these inputs: {reason}')
        passed_over.append((implementation, reason))
    for name in IMPLEMENTATIONS:
        backend = ATTENTION.resolve(name)
        if name == implementation:
            continue
        seen = backend.sees(call)
        reason = backend.not_automatic(seen) or backend.unsupported(seen)
        if reason is None:
            break  # "xla", the last, runs every call
        passed_over.append((backend.name, reason))
    return _recorded(Choice(backend.name, implementation, tuple(passed_over)), call)


def run(call: AttentionCall, implementation: str | None = None) -> jax.Array:
    """``[B, T, H, Dv]``: ``call`` run by the implementation :func:`choose` picks."""
    return ATTENTION.resolve(choose(call, implementation).backend)(call)


_RECORDS: contextvars.ContextVar[list[Choice] | None] = contextvars.ContextVar(
    "attention_choices", default=None
)


@contextlib.contextmanager
def recorded_choices() -> Iterator[list[Choice]]:
    """Collects the :class:`Choice` of every attention traced in the block, in order."""
    choices: list[Choice] = []
    token = _RECORDS.set(choices)
    try:
        yield choices
    finally:
        _RECORDS.reset(token)


@functools.lru_cache(maxsize=64)
def log_once(message: str) -> None:
    """Logs ``message`` at INFO the first time only: every layer traces the same choice."""
    logger.info(message)


def _recorded(choice: Choice, call: AttentionCall) -> Choice:
    """``choice``, logged and recorded."""
    for name, reason in choice.passed_over:
        if name == choice.requested:
            log_once(f'attention: implementation="{name}" falls back ({reason})')
        elif ATTENTION.resolve(name).home == call.platform:
            log_once(f"attention: {name} not used ({reason})")
    if choice.requested != choice.backend:
        reasons = "; ".join(f"not {name}: {reason}" for name, reason in choice.passed_over)
        logger.debug("attention: %s (%s)", choice.backend, reasons)
    records = _RECORDS.get()
    if records is not None:
        records.append(choice)
    return choice
