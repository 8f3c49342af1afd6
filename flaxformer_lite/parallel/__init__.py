"""Sharding over devices and hosts: a ``(data, fsdp, context, tensor)`` mesh, logical axis rules,
state created in its shards, batches fed per process, ``jax.distributed`` for several hosts."""

from flaxformer_lite.lazy import lazy_names

# Each name's module, imported when the name is first read (flaxformer_lite.lazy).
_HOMES = {
    "flaxformer_lite.parallel.create": ("abstract_sharded", "create_sharded"),
    "flaxformer_lite.parallel.distributed": (
        "initialize",
        "process_batch_shard",
        "put_batch",
    ),
    "flaxformer_lite.parallel.config": (
        "MESH_AXES",
        "DEFAULT_RULES",
        "check_rules",
        "DistributedConfig",
    ),
    "flaxformer_lite.parallel.mesh": (
        "describe_mesh",
        "make_mesh",
        "mesh_shape",
        "mesh_sizes",
        "shown_sizes",
    ),
    "flaxformer_lite.parallel.rules": (
        "batch_sharding",
        "check_batch_size",
        "logical_spec",
        "rule_pairs",
        "shard_bytes",
        "state_shardings",
    ),
    "flaxformer_lite.parallel.summary": (
        "array_layouts",
        "device_bytes",
        "device_memory_limit",
        "replicated_warnings",
    ),
}
__getattr__, __dir__ = lazy_names(__name__, _HOMES)
__all__ = [name for names in _HOMES.values() for name in names]
