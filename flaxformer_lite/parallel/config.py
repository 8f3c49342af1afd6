"""Parallelism as settings, read and checked by the config without JAX: the mesh's axes, the
logical axis rules and their defaults (:mod:`.mesh` makes the mesh, :mod:`.rules` applies the
rules), the zig-zag split of a sequence over ``context``, and how a process joins a
multi-process run (:mod:`.distributed` connects it)."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence

from flaxformer_lite.settings import setting

# Inner axes get neighbouring chips: tensor (every matmul) innermost, then context (K/V
# all-gathered by every attention layer).
MESH_AXES = ("data", "fsdp", "context", "tensor")

Rules = Mapping[str, tuple[str, ...]]

# Data parallelism over "data"; ZeRO-3 parameter sharding over "fsdp", which splits the batch
# too; Megatron tensor parallelism over "tensor" (attention heads, MLP units, the vocabulary);
# context parallelism over "context", which splits the activations' sequence
# (:mod:`flaxformer_lite.nn.context_parallel`; parameters are not split by it).
DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
    "activation_length": ("context",),
    "embed": ("fsdp",),
    "vocab": ("tensor",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "layers": (),
    "activation_embed": (),
}

# Every logical name the library's parameters and activations use (tests/test_parallel.py checks
# this against the models): a rule for another name would shard nothing, so it is refused.
LOGICAL_NAMES = (
    *DEFAULT_RULES,
    *("length", "norm", "head_dim", "qkv", "qkv_heads", "relpos_buckets", "token_types"),
    *("features", "embed_out", "outputs", "classes"),
    *("aft_features", "aft_query_length", "aft_key_length"),
)

# The model config field behind each logical name, for error messages.
CONFIG_FIELDS = {
    "vocab": "model.vocab_size",
    "embed": "model.d_model",
    "heads": "model.num_heads",
    "kv_heads": "model.num_kv_heads",
    "mlp": "model.d_ff",
    "head_dim": "model.head_dim",
    "layers": "the number of layers",
    "length": "model.max_length",
    "activation_length": "data.seq_len",
}


def check_rules(rules: Rules, mesh_axes: Sequence[str]) -> None:
    """Raises ValueError naming a rule for a name no array has (:data:`LOGICAL_NAMES`), or one
    that uses an unknown mesh axis or one axis twice."""
    for name, axes in rules.items():
        if name not in LOGICAL_NAMES:
            close = difflib.get_close_matches(name, LOGICAL_NAMES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"mesh.rules.{name}: no array has a logical axis {name!r}{hint}; the names are "
                f"{', '.join(LOGICAL_NAMES)}"
            )
        for axis in axes:
            if axis not in mesh_axes:
                raise ValueError(
                    f"mesh.rules.{name} names mesh axis {axis!r}; the axes are {tuple(mesh_axes)}"
                )
        if len(set(axes)) != len(axes):
            raise ValueError(f"mesh.rules.{name} names a mesh axis twice: {axes}")


def check_context_length(length: int, shards: int, what: str = "data.seq_len") -> None:
    """Raises ValueError unless ``2 * shards`` blocks divide a sequence of ``length``."""
    if length % (2 * shards):
        raise ValueError(
            f"{what} {length} does not split over mesh.context={shards}: the zig-zag layout "
            f"cuts each sequence into 2 x {shards} = {2 * shards} equal blocks"
        )


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process run (``jax.distributed.initialize``); each
    field's help is beside it. The address, count and id may also come from
    ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``."""

    enabled: bool | None = setting(
        None,
        help="null: connect when an address or count is given (here or in JAX_* variables); true: "
        "always, JAX detecting the rest (SLURM, Open MPI, TPU pods, GKE); false: never",
    )
    coordinator_address: str | None = setting(
        None, help="host:port of process 0's coordination service"
    )
    num_processes: int | None = setting(None, help="how many processes take part")
    process_id: int | None = setting(None, help="this process's index in [0, num_processes)")
    initialization_timeout: int = setting(300, help="seconds to wait for every process to connect")
    heartbeat_timeout: int = setting(
        100,
        help="seconds without a heartbeat before a process counts dead (the others then stop with "
        "an error)",
    )

    def __post_init__(self):
        for name in ("initialization_timeout", "heartbeat_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
