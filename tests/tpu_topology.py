"""The compile-only TPU slice the tests compile for (libtpu; no TPU is touched)."""

import os

import pytest


def v5e_2x2():
    """Four compile-only TPU v5e chips (``jax.experimental.topologies``); the test is skipped
    where libtpu is not installed."""
    pytest.importorskip("libtpu")
    from jax.experimental import topologies

    # Other processes (parallel test workers) may hold libtpu's lock on this host; compiling
    # for a compile-only topology touches no TPU, so sharing libtpu is safe.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    return topologies.get_topology_desc(
        platform="tpu",
        topology_name="v5e:2x2",
        chip_config_name="default",
        chips_per_host_bounds=(2, 2, 1),
        num_slices=1,
    )
