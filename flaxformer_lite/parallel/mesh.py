"""The device mesh: four named axes, ``data`` (replicas), ``fsdp`` (parameter shards),
``context`` (sequence shards) and ``tensor`` (matmul shards), sized from the config.

    mesh = make_mesh(data=-1, fsdp=1, tensor=1)   # every device a data-parallel replica
    mesh = make_mesh(data=2, fsdp=1, tensor=4)    # 8 devices: 2 replicas of a 4-way tensor split
    mesh = make_mesh(data=2, fsdp=1, tensor=1, context=4)  # each sequence split over 4 devices

The axes are ``AxisType.Auto`` on purpose. In JAX's explicit mode every contraction over a
sharded dimension needs an ``out_sharding`` and layout changes need ``jax.reshard``: the
sharding would leak into every pure function of ``ops``. In auto mode the model code stays
sharding-agnostic: parameters and batches carry ``NamedSharding``s, layer boundaries pin the
activations' layout (:func:`flaxformer_lite.nn.constrain`), and XLA propagates the rest and
inserts the collectives, as in MaxText and the Flax examples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from flaxformer_lite.parallel.config import MESH_AXES


def mesh_shape(
    data: int, fsdp: int, tensor: int, device_count: int, *, context: int = 1
) -> tuple[int, int, int, int]:
    """The axis sizes in :data:`MESH_AXES`' order, ``(data, fsdp, context, tensor)``, with the
    one ``-1`` replaced by the remaining devices.

    Raises:
      ValueError: a size that is not a positive int or -1, more than one -1, or sizes whose
        product is not ``device_count`` (the message names the axes and the device count).
    """
    sizes = {"data": data, "fsdp": fsdp, "context": context, "tensor": tensor}
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size == 0 or size < -1:
            raise ValueError(f"mesh.{name} must be a positive int or -1, got {size!r}")
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {sizes}")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if device_count % fixed:
            raise ValueError(
                f"mesh {_spell(sizes)}: {device_count} devices are not divisible by the fixed "
                f"axes' product {fixed}"
            )
        sizes[free[0]] = device_count // fixed
    if math.prod(sizes.values()) != device_count:
        raise ValueError(
            f"mesh {_spell(sizes)} needs {math.prod(sizes.values())} devices, but there are "
            f"{device_count}; set one axis to -1 to take the remaining devices"
        )
    return tuple(sizes[name] for name in MESH_AXES)


def make_mesh(
    data: int = -1,
    fsdp: int = 1,
    tensor: int = 1,
    *,
    context: int = 1,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A ``Mesh`` over ``devices`` (default: all devices of all processes) with axes
    ``("data", "fsdp", "context", "tensor")`` of the given sizes (one may be -1).

    ``jax.make_mesh`` orders the devices so that the innermost axis (``tensor``) stays within a
    host and on neighbouring chips, where the interconnect is fastest.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(data, fsdp, tensor, len(devices), context=context)
    auto = (AxisType.Auto,) * len(MESH_AXES)
    if len(devices) == jax.device_count():
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=auto)


def shown_sizes(sizes: dict[str, int]) -> dict[str, int]:
    """``sizes`` (``{axis: size}``) less ``context`` when it does not split the sequence: the
    reports and descriptions of meshes without it read as before the axis existed."""
    return {name: size for name, size in sizes.items() if name != "context" or size != 1}


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
    """``{axis: size}`` of ``mesh``, as :func:`shown_sizes` shows them."""
    return shown_sizes(dict(mesh.shape))


def describe_mesh(mesh: Mesh) -> str:
    """``"data 2 x fsdp 1 x tensor 4 (8 cpu devices, 1 process)"``; ``context`` is named when
    it splits the sequence."""
    axes = " x ".join(f"{name} {size}" for name, size in mesh_sizes(mesh).items())
    platform = mesh.devices.flat[0].platform
    processes = len({device.process_index for device in mesh.devices.flat})
    devices = f"{mesh.devices.size} {platform} device{'s' if mesh.devices.size > 1 else ''}"
    return f"{axes} ({devices}, {processes} process{'es' if processes > 1 else ''})"


def _spell(sizes: dict[str, int]) -> str:
    return " ".join(f"{name}={size}" for name, size in shown_sizes(sizes).items())
