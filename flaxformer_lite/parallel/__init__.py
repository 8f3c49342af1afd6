"""Sharding over devices and hosts: a ``(data, fsdp, context, tensor)`` mesh, logical axis rules,
state created in its shards, batches fed per process, ``jax.distributed`` for several hosts."""

from flaxformer_lite.parallel.create import abstract_sharded, create_sharded
from flaxformer_lite.parallel.distributed import (
    DistributedConfig,
    initialize,
    process_batch_shard,
    put_batch,
)
from flaxformer_lite.parallel.mesh import (
    MESH_AXES,
    describe_mesh,
    make_mesh,
    mesh_shape,
    mesh_sizes,
    shown_sizes,
)
from flaxformer_lite.parallel.rules import (
    DEFAULT_RULES,
    batch_sharding,
    check_batch_size,
    check_rules,
    logical_spec,
    rule_pairs,
    shard_bytes,
    state_shardings,
)
from flaxformer_lite.parallel.summary import (
    array_layouts,
    device_bytes,
    device_memory_limit,
    replicated_warnings,
)

__all__ = [
    "DEFAULT_RULES",
    "DistributedConfig",
    "MESH_AXES",
    "abstract_sharded",
    "array_layouts",
    "batch_sharding",
    "check_batch_size",
    "check_rules",
    "create_sharded",
    "describe_mesh",
    "device_bytes",
    "device_memory_limit",
    "initialize",
    "logical_spec",
    "make_mesh",
    "mesh_shape",
    "mesh_sizes",
    "shown_sizes",
    "process_batch_shard",
    "put_batch",
    "replicated_warnings",
    "rule_pairs",
    "shard_bytes",
    "state_shardings",
]
