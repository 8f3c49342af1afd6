"""Tests for flaxformer_lite.ops.projection: values and gradients against float64 NumPy formulas,
jit/vmap, dtypes, and which operand the kernel gradient's matmul transposes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core

from flaxformer_lite.ops import project

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

# (x shape, kernel shape, num_in_axes): wider output (fused q/k/v), multi-axis input (attention
# output), narrower output (the MLP's second projection), no token axes, a tied-embedding E^T.
CASES = [
    ((2, 5, 4), (4, 3, 2, 3), 1),
    ((2, 5, 2, 3), (2, 3, 6), 2),
    ((2, 5, 8), (8, 3), 1),
    ((4,), (4, 6), 1),
    ((3, 4), (4, 9), 1),
]


def _f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def _inputs(x_shape, kernel_shape, num_in_axes, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape)
    kernel = rng.standard_normal(kernel_shape)
    out_shape = x_shape[: len(x_shape) - num_in_axes] + kernel_shape[num_in_axes:]
    cotangent = rng.standard_normal(out_shape)
    return x, kernel, cotangent, (jnp.asarray(a, dtype) for a in (x, kernel, cotangent))


@pytest.mark.parametrize("x_shape, kernel_shape, n", CASES)
def test_value_and_gradients_match_float64_formulas(x_shape, kernel_shape, n):
    x, kernel, cotangent, (x_j, kernel_j, cotangent_j) = _inputs(x_shape, kernel_shape, n)
    y, vjp = jax.vjp(lambda a, b: project(a, b, n), x_j, kernel_j)
    dx, dkernel = vjp(cotangent_j)
    tokens = list(range(x.ndim - n))
    out_axes = list(range(cotangent.ndim - (kernel.ndim - n), cotangent.ndim))
    np.testing.assert_allclose(y, np.tensordot(x, kernel, axes=n), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        dx,
        np.tensordot(cotangent, kernel, axes=(out_axes, list(range(n, kernel.ndim)))),
        rtol=1e-5,
        atol=1e-5,
    )
    np.testing.assert_allclose(
        dkernel, np.tensordot(x, cotangent, axes=(tokens, tokens)), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("x_shape, kernel_shape, n", CASES)
def test_gradients_equal_autodiff_of_tensordot(x_shape, kernel_shape, n):
    *_, (x, kernel, cotangent) = _inputs(x_shape, kernel_shape, n)

    def loss(fn):
        return jax.jit(jax.grad(lambda a, b: jnp.sum(fn(a, b) * cotangent), argnums=(0, 1)))

    ours = loss(lambda a, b: project(a, b, n))(x, kernel)
    reference = loss(lambda a, b: jnp.tensordot(a, b, axes=n))(x, kernel)
    for got, want in zip(ours, reference, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_vmap_over_kernels_matches_a_loop():
    *_, (x, _, cotangent) = _inputs((2, 5, 8), (8, 3), 1)
    kernels = jnp.asarray(np.random.default_rng(1).standard_normal((4, 8, 3)), jnp.float32)

    def kernel_grad(kernel):
        return jax.grad(lambda k: jnp.sum(project(x, k) * cotangent))(kernel)

    batched = jax.vmap(kernel_grad)(kernels)
    for i in range(4):
        np.testing.assert_allclose(batched[i], kernel_grad(kernels[i]), rtol=1e-6, atol=1e-6)


def test_bfloat16_gradients_keep_their_dtypes():
    *_, (x, kernel, cotangent) = _inputs((2, 5, 8), (8, 3), 1, jnp.bfloat16)
    y, vjp = jax.vjp(project, x, kernel)
    dx, dkernel = vjp(cotangent)
    assert y.dtype == dx.dtype == dkernel.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        _f64(dkernel),
        np.tensordot(_f64(x), _f64(cotangent), axes=([0, 1], [0, 1])),
        rtol=3e-2,
        atol=3e-1,
    )


def test_mismatched_shapes_raise_naming_them():
    with pytest.raises(ValueError, match=r"\(2, 5, 4\).*\(3,\).*\(3, 6\)"):
        project(jnp.zeros((2, 5, 4)), jnp.zeros((3, 6)))
    with pytest.raises(ValueError, match="contracts 3 axes"):
        project(jnp.zeros((5, 4)), jnp.zeros((5, 4, 6)), 3)


def _kernel_gradient_lhs(x, kernel, n):
    """The lhs operand shape of the backward pass's matmul that contracts the token axes."""
    jaxpr = jax.make_jaxpr(jax.grad(lambda a, b: jnp.sum(project(a, b, n)), argnums=1))(x, kernel)
    tokens = x.shape[: x.ndim - n]
    lhs_shapes = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                (lhs_contracting, _), _ = eqn.params["dimension_numbers"]
                lhs = eqn.invars[0].aval.shape
                if tuple(lhs[i] for i in lhs_contracting) == tokens:
                    lhs_shapes.append(lhs)
            for sub in jax_core.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(jaxpr.jaxpr)
    assert len(lhs_shapes) == 1, lhs_shapes
    return lhs_shapes[0]


@pytest.mark.parametrize(
    "kernel_shape, narrower",
    [((8, 32), "x"), ((32, 8), "g"), ((16, 16), "x"), ((8, 2, 16), "x")],
)
def test_kernel_gradient_transposes_the_narrower_operand(kernel_shape, narrower):
    """XLA's CPU GEMMs copy the lhs of ``x^T g`` transposed: it must be the smaller operand."""
    x = jnp.zeros((4, 16, kernel_shape[0]))
    out_shape = (4, 16, *kernel_shape[1:])
    expected = x.shape if narrower == "x" else out_shape
    assert _kernel_gradient_lhs(x, jnp.zeros(kernel_shape), 1) == expected


def test_an_untrained_kernel_s_backward_keeps_only_the_kernel():
    """``trained=False`` (a LoRA model's frozen base): the same value and input gradient, and
    the residuals of its VJP with respect to ``x`` hold no copy of ``x``."""
    _, _, _, (x, kernel, _) = _inputs((2, 5, 4), (4, 3, 2, 3), 1)

    def loss(x, trained):
        return jnp.sum(project(x, kernel, 1, trained=trained) ** 2)

    np.testing.assert_array_equal(project(x, kernel, 1, trained=False), project(x, kernel, 1))
    np.testing.assert_allclose(
        jax.grad(loss)(x, False), jax.grad(loss)(x, True), rtol=1e-6, atol=1e-6
    )

    def residual_shapes(trained):  # a VJP function's leaves are the residuals it keeps
        vjp = jax.vjp(lambda x: project(x, kernel, 1, trained=trained), x)[1]
        return [r.shape for r in jax.tree.leaves(vjp)]

    shapes = {trained: residual_shapes(trained) for trained in (True, False)}
    assert x.shape in shapes[True] and x.shape not in shapes[False], shapes
