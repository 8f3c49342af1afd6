"""Which attention implementation runs: the rules of each kernel and the automatic choice.

The choice is logged at trace time under the logger ``flaxformer_lite.ops.attention`` (that of
:func:`flaxformer_lite.ops.dot_product_attention`, where users look for it).
"""

from __future__ import annotations

import functools
import logging

import jax.numpy as jnp

from flaxformer_lite.ops.masks import combine_masks, segment_mask
from flaxformer_lite.ops.pallas_attention import pallas_unsupported_reason, target_platform

logger = logging.getLogger("flaxformer_lite.ops.attention")

# From this many float32 logits per call (B·H·T·S, 128 MiB of them) the automatic choice on
# CPU/TPU is "chunked": its memory stays O(T) for a little more time, where the O(T·S) buffers
# of "xla" would grow past hundreds of MiB.
CHUNKED_MIN_LOGITS = 8 * 2048 * 2048

GLOBAL_TOKENS_UNSUPPORTED = "global tokens are not supported"


def cudnn_unsupported_reason(
    query,
    key,
    value,
    bias,
    mask,
    *,
    is_causal,
    local_window,
    dropout_rate,
    backend=None,
    global_tokens=0,
) -> str:
    """Why cuDNN flash attention cannot run these inputs, or ``""`` if it can.

    ``backend`` defaults to the platform compiled for (:func:`.pallas_attention.target_platform`);
    tests pass ``"gpu"`` to check the rules.
    """
    backend = target_platform() if backend is None else backend
    head_dim, value_dim = query.shape[-1], value.shape[-1]
    if backend != "gpu":
        return f"needs a GPU, the backend is {backend!r}"
    if query.dtype not in (jnp.bfloat16, jnp.float16):
        return f"needs bfloat16 or float16 inputs, got {query.dtype}"
    if not query.dtype == key.dtype == value.dtype:
        return f"needs equal dtypes, got {query.dtype}, {key.dtype}, {value.dtype}"
    if head_dim != value_dim or head_dim > 128 or head_dim % 8:
        return f"needs equal head dims <= 128 divisible by 8, got {head_dim}, {value_dim}"
    if dropout_rate > 0.0:
        return "attention dropout is not supported"
    if global_tokens:
        return GLOBAL_TOKENS_UNSUPPORTED
    if (is_causal or local_window is not None) and query.shape[1] != key.shape[1]:
        return "causal or windowed masks with T != S align differently in cuDNN"
    if local_window is not None and local_window[1] != 0 and not is_causal:
        return f"a right window needs is_causal, got local_window={local_window}"
    if (bias is not None or mask is not None) and (query.shape[1] % 2 or key.shape[1] % 2):
        return f"a bias or mask needs even lengths, got T={query.shape[1]}, S={key.shape[1]}"
    return ""


@functools.lru_cache(maxsize=64)
def log_once(message: str) -> None:
    """Logs ``message`` at INFO the first time only: every layer traces the same choice."""
    logger.info(message)


def select_implementation(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    is_causal,
    local_window,
    dropout_rate,
    segment_ids=None,
    global_tokens=0,
) -> str:
    """The automatic choice: cuDNN where it runs, else on TPU "pallas" where it runs, else
    "chunked" for large logits, else "xla". ``mask`` rank 4 (or None) as the caller's, and
    ``segment_ids`` and ``global_tokens`` as :func:`flaxformer_lite.ops.dot_product_attention`
    takes them."""
    features = dict(is_causal=is_causal, local_window=local_window, dropout_rate=dropout_rate)
    full_mask = mask if segment_ids is None else combine_masks(mask, segment_mask(*segment_ids))
    reason = cudnn_unsupported_reason(
        query, key, value, bias, full_mask, **features, global_tokens=global_tokens
    )
    if not reason:
        logger.debug("attention: cudnn")
        return "cudnn"
    platform = target_platform()
    if platform == "gpu":
        log_once(f"attention: cuDNN not used ({reason})")
    if platform == "tpu":
        reason = GLOBAL_TOKENS_UNSUPPORTED if global_tokens else ""
        reason = reason or pallas_unsupported_reason(
            query, key, value, bias, mask, **features, platform=platform, segment_ids=segment_ids
        )
        if not reason:
            logger.debug("attention: pallas")
            return "pallas"
        log_once(f"attention: Pallas kernel not used ({reason})")
    b, t, h, _ = query.shape
    num_logits = b * h * t * key.shape[1]
    if num_logits >= CHUNKED_MIN_LOGITS:
        logger.debug("attention: chunked (%d logits >= %d)", num_logits, CHUNKED_MIN_LOGITS)
        return "chunked"
    logger.debug("attention: xla (%d logits < %d)", num_logits, CHUNKED_MIN_LOGITS)
    return "xla"
