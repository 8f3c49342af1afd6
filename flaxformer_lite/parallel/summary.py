"""What sharding does to memory: bytes per device, and large arrays the rules left replicated."""

from __future__ import annotations

import dataclasses
import math
import os

import jax
from flax import nnx
from jax.sharding import NamedSharding

from flaxformer_lite.parallel.rules import shard_bytes, variable_names

# A replicated array is worth a warning from this share of the parameters' bytes on.
REPLICATED_WARNING_SHARE = 0.01


@dataclasses.dataclass(frozen=True)
class ArrayLayout:
    """One array of a state: its path, logical names, global and per-device bytes."""

    path: str
    names: tuple
    total_bytes: int
    device_bytes: int
    replicated: bool


def array_layouts(state: nnx.State, shardings: nnx.State) -> list[ArrayLayout]:
    """The layout of every array of ``state`` (abstract or concrete) under ``shardings`` (as
    :func:`flaxformer_lite.parallel.state_shardings` returns)."""
    layouts = []
    placed = dict(nnx.to_flat_state(shardings))
    for path, variable in nnx.to_flat_state(state):
        sharding: NamedSharding = placed[path].get_value()
        shape, dtype = _shape_dtype(variable.get_value())
        layout = ArrayLayout(
            path=".".join(str(part) for part in path),
            names=variable_names(variable),
            total_bytes=math.prod(shape) * jax.numpy.dtype(dtype).itemsize,
            device_bytes=shard_bytes(shape, dtype, sharding),
            replicated=sharding.is_fully_replicated,
        )
        layouts.append(layout)
    return layouts


def device_bytes(state: nnx.State, shardings: nnx.State) -> int:
    """Bytes of ``state`` that one device holds (the largest share, when shards differ)."""
    return sum(layout.device_bytes for layout in array_layouts(state, shardings))


def replicated_warnings(
    params: nnx.State,
    shardings: nnx.State,
    mesh: jax.sharding.Mesh,
    share: float = REPLICATED_WARNING_SHARE,
) -> list[str]:
    """A line for every parameter of at least ``share`` of all parameter bytes that every device
    stores whole although the mesh has devices to shard it over (an ``fsdp`` or ``tensor`` axis
    larger than 1; pure data parallelism replicates parameters by design)."""
    if mesh.shape.get("fsdp", 1) * mesh.shape.get("tensor", 1) == 1:
        return []
    layouts = array_layouts(params, shardings)
    threshold = share * sum(layout.total_bytes for layout in layouts)
    return [
        f"parameter {layout.path} {layout.names} ({layout.total_bytes / 2**20:.1f} MiB) is "
        "replicated on every device: no rule maps its axes to a mesh axis larger than 1"
        for layout in layouts
        if layout.replicated and layout.total_bytes >= threshold
    ]


def _shape_dtype(value) -> tuple[tuple[int, ...], object]:
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        data = jax.eval_shape(jax.random.key_data, value)
        return data.shape, data.dtype
    return value.shape, value.dtype


def device_memory_limit() -> tuple[str, int | None]:
    """Where arrays live and how much memory there is: the first local device's limit
    (accelerators report it), else the host's memory (None where it cannot be read)."""
    device = jax.local_devices()[0]
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit:
        return f"{device.platform.upper()} device", limit
    try:
        return "host", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # not POSIX
        return "host", None
