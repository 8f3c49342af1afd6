"""The tests' own compile options (tests/fast_compile.py, installed by conftest.py): XLA:CPU's
elemental emitters while JAX's backend optimizations are off, and only then; a caller's own
option wins; subprocesses get the same through ``XLA_FLAGS``."""

import fast_compile
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import compiler as jax_compiler

pytestmark = pytest.mark.skipif(
    not fast_compile.supported(), reason="this jaxlib's XLA has no xla_cpu_use_fusion_emitters"
)


def overrides(**kwargs) -> dict:
    """The XLA options JAX would compile a program with now."""
    return dict(jax_compiler.get_compile_options(1, 1, **kwargs).env_option_overrides)


@pytest.fixture
def optimizations_off():
    previous = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", previous)


def test_optimized_programs_compile_with_xlas_defaults():
    assert "xla_cpu_use_fusion_emitters" not in overrides()


def test_unoptimized_programs_compile_with_the_elemental_emitters(optimizations_off):
    assert overrides() == {"xla_cpu_use_fusion_emitters": False}
    own = {"xla_cpu_use_fusion_emitters": True}
    assert overrides(env_options_overrides=own) == own


def test_a_program_compiled_either_way_computes_the_same(optimizations_off):
    def f(x, w):
        return jnp.tanh(x @ w).sum(axis=-1) + jax.nn.logsumexp(x, axis=-1)

    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((8, 16), np.float32), rng.standard_normal((16, 16), np.float32)
    unoptimized = jax.jit(f).lower(x, w).compile()(x, w)
    jax.config.update("jax_disable_most_optimizations", False)
    optimized = jax.jit(f).lower(x, w).compile()(x, w)
    np.testing.assert_allclose(unoptimized, optimized, rtol=1e-5, atol=1e-5)


def test_subprocesses_get_the_option_as_xla_flags():
    assert fast_compile.xla_flags() == "--xla_cpu_use_fusion_emitters=false"
