"""The user's cache directory, and JAX's persistent compilation cache in it.

A run compiles its train step, its evaluation and its generation at every start; with the cache
on (``train.compilation_cache``, the default) a second run of the same config, or a resumed
one, reads each program back from ``$XDG_CACHE_HOME/flaxformer_lite/jax`` (default
``~/.cache``) instead of compiling it again. JAX keys an entry by the program, its compile
options, the XLA flags, the devices and jax's version, so a hit runs the very executable a
compile would have produced, and a changed config compiles anew. An entry that cannot be read
back (a truncated file) is compiled again, with a warning from JAX.

A cache directory the user gave JAX (``JAX_COMPILATION_CACHE_DIR``, or
``jax.config.update("jax_compilation_cache_dir", ...)`` in a script) is kept with its settings.
"""

from __future__ import annotations

import os
import pathlib

# The cache's bound on disk: JAX evicts the least recently read entries past it (the bound
# also turns on JAX's file lock, so concurrent runs never read a half-written entry).
MAX_BYTES = 4 * 2**30


def user_cache_dir() -> pathlib.Path:
    """``$XDG_CACHE_HOME/flaxformer_lite`` (default ``~/.cache/flaxformer_lite``): what this
    package keeps between runs on a machine."""
    cache = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(cache) / "flaxformer_lite"


def use_compilation_cache(enabled: bool) -> None:
    """Turns JAX's persistent compilation cache on in :func:`user_cache_dir`, for every program
    however short its compile, unless the user set a cache directory of their own; or, when not
    ``enabled``, off (the user's directory too). Call before the run compiles."""
    import jax

    jax.config.update("jax_enable_compilation_cache", enabled)
    if not enabled:
        return
    if jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", str(user_cache_dir() / "jax"))
    # Reading a small program back costs less than compiling it, even one of milliseconds.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
