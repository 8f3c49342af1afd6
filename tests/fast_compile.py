"""What the ``fast_compile`` modules and the tests' subprocesses compile with besides XLA's
backend optimizations off (conftest.py): XLA:CPU's elemental emitters instead of its fusion
emitters, which cost more to compile than they save at that optimization level."""

import functools

import jax
from jax._src import compiler as jax_compiler

OPTIONS = {"xla_cpu_use_fusion_emitters": False}


@functools.cache
def supported() -> bool:
    """Whether this jaxlib's XLA knows :data:`OPTIONS` (a release may drop one)."""
    try:
        jax.jit(lambda: 0).lower().compile(compiler_options=OPTIONS)
    except jax.errors.JaxRuntimeError:
        return False
    return True


def xla_flags() -> str:
    """:data:`OPTIONS` as ``XLA_FLAGS`` words, for a subprocess that compiles only this way."""
    if not supported():
        return ""
    return " ".join(f"--{name}={str(value).lower()}" for name, value in OPTIONS.items())


def add_to_unoptimized_compiles() -> None:
    """Has JAX compile with :data:`OPTIONS` (unless the caller sets them) while
    ``jax_disable_most_optimizations`` is on: JAX has no setting for the options of every
    program, and ``XLA_FLAGS`` would change the optimized programs too."""
    if not supported():
        return
    get_compile_options = jax_compiler.get_compile_options

    @functools.wraps(get_compile_options)
    def options(*args, env_options_overrides=None, **kwargs):
        if jax.config.values["jax_disable_most_optimizations"]:
            env_options_overrides = {**OPTIONS, **(env_options_overrides or {})}
        return get_compile_options(*args, env_options_overrides=env_options_overrides, **kwargs)

    jax_compiler.get_compile_options = options


def one_compile_at_a_time() -> None:
    """Has this process compile (and read or write the compilation cache) one program at a
    time. A worker's full run crashed XLA:CPU (SIGSEGV, SIGABRT, inside the backend's compile
    or an executable's serialization) where a run's thread and its background compile
    (flaxformer_lite/train/background_compile.py) compiled at once with :data:`OPTIONS` and
    optimizations off; the tests' programs are the same compiled in turn."""
    import threading

    compile_or_get_cached = jax_compiler.compile_or_get_cached
    lock = threading.RLock()  # a compile that compiles another on its thread goes on

    @functools.wraps(compile_or_get_cached)
    def one_at_a_time(*args, **kwargs):
        with lock:
            return compile_or_get_cached(*args, **kwargs)

    jax_compiler.compile_or_get_cached = one_at_a_time
