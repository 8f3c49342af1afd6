"""Several processes (hosts) in one run: ``jax.distributed`` and feeding each its rows.

Every process runs the same program. :func:`initialize` connects them (before anything touches
a JAX device); then ``jax.devices()`` lists the devices of all processes and one mesh spans them.
Each process loads only the rows of the global batch that its own devices hold
(:func:`process_batch_shard`) and :func:`put_batch` assembles the global array from those rows
with ``jax.make_array_from_process_local_data``; no process ever holds the whole batch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding

from flaxformer_lite.parallel.config import DistributedConfig

# The variables a launcher sets for every process (the first is also read by JAX itself).
ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
)


def initialize(cfg: DistributedConfig, environ: Mapping[str, str] = os.environ) -> bool:
    """Connects this process to the others if ``cfg`` (or the environment) asks for it; True if
    it is (now or already) part of a multi-process run. Call before using any JAX device.

    Raises:
      ValueError: a process count or id in the environment that is not an integer.
    """
    if jax.distributed.is_initialized():
        return True
    if cfg.enabled is False:
        return False
    address = cfg.coordinator_address or environ.get(ENV_COORDINATOR)
    count = (
        cfg.num_processes if cfg.num_processes is not None else _env_int(environ, ENV_NUM_PROCESSES)
    )
    index = cfg.process_id if cfg.process_id is not None else _env_int(environ, ENV_PROCESS_ID)
    wanted = cfg.enabled if cfg.enabled is not None else (address is not None or (count or 1) > 1)
    if not wanted:
        return False
    try:
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=count,
            process_id=index,
            initialization_timeout=cfg.initialization_timeout,
            heartbeat_timeout_seconds=cfg.heartbeat_timeout,
        )
    except (ValueError, TypeError) as error:  # JAX's wording names its own arguments
        raise ValueError(
            f"cannot join the multi-process run: {error} (set distributed.coordinator_address, "
            f"distributed.num_processes and distributed.process_id, or {ENV_COORDINATOR}, "
            f"{ENV_NUM_PROCESSES} and {ENV_PROCESS_ID})"
        ) from None
    return True


def process_batch_shard(sharding: NamedSharding, global_batch: int) -> tuple[int, int]:
    """``(index, count)``: this process must load rows ``[index * B/count, (index+1) * B/count)``
    of each global batch of ``B = global_batch`` rows laid out by ``sharding``.

    Processes whose devices hold the same rows (the batch replicated over a mesh axis that spans
    hosts) get the same index.

    Raises:
      ValueError: this process's devices need rows that are not one contiguous block.
    """
    rows = set()
    for index in sharding.addressable_devices_indices_map((global_batch,)).values():
        start, stop, _ = index[0].indices(global_batch)
        rows.update(range(start, stop))
    start, stop = min(rows), max(rows) + 1
    size = stop - start
    if len(rows) != size or global_batch % size or start % size:
        raise ValueError(
            f"process {jax.process_index()}'s devices hold batch rows {sorted(rows)} of "
            f"{global_batch}, not one aligned block; order the mesh so that each process's "
            "devices are adjacent along the batch axes"
        )
    return start // size, global_batch // size


def put_batch(batch: Mapping[str, np.ndarray], sharding: NamedSharding, global_batch: int):
    """The global ``jax.Array``s of a batch from this process's rows (``[B_local, ...]`` numpy
    arrays, as the data pipeline yields for :func:`process_batch_shard`).

    The transfers are started, not waited for: the arrays can be handed to a jitted step at
    once, while the host goes on with other work.
    """
    batch = dict(batch)
    # One call for the whole batch: on one process a single device_put moves every array.
    shapes = {key: (global_batch, *value.shape[1:]) for key, value in batch.items()}
    return jax.make_array_from_process_local_data(sharding, batch, shapes)


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {text!r}") from None
