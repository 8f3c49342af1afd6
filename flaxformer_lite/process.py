"""The process a command runs in, set up by the commands (``flaxformer-lite``, ``train.py``,
``sample.py``) and never by importing the package: which JAX backends start, JAX's persistent
compilation cache, and host memory kept for reuse. Each holds for the whole process and for
every library in it, so it is the program's choice; a user's script makes its own (calling
these, or not).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import pathlib
import platform
import sys

_ACCELERATOR_PLUGINS = ("jax-cuda", "jax_cuda", "jax-rocm", "jax_rocm")


# --------------------------------------------------------------------------- backends
def skip_absent_tpu() -> None:
    """Makes the CPU JAX's only backend when libtpu is installed, the host has no TPU chips and
    no GPU plugin is installed; call before any JAX backend starts.

    libtpu (the ``tpu`` extra, which ``dev`` pulls in to compile for TPUs on any host) makes JAX
    try a TPU backend at start-up, and on a host without TPU chips it prints warnings about TPU
    hostnames before JAX falls back to the CPU: the same backend, without the warnings. A
    ``JAX_PLATFORMS`` the user set is kept. The check imports no JAX (a command's ``--help``
    needs none): before JAX is imported it asks for the CPU through ``JAX_PLATFORMS=cpu``, as a
    user would, which the command's own children inherit (on this host they would decide the
    same); after, through JAX's config.
    """
    if os.environ.get("JAX_PLATFORMS") or importlib.util.find_spec("libtpu") is None:
        return
    if tpu_chip_count() != 0:  # chips, or jax's test moved: leave the choice to jax
        return
    names = (dist.metadata["Name"] or "" for dist in importlib.metadata.distributions())
    if any(name.startswith(_ACCELERATOR_PLUGINS) for name in names):
        return
    if "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    else:
        os.environ["JAX_PLATFORMS"] = "cpu"


def tpu_chip_count() -> int | None:
    """The TPU chips on this host's PCI bus, by jax's own test (``jax._src.hardware_utils``, as
    cloud_tpu_init uses it), run from its file without importing JAX; None where that file
    is gone or no longer runs on its own (another jax version)."""
    jax_spec = importlib.util.find_spec("jax")
    if jax_spec is None or jax_spec.origin is None:
        return None
    path = pathlib.Path(jax_spec.origin).parent / "_src" / "hardware_utils.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("_jax_hardware_utils", path)
    hardware_utils = importlib.util.module_from_spec(spec)
    try:  # a command must not fail on a change in jax's private module
        spec.loader.exec_module(hardware_utils)
        return hardware_utils.num_available_tpu_chips_and_device_id()[0]
    except Exception:
        return None


# --------------------------------------------------------------------------- compilation cache
# The cache's bound on disk: JAX evicts the least recently read entries past it (the bound
# also turns on JAX's file lock, so concurrent runs never read a half-written entry).
MAX_CACHE_BYTES = 4 * 2**30


def user_cache_dir() -> pathlib.Path:
    """``$XDG_CACHE_HOME/flaxformer_lite`` (default ``~/.cache/flaxformer_lite``): what this
    package keeps between runs on a machine."""
    cache = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(cache) / "flaxformer_lite"


def use_compilation_cache(enabled: bool) -> None:
    """Turns JAX's persistent compilation cache on in :func:`user_cache_dir`, for every program
    however short its compile, unless the user set a cache directory of their own; or, when not
    ``enabled``, off (the user's directory too). Call before the run compiles.

    A run compiles its train step, its evaluation and its generation at every start; with the
    cache on (``train.compilation_cache``, the default) a second run of the same config, or a
    resumed one, reads each program back instead of compiling it again. JAX keys an entry by
    the program, its compile options, the XLA flags, the devices and jax's version, so a hit
    runs the very executable a compile would have produced. A cache directory the user gave JAX
    (``JAX_COMPILATION_CACHE_DIR``) is kept with its settings.
    """
    import jax

    jax.config.update("jax_enable_compilation_cache", enabled)
    if not enabled:
        return
    if jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", str(user_cache_dir() / "jax"))
    # Reading a small program back costs less than compiling it, even one of milliseconds.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_compilation_cache_max_size", MAX_CACHE_BYTES)


# --------------------------------------------------------------------------- host memory
# mallopt(3) parameters, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1  # -1: never return the heap's free top to the system
M_MMAP_MAX = -4  # 0: never serve a request with its own mmap
M_ARENA_MAX = -8  # 1: every thread allocates from the main arena


def reuse_freed_host_memory() -> bool:
    """Makes glibc keep freed memory for reuse; True if it did (False where the C library is not
    glibc). The process keeps its peak host memory mapped until it exits. Call before JAX
    starts its backend's worker threads.

    XLA's CPU runtime allocates each step's temporary buffer with ``malloc`` and frees it when
    the step ends. glibc serves a block that large with a fresh ``mmap`` and unmaps it on
    ``free``, so every step the kernel maps and zeroes each of its pages again. With large
    blocks served from glibc's heap and the heap never given back, the next step reuses the same
    pages. A thread's own malloc arena maps a block larger than its 64 MiB heap whatever the
    settings, so every thread must share the main arena; a thread takes its arena when it first
    allocates, so only threads created afterwards follow the setting.
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))
    return all([libc.mallopt(parameter, value) == 1 for parameter, value in settings])
