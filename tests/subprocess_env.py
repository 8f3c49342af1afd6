"""The environment of the JAX subprocesses that tests start (``train.py`` runs)."""

import os

import fast_compile

DISTRIBUTED_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def subprocess_env(devices: int, **extra: str) -> dict[str, str]:
    """This process's environment for a subprocess on ``devices`` simulated CPU devices, with
    unbuffered output, no ``jax.distributed`` settings and ``extra`` laid over it.

    XLA's backend optimizations and XLA:CPU's fusion emitters are off (fast_compile.py:
    compiling is most of a short run's time; the values are the same up to float32 round-off,
    as in the modules marked ``fast_compile``; every subprocess compiles this way, so that
    their numbers compare), and the session's
    compilation cache that conftest.py sets up (``JAX_COMPILATION_CACHE_DIR``) is kept, for
    every program however short its compile: runs of the same program on the same devices
    compile it once."""
    environ = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
    environ |= {
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {fast_compile.xla_flags()}",
        "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PLATFORMS": "cpu",
        "PYTHONUNBUFFERED": "1",
    }
    return environ | extra
