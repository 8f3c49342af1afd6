"""Logical axis rules: which mesh axes shard each named dimension of parameters and activations.

Modules name every parameter dimension (``("embed", "heads", "head_dim")``, see
:mod:`flaxformer_lite.nn.dense`); the rules map those names to mesh axes::

    rules = {"batch": ("data", "fsdp"), "embed": ("fsdp",), "heads": ("tensor",), ...}
    spec = logical_spec(("embed", "mlp"), rules)        # PartitionSpec("fsdp", "tensor")

The order of the rules is their precedence, and a mesh axis shards at most one dimension of an
array (``flax.linen.logical_to_mesh_axes``): for the activations ``("batch",
"activation_length", "activation_embed")`` the batch takes ``data`` and ``fsdp`` first. Names
without a rule, or with an empty one, are replicated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from flax import linen, nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flaxformer_lite.parallel.config import CONFIG_FIELDS, Rules


def rule_pairs(rules: Rules) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """``rules`` in Flax's form, ``((name, mesh axis or axes or None), ...)``, for
    ``nnx.logical_axis_rules`` and ``flax.linen.logical_to_mesh_axes``."""
    return tuple(
        (name, axes[0] if len(axes) == 1 else tuple(axes) or None) for name, axes in rules.items()
    )


def logical_spec(names: Sequence[str | None], rules: Rules) -> PartitionSpec:
    """The ``PartitionSpec`` of an array whose dimensions have the logical ``names``."""
    return linen.logical_to_mesh_axes(tuple(names), rule_pairs(rules))


def variable_names(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The logical axis names of a variable (``None`` per dimension when it has none)."""
    names = variable.get_metadata().get("out_sharding")
    return tuple(names) if names else (None,) * len(variable.shape)


def state_shardings(state: nnx.State, mesh: Mesh, rules: Rules) -> nnx.State:
    """``state`` (abstract or concrete) with each variable's value replaced by its
    ``NamedSharding`` under ``rules``: a tree of the same structure, for ``jax.jit``'s
    ``in_shardings``/``out_shardings`` and for restoring checkpoints.

    Variables without logical names (RNG keys and counters, the step) are replicated.

    Raises:
      ValueError: a sharded dimension is not divisible by its mesh axes' size; the message names
        the parameter, the logical axis, the config field and the rule.
    """

    def sharding(path, variable):
        names = variable_names(variable)
        spec = logical_spec(names, rules)
        for size, name, axes in zip(variable.shape, names, spec, strict=False):
            _check_divisible(size, name, axes, mesh, f"parameter {_dotted(path)}")
        return variable.replace(NamedSharding(mesh, spec))

    return nnx.map_state(sharding, state)


def batch_sharding(mesh: Mesh, rules: Rules) -> NamedSharding:
    """Where batches go: split along their first (``"batch"``) axis, the rest replicated."""
    return NamedSharding(mesh, logical_spec(("batch",), rules))


def check_batch_size(batch_size: int, mesh: Mesh, rules: Rules, microbatches: int = 1) -> None:
    """Raises ValueError unless every microbatch splits evenly over the batch's mesh axes."""
    axes = logical_spec(("batch",), rules)[0]
    shards = _axes_size(axes, mesh)
    if batch_size % (shards * microbatches):
        split = f" x train.grad_accum_steps {microbatches}" if microbatches > 1 else ""
        raise ValueError(
            f"train.batch_size {batch_size} is not divisible by the {shards} batch shards "
            f"(mesh axes {_axes_text(axes)}, rule mesh.rules.batch){split}"
        )


def shard_bytes(shape: Sequence[int], dtype, sharding: NamedSharding) -> int:
    """Bytes one device holds of an array of ``shape`` laid out by ``sharding``."""
    return math.prod(sharding.shard_shape(tuple(shape))) * jax.numpy.dtype(dtype).itemsize


def _check_divisible(size: int, name, axes, mesh: Mesh, what: str) -> None:
    shards = _axes_size(axes, mesh)
    if size % shards:
        field = CONFIG_FIELDS.get(name)
        field = f" ({field} = {size})" if field else ""
        raise ValueError(
            f"{what}: dimension {name!r} of size {size}{field} is not divisible by mesh axes "
            f"{_axes_text(axes)} of size {shards}; change the mesh or the rule "
            f"(mesh.rules.{name}=none replicates it)"
        )


def _axes_size(axes, mesh: Mesh) -> int:
    if axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[axis] for axis in axes)


def _axes_text(axes) -> str:
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return "x".join(axes) or "none"


def _dotted(path) -> str:
    return ".".join(str(part) for part in path)
