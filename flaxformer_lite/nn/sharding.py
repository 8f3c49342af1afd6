"""Pinning an activation's layout by logical axis names, when a mesh and rules are active.

Training runs the model under ``jax.set_mesh(mesh)`` and ``nnx.logical_axis_rules(rules)``
(see :mod:`flaxformer_lite.parallel`); outside them (one device, tests, decoding) this is a no-op,
so modules never need to know whether they are sharded.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax import linen
from flax.core import spmd

# The layout of the residual stream ``[B, T, D]`` between layers.
ACTIVATION_NAMES = ("batch", "activation_length", "activation_embed")


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """``x`` with its sharding constrained to ``names`` under the active rules and mesh."""
    rules = spmd.get_logical_axis_rules()
    if not rules or jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, linen.logical_to_mesh_axes(tuple(names), rules))


def gathered_for_compute(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Parameter ``x`` (logical ``names``) constrained to its layout without the mesh axes that
    split the batch: FSDP's gather, done once where a loop over blocks would repeat it in every
    iteration (XLA gathers a sharded loop-invariant operand inside the loop). A no-op outside a
    mesh and rules, as :func:`constrain`."""
    rules = spmd.get_logical_axis_rules()
    if not rules or jax.sharding.get_abstract_mesh().empty:
        return x

    def axes(entry) -> tuple[str, ...]:
        return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)

    batch_axes = set(axes(linen.logical_to_mesh_axes(("batch",), rules)[0]))
    spec = linen.logical_to_mesh_axes(tuple(names), rules)
    kept = [tuple(a for a in axes(entry) if a not in batch_axes) or None for entry in spec]
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(*kept))
