"""The linear projection every module uses, with a backward pass laid out for fast GEMMs.

``project(x, kernel, num_in_axes)`` is ``jnp.tensordot(x, kernel, num_in_axes)``: the same
forward and the same gradients, computed by a custom VJP (conventions in
:mod:`flaxformer_lite.ops`) that chooses how the kernel gradient ``dW = xᵀ g`` (``g`` the output
gradient) is formed.

Why: ``dW`` contracts the token axes of both operands, so a CPU GEMM first copies one of them
transposed. Autodiff always copies ``g`` (often a residual gradient XLA re-derives in each copy);
this copies the narrower operand. GPU and TPU GEMMs read transposed operands and lose nothing.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


def project(
    x: jax.Array, kernel: jax.Array, num_in_axes: int = 1, *, trained: bool = True
) -> jax.Array:
    """``x @ kernel`` over the last ``num_in_axes`` axes of ``x``.

    Args:
      x: ``[..., *in_shape]``.
      kernel: ``[*in_shape, *out_shape]`` with the dtype of ``x`` (cast both beforehand).
      num_in_axes: how many trailing axes of ``x`` (leading axes of ``kernel``) are contracted.
      trained: False for a kernel no gradient is taken of (a LoRA model's base): the plain
        ``tensordot``, whose backward pass keeps only the kernel, where the custom VJP's
        residuals would keep ``x`` too (a scanned stack saves every residual of every layer).

    Returns:
      ``[..., *out_shape]`` in the result dtype of ``jnp.tensordot(x, kernel, num_in_axes)``.

    Raises:
      ValueError: if the contracted axes of ``x`` and ``kernel`` differ.
    """
    in_shape = kernel.shape[:num_in_axes]
    if num_in_axes < 1 or x.ndim < num_in_axes or x.shape[x.ndim - num_in_axes :] != in_shape:
        raise ValueError(
            f"project contracts {num_in_axes} axes: x of shape {x.shape} must end with the "
            f"kernel's leading axes {in_shape} (kernel shape {kernel.shape})"
        )
    if not trained:
        return jnp.tensordot(x, kernel, axes=num_in_axes)
    return _project(x, kernel, num_in_axes)


def _project_fwd(x, kernel, num_in_axes):
    return jnp.tensordot(x, kernel, axes=num_in_axes), (x, kernel)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _project(x, kernel, num_in_axes):
    return _project_fwd(x, kernel, num_in_axes)[0]


def _project_bwd(num_in_axes, residuals, g):
    x, kernel = residuals
    num_out_axes = kernel.ndim - num_in_axes
    out_axes = tuple(range(g.ndim - num_out_axes, g.ndim))
    dx = jnp.tensordot(g, kernel, axes=(out_axes, tuple(range(num_in_axes, kernel.ndim))))
    tokens = tuple(range(x.ndim - num_in_axes))
    in_size = math.prod(kernel.shape[:num_in_axes])
    out_size = math.prod(kernel.shape[num_in_axes:])
    if out_size < in_size:
        # g is the narrower operand: form dW^T = g^T x and transpose the small [out, in] result.
        dw_t = jnp.tensordot(g, x, axes=(tokens, tokens))
        dw = jnp.transpose(
            dw_t, tuple(range(num_out_axes, kernel.ndim)) + tuple(range(num_out_axes))
        )
    else:
        dw = jnp.tensordot(x, g, axes=(tokens, tokens))
    return dx.astype(x.dtype), dw.astype(kernel.dtype)


_project.defvjp(_project_fwd, _project_bwd)
