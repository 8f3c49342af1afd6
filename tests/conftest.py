"""Test setup: 8 simulated CPU devices, float32 matmuls at full precision.

XLA reads ``XLA_FLAGS`` once, when the backend starts, so the flag is set here before any
test module imports jax. Tests that need several devices use ``jax.devices()[:n]``.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

# Reference comparisons at float32 round-off need full-precision matmuls on every backend.
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture
def rng():
    """A fresh typed PRNG key per test."""
    return jax.random.key(0)
