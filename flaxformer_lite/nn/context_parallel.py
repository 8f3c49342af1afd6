"""Context parallelism: each sequence split over the devices of the ``context`` mesh axis.

The rule ``activation_length -> ("context",)`` splits the residual stream ``[B, T, D]`` along T,
so every layer's matmuls, norms and MLPs run on ``T / C`` tokens per device. Attention is the one
place tokens meet: each device all-gathers the keys and values of the whole sequence along the
axis and attends from its own queries (MaxText's way; docs/design.md says why not a ring).

Causal attention gives late queries more keys than early ones, so the sequence is laid out
zig-zag: cut into ``2C`` blocks, device ``i`` holds blocks ``i`` and ``2C - 1 - i``, an early
and a late one, and every device does the same work. The permutation is applied once, to the
batch (:func:`to_context_layout`): tokens, targets, weights, segment ids and positions move
together, so the loss, a sum over tokens, is unchanged, and RoPE or position tables read the
true positions. Inside attention the gathered keys go back to their natural order and the
queries' true positions build the causal, window and global-token masks
(``AttentionMask.query_positions``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen
from flax.core import spmd
from jax import lax
from jax.sharding import PartitionSpec as P

from flaxformer_lite import ops
from flaxformer_lite.parallel.config import check_context_length

# The logical name of the activations' sequence dimension (nn.ACTIVATION_NAMES).
LENGTH_NAME = "activation_length"


def sequence_axes() -> tuple[str, ...]:
    """The mesh axes of size > 1 that split the activations' sequence under the active mesh
    and logical axis rules; ``()`` outside them (one device, tests, decoding)."""
    rules = spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return ()
    entry = linen.logical_to_mesh_axes((LENGTH_NAME,), rules)[0]
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return tuple(axis for axis in axes if mesh.shape[axis] > 1)


def sequence_shards() -> int:
    """How many devices split each sequence under the active mesh and rules (1 outside)."""
    mesh = jax.sharding.get_abstract_mesh()
    return math.prod(mesh.shape[axis] for axis in sequence_axes())


def zigzag_order(length: int, shards: int) -> np.ndarray:
    """int ``[T]``: the position each slot of the layout holds. Slot block ``2i`` is position
    block ``i`` and slot block ``2i + 1`` position block ``2C - 1 - i`` (device ``i`` holds
    both); with one shard the identity."""
    if shards == 1:
        return np.arange(length)
    check_context_length(length, shards, "the sequence length")
    blocks = np.arange(length).reshape(2 * shards, -1)
    return np.concatenate([np.concatenate([blocks[i], blocks[-1 - i]]) for i in range(shards)])


def sequence_order(length: int) -> jax.Array:
    """int ``[T]``: the true position of each slot of a sequence under the active layout
    (:func:`zigzag_order` of :func:`sequence_shards`; ``arange(T)`` without context)."""
    return jnp.asarray(zigzag_order(length, sequence_shards()))


def to_context_layout(batch: dict[str, jax.Array], shards: int) -> dict[str, jax.Array]:
    """``batch`` with every ``[B, T, ...]`` array in the zig-zag order of ``shards`` devices,
    and its ``positions`` (``arange(T)`` per row when absent) moved with the tokens.

    Raises:
      ValueError: a sequence length that ``2 * shards`` blocks do not divide.
    """
    inputs = batch["inputs"]
    order = zigzag_order(inputs.shape[1], shards)
    if "positions" not in batch:
        positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape[:2])
        batch = {**batch, "positions": positions}
    return {name: jnp.take(x, order, axis=1) for name, x in batch.items()}


def shard_rows(x: jax.Array, shards: int) -> jax.Array:
    """``[B, T, ...]`` split along T over ``shards`` devices -> ``[B * shards, T / shards, ...]``:
    each device's part of a row as a row of its own, so that a loop over blocks of positions
    (``ops.chunked_cross_entropy``) walks every device's positions where they lie instead of
    gathering the sequence."""
    rows = x.reshape(x.shape[0] * shards, x.shape[1] // shards, *x.shape[2:])
    batch = linen.logical_to_mesh_axes(("batch",), spmd.get_logical_axis_rules())[0]
    batch = () if batch is None else (batch,) if isinstance(batch, str) else tuple(batch)
    return lax.with_sharding_constraint(rows, P((*batch, *sequence_axes())))


def natural_order(x: jax.Array, shards: int, axis: int) -> jax.Array:
    """``x`` gathered along ``axis`` in the zig-zag layout -> in position order."""
    x = jnp.moveaxis(x, axis, 0)
    blocks = x.reshape(shards, 2, x.shape[0] // (2 * shards), *x.shape[1:])
    early, late = blocks[:, 0], blocks[::-1, 1]
    natural = jnp.concatenate([early, late]).reshape(x.shape)
    return jnp.moveaxis(natural, 0, axis)


def context_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None,
    mask: ops.AttentionMask,
    *,
    axes: tuple[str, ...],
    implementation: str | None = None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
) -> jax.Array:
    """``ops.dot_product_attention`` of a sequence split zig-zag over the mesh ``axes``.

    Args:
      query: ``[B, T, H, Dh]``, keys and values ``[B, T, Hk, Dh]``, all in the layout order
        with T split over ``axes``.
      bias: float ``[1 | B, H, T | 1, S | 1]``: queries in the layout order, keys in position
        order (``models.layers.Tower`` builds it from :func:`sequence_order`).
      mask: self-attention's pieces without a cache; its ``explicit`` array (rank 4) and
        ``segment_ids`` have their T and S axes in the layout order, like the tokens.
      axes: the mesh axes splitting T (:func:`sequence_axes`); the other axes stay automatic.
      implementation, scale, dropout_rate, dropout_rng: as for ``ops.dot_product_attention``, run on
        each device's queries against all keys; dropout draws per device.

    Returns:
      ``[B, T, H, Dv]`` in the layout order.
    """
    if mask.query_offset is not None:
        raise ValueError("context parallelism splits training sequences, not a KV cache")
    mesh = jax.sharding.get_abstract_mesh()
    shards = math.prod(mesh.shape[axis] for axis in axes)
    split = P(None, axes)
    args = dict(query=query, key=key, value=value)
    specs = dict(query=split, key=split, value=split)
    if bias is not None:
        args["bias"] = bias
        specs["bias"] = P(None, None, axes if bias.shape[2] > 1 else None)
    if mask.explicit is not None:
        args["explicit"] = mask.explicit
        specs["explicit"] = P(None, None, axes if mask.explicit.shape[2] > 1 else None)
    if mask.segment_ids is not None:
        args["segment_ids"] = mask.segment_ids[0]
        specs["segment_ids"] = split
    if dropout_rng is not None:
        args["dropout_rng"] = dropout_rng
        specs["dropout_rng"] = P()

    def gathered(x, axis):
        """This device's slice along ``axis`` -> the whole sequence in position order."""
        return natural_order(lax.all_gather(x, axes, axis=axis, tiled=True), shards, axis)

    def on_device(args):
        index = lax.axis_index(axes)
        rows = args["query"].shape[1]
        positions = jnp.asarray(zigzag_order(rows * shards, shards)).reshape(shards, rows)
        pieces = dict(query_positions=positions[index], segment_ids=None)
        explicit = args.get("explicit")
        if explicit is not None and explicit.shape[3] > 1:  # whole along S, in the layout order
            explicit = natural_order(explicit, shards, 3)
        pieces["explicit"] = explicit
        if "segment_ids" in args:
            ids = args["segment_ids"]
            pieces["segment_ids"] = (ids, gathered(ids, 1))
        rng = args.get("dropout_rng")
        return ops.dot_product_attention(
            args["query"],
            gathered(args["key"], 1),
            gathered(args["value"], 1),
            args.get("bias"),
            dataclasses.replace(mask, **pieces),
            implementation=implementation,
            scale=scale,
            dropout_rate=dropout_rate,
            dropout_rng=None if rng is None else jax.random.fold_in(rng, index),
        )

    # Unchecked: the implementations' loop carries start as constants, not as per-device values.
    run = jax.shard_map(
        on_device, in_specs=(specs,), out_specs=split, axis_names=set(axes), check_vma=False
    )
    return run(args)
