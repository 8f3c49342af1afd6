"""Flash attention through jax's Pallas kernels: Mosaic on TPU, Triton on GPU.

:func:`tpu_flash_attention` runs ``jax.experimental.pallas.ops.tpu.flash_attention`` and
:func:`gpu_flash_attention` runs ``jax.experimental.pallas.ops.gpu.attention.mha``, both with the
conventions of :func:`flaxformer_lite.ops.dot_product_attention` (``[B, T, H, Dh]`` layout, GQA,
rows without a visible key are zeros). The kernels take masks only as causal masks and segment
ids (a query sees the keys of its own segment), so :func:`pallas_unsupported_reason` says which
inputs they cannot run, for the caller to fall back on another implementation:

* a key padding mask (bool ``[B, 1, 1, S]``, as the models build one) becomes key segment ids,
  padded keys getting an id no query has (TPU; the GPU kernel has one id array for both sides);
* lengths are padded to the kernels' blocks with such keys, and cut off the result;
* grouped-query attention repeats each key/value head over its G query heads, as the kernels
  need equal head counts (the repeat's gradient sums them back);
* an additive bias, local windows, dropout, a mask that varies over queries or heads, a
  causal mask with ``T != S`` (the kernels align it top-left, ours bottom-right) and
  ``Dv != Dh`` are not taken.

Mosaic kernels cannot be partitioned by XLA: under a mesh (``jax.set_mesh``) the TPU kernel runs
in ``shard_map``, each device on its part of the batch and heads (:func:`kernel_mesh_axes`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import attention as gpu_attention
from jax.experimental.pallas.ops.tpu import flash_attention as tpu_attention
from jax.sharding import PartitionSpec

from flaxformer_lite.ops.attention_inputs import AttentionCall, default_scale

# Query and key blocks of both kernels: their defaults, and the TPU kernel's minimum (its lane
# width). Lengths are padded to a multiple of this.
BLOCK = 128

# The mesh axes that split attention heads in flaxformer_lite.parallel's layout (the Megatron
# "tensor" axis); every other mesh axis splits the batch, as the activations are.
HEAD_MESH_AXES = ("tensor",)

# Segment ids are compared for equality only. Kernel ids are 2·id for real tokens and this odd
# id for padded keys (masked padding, length padding), which no query's id equals.
PADDED_KEY_ID = 1


def pallas_unsupported_reason(call: AttentionCall) -> str | None:
    """Why the Pallas kernel of ``call.platform`` ("tpu" or "gpu") cannot run ``call``, or
    ``None`` if it can. Its explicit mask may be a key padding mask ``[B | 1, 1, 1, S]``, and
    segment ids are taken on TPU."""
    query, key, value, mask = call.query, call.key, call.value, call.mask
    platform, is_causal = call.platform, mask.is_causal
    has_mask = mask.explicit is not None or mask.segment_ids is not None
    (_, t, _, head_dim), s, value_dim = query.shape, key.shape[1], value.shape[-1]
    if mask.global_tokens:
        return "global tokens are not supported"
    if platform not in ("tpu", "gpu"):
        return f"needs a TPU or GPU, the platform is {platform!r}"
    if call.bias is not None:
        return "an additive bias is not supported"
    if mask.local_window is not None:
        return "local windows are not supported"
    if call.dropout_rate > 0.0:
        return "attention dropout is not supported"
    if is_causal and t != s:
        return f"a causal mask needs T == S (the kernels align it top-left), got T={t}, S={s}"
    if not query.dtype == key.dtype == value.dtype:
        return f"needs equal dtypes, got {query.dtype}, {key.dtype}, {value.dtype}"
    if head_dim != value_dim:
        return f"needs Dv == Dh, got Dh={head_dim}, Dv={value_dim}"
    if platform == "gpu" and t != s and (t % BLOCK or s % BLOCK):
        return f"needs T == S unless both are multiples of {BLOCK}, got T={t}, S={s}"
    if platform == "tpu" and head_dim > BLOCK and head_dim % BLOCK:
        return f"needs Dh <= {BLOCK} or a multiple of {BLOCK}, got {head_dim}"
    if platform == "gpu" and has_mask:
        return "masks and segment ids are not supported (the GPU kernel takes causal masks only)"
    if mask.explicit is not None and mask.explicit.shape[1:3] != (1, 1):
        return f"only key padding masks [B, 1, 1, S] are supported, got {mask.explicit.shape}"
    return None


def tpu_flash_attention(
    query, key, value, *, scale, is_causal, key_valid=None, segment_ids=None, block_sizes=None
):
    """Pallas TPU flash attention with our conventions.

    Args:
      query, key, value: ``[B, T, H, Dh]``, ``[B, S, Hk, Dh]``, ``[B, S, Hk, Dh]``.
      scale: the logits' multiplier.
      is_causal: causal mask (needs ``T == S``).
      key_valid: optional bool ``[B, S]`` or ``[1, S]``, False at padded keys.
      segment_ids: optional int ``(q [B, T], kv [B, S])``: a query sees only keys with its id
        (ids below 2**30).
      block_sizes: the kernel's ``BlockSizes``; default ``BLOCK`` everywhere.

    Returns:
      ``[B, T, H, Dh]`` in the query's dtype; zeros in rows without a visible key.
    """
    b, t, h, _ = query.shape
    kernel_ids = _kernel_segment_ids(b, t, key.shape[1], key_valid, segment_ids)
    query, key, value, ids = _padded_to_blocks(query, key, value, kernel_ids)
    query, key, value = (x.swapaxes(1, 2) for x in _equal_heads(query, key, value))
    kernel = functools.partial(
        _tpu_kernel, scale=scale, is_causal=is_causal, block_sizes=block_sizes
    )
    out = _sharded_over_batch_and_heads(kernel, query, key, value, ids)
    return _zero_rows_without_keys(out.swapaxes(1, 2)[:, :t], kernel_ids, is_causal)


def gpu_flash_attention(query, key, value, *, scale, is_causal, interpret=False):
    """Pallas GPU (Triton) flash attention with our conventions, without masks but causal.

    Args: as :func:`tpu_flash_attention`; ``interpret`` runs the kernel in Pallas' interpreter
    (on any backend, for tests).

    Returns:
      ``[B, T, H, Dh]`` in the query's dtype.
    """
    t = query.shape[1]
    # The kernel takes one id array for queries and keys: that of the keys, where padded
    # positions have their own id, so that no real query sees a padded key.
    query, key, value, ids = _padded_to_blocks(query, key, value, None)
    query, key, value = _equal_heads(query, key, value)
    out = gpu_attention.mha(
        query,
        key,
        value,
        None if ids is None else ids[1],
        sm_scale=scale,
        causal=is_causal,
        interpret=interpret,
    )
    return out[:, :t]


def kernel_mesh_axes(mesh, batch_size: int, num_heads: int):
    """``(batch_axes, head_axes)``: the mesh axes that split the kernel's batch and heads.

    Heads take the axes of ``HEAD_MESH_AXES``, the batch the others, each axis only while the
    product of the axes taken divides the dimension; an axis left out replicates the work.
    """
    batch_axes, head_axes = [], []
    for name, size in mesh.shape.items():
        axes, dim = (head_axes, num_heads) if name in HEAD_MESH_AXES else (batch_axes, batch_size)
        if size > 1 and dim % (math.prod(mesh.shape[a] for a in axes) * size) == 0:
            axes.append(name)
    return tuple(batch_axes), tuple(head_axes)


def _tpu_kernel(query, key, value, ids, *, scale, is_causal, block_sizes):
    """The kernel on ``[B, H, T, Dh]`` blocks of whole lengths."""
    b, h, t, dh = query.shape
    sizes = block_sizes or tpu_attention.BlockSizes.get_default(b, h, t, key.shape[2], dh)
    segment_ids = None if ids is None else tpu_attention.SegmentIds(*ids)
    return tpu_attention.flash_attention(
        query,
        key,
        value,
        segment_ids=segment_ids,
        causal=is_causal,
        sm_scale=scale,
        block_sizes=sizes,
    )


def _sharded_over_batch_and_heads(kernel, query, key, value, ids):
    """``kernel(query, key, value, ids)`` on ``[B, H, T, Dh]``, in ``shard_map`` under a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return kernel(query, key, value, ids)
    batch_axes, head_axes = kernel_mesh_axes(mesh, query.shape[0], query.shape[1])
    heads = PartitionSpec(batch_axes or None, head_axes or None)
    ids_spec = None if ids is None else (PartitionSpec(batch_axes or None),) * 2
    sharded = jax.shard_map(
        kernel,
        mesh=mesh,
        in_specs=(heads, heads, heads, ids_spec),
        out_specs=heads,
        check_vma=False,
    )
    return sharded(query, key, value, ids)


def _kernel_segment_ids(b, t, s, key_valid, segment_ids):
    """``(q [B, T], kv [B, S])`` int32 kernel ids for the masks, or ``None`` without masks.

    Real tokens get ``2 · id`` (id 0 without ``segment_ids``), keys that ``key_valid`` marks
    False the odd ``PADDED_KEY_ID``.
    """
    if key_valid is None and segment_ids is None:
        return None
    q_ids, kv_ids = segment_ids or (jnp.zeros((b, t), jnp.int32), jnp.zeros((b, s), jnp.int32))
    q_ids, kv_ids = (
        2 * jnp.broadcast_to(x, (b, n)).astype(jnp.int32) for x, n in ((q_ids, t), (kv_ids, s))
    )
    if key_valid is not None:
        kv_ids = jnp.where(jnp.broadcast_to(key_valid, (b, s)), kv_ids, PADDED_KEY_ID)
    return q_ids, kv_ids


def _padded_length(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def _padded_to_blocks(query, key, value, ids):
    """Query, key, value and kernel ids with T and S padded to multiples of ``BLOCK``.

    Padded keys get ``PADDED_KEY_ID``, so no real query sees them; padded query rows are cut
    off the result. Ids are made (all 0) when padding needs them.
    """
    (b, t), s = query.shape[:2], key.shape[1]
    pad_t, pad_s = _padded_length(t) - t, _padded_length(s) - s
    if not pad_t and not pad_s:
        return query, key, value, ids
    if ids is None:
        ids = _kernel_segment_ids(b, t, s, jnp.ones((1, s), bool), None)

    def padded(x, pad, fill=0):
        widths = [(0, 0)] * x.ndim
        widths[1] = (0, pad)
        return jnp.pad(x, widths, constant_values=fill)

    ids = padded(ids[0], pad_t), padded(ids[1], pad_s, PADDED_KEY_ID)
    return padded(query, pad_t), padded(key, pad_s), padded(value, pad_s), ids


def _equal_heads(query, key, value):
    """Key and value ``[B, S, Hk, Dh]`` repeated to the query's H heads (head n uses n // G)."""
    group = query.shape[2] // key.shape[2]
    if group == 1:
        return query, key, value
    return query, jnp.repeat(key, group, axis=2), jnp.repeat(value, group, axis=2)


def _zero_rows_without_keys(out, ids, is_causal):
    """``out [B, T, H, Dh]`` with zeros in the rows whose kernel id no visible key has.

    Per batch row, a stable sort of the key ids finds each query id's first key position in
    O((T + S) log S), instead of comparing all ``[T, S]`` pairs; with ``is_causal`` that key
    must not lie after the query (``T == S``).
    """
    if ids is None:
        return out
    t, s = out.shape[1], ids[1].shape[1]
    q_ids, kv_ids = ids[0][:, :t], ids[1]
    order = jnp.argsort(kv_ids, axis=-1, stable=True)
    sorted_ids = jnp.take_along_axis(kv_ids, order, axis=-1)
    at = jnp.clip(jax.vmap(jnp.searchsorted)(sorted_ids, q_ids), 0, s - 1)
    has_key = jnp.take_along_axis(sorted_ids, at, axis=-1) == q_ids
    if is_causal:
        has_key &= jnp.take_along_axis(order, at, axis=-1) <= jnp.arange(t)
    return jnp.where(has_key[:, :, None, None], out, 0).astype(out.dtype)


def pallas_attention(call: AttentionCall) -> jax.Array:
    """``[B, T, H, Dh]``: the Pallas kernel of ``call.platform`` on a ``call`` that
    :func:`pallas_unsupported_reason` accepts."""
    query, key, value, mask = call.query, call.key, call.value, call.mask
    scale = default_scale(query, call.scale)
    if call.platform == "gpu":
        return gpu_flash_attention(query, key, value, scale=scale, is_causal=mask.is_causal)
    explicit = mask.explicit  # a key padding mask [B | 1, 1, 1, S]
    key_valid = None if explicit is None else explicit.reshape(explicit.shape[0], -1)
    return tpu_flash_attention(
        query,
        key,
        value,
        scale=scale,
        is_causal=mask.is_causal,
        key_valid=key_valid,
        segment_ids=mask.segment_ids,
    )
