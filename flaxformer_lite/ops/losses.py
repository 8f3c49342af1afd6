"""Token-level cross-entropy with label smoothing, z-loss and padding weights.

Everything is computed in float32 whatever the logits dtype. The smoothed loss is evaluated in
closed form from ``logsumexp``, the target logit and the mean logit, so no ``[..., V]`` one-hot or
smoothed-label array is ever built: with a 256k vocabulary that array would be as large as the
logits themselves. :func:`chunked_cross_entropy` goes further and never holds the logits of the
whole batch: it applies the output projection a block of positions at a time, and again in the
backward pass (levanter's blockwise cross-entropy, MaxText's vocabulary tiling).
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp


def _check_inputs(
    logits: jax.Array,
    targets: jax.Array,
    weights: jax.Array | None,
    label_smoothing: float,
) -> None:
    """Raises a ValueError (or TypeError) naming the offending shape, dtype or value."""
    if logits.ndim != targets.ndim + 1 or logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits must have shape targets.shape + (vocab,); got logits with shape "
            f"{logits.shape} and targets with shape {targets.shape}"
        )
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"targets must be an integer array; got dtype {targets.dtype}")
    if weights is not None and weights.shape != targets.shape:
        raise ValueError(
            f"weights must have the shape of targets {targets.shape}; got weights with shape "
            f"{weights.shape}"
        )
    if isinstance(label_smoothing, int | float) and not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1); got {label_smoothing}")


def _target_is_argmax(logits: jax.Array, targets: jax.Array, target_logit: jax.Array) -> jax.Array:
    """``jnp.argmax(logits, -1) == targets`` for ``[..., V]`` logits: the target is a class
    (``0 <= t < V``, where ``take_along_axis`` would wrap a negative one) that holds the maximum,
    and no earlier class does (argmax returns the first maximum). A row with a NaN never counts
    as correct, where argmax would point at its first NaN.

    Written with a max and a boolean any-reduce because XLA lowers ``argmax`` to a reduction
    over (value, index) pairs that its CPU backend does not vectorize, while these two reductions
    vectorize like the logsumexp beside them.
    """
    targets = targets.astype(jnp.int32)  # int8/uint8 ids would wrap when compared with positions
    max_logit = jnp.max(logits, axis=-1, keepdims=True)
    position = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    max_before_target = jnp.any((logits == max_logit) & (position < targets[..., None]), axis=-1)
    is_class = targets >= 0
    return is_class & (target_logit == max_logit[..., 0]) & ~max_before_target


def cross_entropy(
    logits: jax.Array,
    targets: jax.Array,
    *,
    weights: jax.Array | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Weighted mean softmax cross-entropy over tokens, with label smoothing and z-loss.

    Per token, with ``lse = logsumexp(logits)`` and ``α = label_smoothing``:

        ce = lse - [(1 - α) * logits[target] + α * mean_v(logits[v])]
        z  = z_loss * lse**2

    ``ce`` is exactly the cross-entropy against the smoothed distribution
    ``(1 - α) * onehot(target) + α / V`` (the ``optax.smooth_labels`` convention), so its
    gradient with respect to the logits is ``softmax(logits) - smoothed``. ``z`` is the auxiliary
    z-loss of PaLM and T5X, which pulls ``lse`` towards 0 to keep the softmax normalizer from
    drifting.

    Tokens are averaged with ``weights``; the denominator is ``max(sum(weights), 1e-8)`` so a
    batch that is all padding gives a loss of 0 (not NaN) and a zero gradient. Positions with
    weight 0 are excluded entirely: their logits and targets (even out-of-range padding ids such
    as -100) do not affect the loss or the metrics.

    Args:
      logits: ``[..., V]`` unnormalized scores, any float dtype (cast to float32).
      targets: ``[...]`` integer class ids in ``[0, V)`` wherever the weight is non-zero.
      weights: optional ``[...]`` float or bool per-token weights; None means all ones. Padding
        positions should have weight 0.
      label_smoothing: ``α`` in ``[0, 1)``: a Python float, or a scalar array (checked only as
        a float).
      z_loss: the coefficient of the z-loss term (a float or a scalar array); 0 disables it.

    Returns:
      A pair ``(loss, metrics)``. ``loss`` is a float32 scalar: the weighted mean of ``ce + z``,
      the value to differentiate. ``metrics`` maps to float32 scalars:
        - ``"loss"``: weighted mean of ``ce`` alone (comparable across z-loss settings),
        - ``"z_loss"``: weighted mean of ``z``,
        - ``"accuracy"``: weighted fraction of tokens whose argmax equals the target,
        - ``"num_tokens"``: ``sum(weights)``.

    Raises:
      ValueError: if the shapes of ``logits``, ``targets`` and ``weights`` disagree, or
        ``label_smoothing`` is outside ``[0, 1)``.
      TypeError: if ``targets`` is not an integer array.
    """
    logits = jnp.asarray(logits)
    targets = jnp.asarray(targets)
    weights = None if weights is None else jnp.asarray(weights)
    _check_inputs(logits, targets, weights, label_smoothing)
    return _weighted_mean(*_token_terms(logits, targets, label_smoothing, z_loss), weights)


def _token_terms(
    logits: jax.Array, targets: jax.Array, label_smoothing: float, z_loss: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per token, in float32: the smoothed cross-entropy ``ce``, the z-loss ``z`` and whether the
    target is the argmax (1.0 or 0.0), as :func:`cross_entropy` documents them."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    # A gather, not a one-hot product: O(tokens) memory instead of O(tokens * V).
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    smoothed_logit = (1.0 - label_smoothing) * target_logit
    # An array (a sweep member's number) always adds the term; 0 adds exactly nothing.
    if not isinstance(label_smoothing, int | float) or label_smoothing:
        smoothed_logit = smoothed_logit + label_smoothing * jnp.mean(logits, axis=-1)
    ce = lse - smoothed_logit
    z = z_loss * jnp.square(lse)
    correct = _target_is_argmax(logits, targets, target_logit).astype(jnp.float32)
    return ce, z, correct


def _weighted_mean(
    ce: jax.Array, z: jax.Array, correct: jax.Array, weights: jax.Array | None
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The loss and metrics of :func:`cross_entropy` from its per-token terms."""
    w = jnp.ones(ce.shape, jnp.float32) if weights is None else weights.astype(jnp.float32)
    num_tokens = jnp.sum(w)
    denominator = jnp.maximum(num_tokens, 1e-8)
    # An out-of-range padding target gathers NaN (JAX's default "fill" mode), and NaN * 0 is NaN, so
    # weight-0 positions are selected away rather than multiplied away. ``where`` also gives them an
    # exact zero gradient.
    keep = w != 0

    def weighted_mean(values: jax.Array) -> jax.Array:
        return jnp.sum(jnp.where(keep, values * w, 0.0)) / denominator

    metrics = {
        "loss": weighted_mean(ce),
        "z_loss": weighted_mean(z),
        "accuracy": weighted_mean(correct),
        "num_tokens": num_tokens,
    }
    return metrics["loss"] + metrics["z_loss"], metrics


def chunked_cross_entropy(
    hidden: jax.Array,
    targets: jax.Array,
    project: Callable[[jax.Array], jax.Array],
    *,
    chunk: int,
    weights: jax.Array | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """:func:`cross_entropy` of ``project(hidden)``, computed ``chunk`` positions at a time.

    The sequence is cut into blocks of ``chunk`` positions (the last one padded, its padding
    dropped); a ``lax.scan`` projects each block to its ``[B, chunk, V]`` logits and reduces them
    to per-token terms at once, under ``jax.checkpoint``, so the backward pass projects each block
    again rather than keeping its logits. Peak memory holds the logits (and their gradient) of
    one block instead of the whole ``[B, T, V]``; the loss, metrics and gradients are those of
    :func:`cross_entropy` up to the order of floating-point sums.

    Args:
      hidden: ``[B, T, D]`` features, the input of the output layer.
      targets: ``[B, T]`` integer class ids, as for :func:`cross_entropy`.
      project: ``[B, chunk, D] -> [B, chunk, V]`` logits, any float dtype; it may close over
        parameters (their gradients flow through it).
      chunk: positions per block, >= 1; one that does not divide ``T`` is fine.
      weights, label_smoothing, z_loss: as for :func:`cross_entropy`.

    Returns:
      ``(loss, metrics)`` as :func:`cross_entropy` returns them.

    Raises:
      ValueError: if ``hidden`` is not ``[B, T, D]`` over ``targets [B, T]``, ``chunk`` is not a
        positive integer, or as :func:`cross_entropy` raises for the logits of a block.
    """
    hidden = jnp.asarray(hidden)
    targets = jnp.asarray(targets)
    weights = None if weights is None else jnp.asarray(weights)
    if isinstance(label_smoothing, int | float) and not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1); got {label_smoothing}")
    _check_blocks(hidden, targets, weights, chunk)
    ce, z, correct = _blockwise(
        hidden,
        targets,
        project,
        chunk,
        lambda logits, block_targets: _token_terms(logits, block_targets, label_smoothing, z_loss),
        backward=True,
    )
    return _weighted_mean(ce, z, correct, weights)


def token_log_likelihood(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per token, in float32: ``log softmax(logits)[target]`` and whether the target is the
    argmax (the greedy choice), as ``[...]`` arrays: what a continuation's log-likelihood and
    lm-evaluation-harness's ``is_greedy`` sum and combine over its tokens.

    Args:
      logits: ``[..., V]`` unnormalized scores, any float dtype (cast to float32).
      targets: ``[...]`` integer class ids in ``[0, V)``.

    Raises:
      ValueError, TypeError: as :func:`cross_entropy`.
    """
    logits = jnp.asarray(logits)
    targets = jnp.asarray(targets)
    _check_inputs(logits, targets, None, 0.0)
    return _log_likelihood_terms(logits, targets)


def chunked_token_log_likelihood(
    hidden: jax.Array, targets: jax.Array, project: Callable[[jax.Array], jax.Array], *, chunk: int
) -> tuple[jax.Array, jax.Array]:
    """:func:`token_log_likelihood` of ``project(hidden)`` (``[B, T, D]`` features over
    ``[B, T]`` targets), ``chunk`` positions at a time as :func:`chunked_cross_entropy` walks
    them: the logits of the whole batch are never held."""
    hidden, targets = jnp.asarray(hidden), jnp.asarray(targets)
    _check_blocks(hidden, targets, None, chunk)
    return _blockwise(hidden, targets, project, chunk, _log_likelihood_terms, backward=False)


def _log_likelihood_terms(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    ce, _, correct = _token_terms(logits, targets, 0.0, 0.0)
    return -ce, correct.astype(bool)


def _check_blocks(hidden, targets, weights, chunk) -> None:
    """Raises ValueError unless ``hidden [B, T, D]`` lies over ``targets [B, T]`` (and
    ``weights``) and ``chunk`` is a positive integer."""
    if hidden.ndim != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(
            f"hidden must be [B, T, D] over targets [B, T]; got hidden with shape {hidden.shape} "
            f"and targets with shape {targets.shape}"
        )
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive integer; got {chunk!r}")
    if weights is not None and weights.shape != targets.shape:
        raise ValueError(
            f"weights must have the shape of targets {targets.shape}; got weights with shape "
            f"{weights.shape}"
        )


def _blockwise(hidden, targets, project, chunk: int, terms, *, backward: bool) -> tuple:
    """``terms(logits, targets)``'s per-token arrays ``[B, T]`` of ``logits = project(hidden)``,
    made ``chunk`` positions at a time by a ``lax.scan``; with ``backward`` each block is
    under ``jax.checkpoint``, so the backward pass projects it again rather than keeping its
    logits."""
    batch, length, width = hidden.shape
    chunk = min(chunk, length)
    blocks = -(-length // chunk)
    pad = blocks * chunk - length
    # Padded positions hold class 0 and zero features: finite terms, sliced off below.
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    padded_targets = jnp.pad(targets, ((0, 0), (0, pad)))
    # [n, B, chunk, ...]: the scan walks the blocks; the batch axis keeps its sharding.
    hidden = hidden.reshape(batch, blocks, chunk, width).swapaxes(0, 1)
    padded_targets = padded_targets.reshape(batch, blocks, chunk).swapaxes(0, 1)

    def block_terms(block_hidden, block_targets):
        logits = project(block_hidden)
        _check_inputs(logits, block_targets, None, 0.0)
        return terms(logits, block_targets)

    if backward:
        block_terms = jax.checkpoint(block_terms)
    _, per_block = jax.lax.scan(
        lambda carry, block: (carry, block_terms(*block)), None, (hidden, padded_targets)
    )
    return tuple(t.swapaxes(0, 1).reshape(batch, blocks * chunk)[:, :length] for t in per_block)
