"""What the ``test_nn_*.py`` files share: inputs and modules drawn with NumPy, and the NumPy
formulas of more than one file.

Eager JAX compiles every primitive for every new shape, which dominates CPU test time (each
random initializer of a new kernel shape compiles a program of its own). So inputs are drawn with
NumPy, modules whose initialization is not under test are built abstractly with
``nnx.eval_shape`` and filled with NumPy draws (:func:`build`), and modules called more than
once run under ``nnx.jit``.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

B, T, D, H, DH = 2, 9, 32, 4, 8  # batch, length, d_model, heads, head dim
TOL = dict(rtol=1e-5, atol=1e-5)  # float32 modules against float64 references


def f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def normal(seed, shape, scale=1.0):
    return scale * np.random.default_rng(seed).standard_normal(shape)


def f32(a):
    return jnp.asarray(a, jnp.float32)


def padding_mask(lengths, s):
    """``[B, 1, 1, S]``: True for the first ``lengths[b]`` keys of each row."""
    return (np.arange(s)[None, :] < np.asarray(lengths)[:, None])[:, None, None, :]


def build(make, seed, scale=0.3):
    """``make()`` built abstractly, every variable then drawn with NumPy: parameters (biases
    included) ``N(0, scale^2)``, norm scales ``1 + N(0, scale^2)``, PRNG keys (dropout streams)
    from ``seed``."""
    module = nnx.eval_shape(make)
    rng = np.random.default_rng(seed)
    for path, var in nnx.iter_graph(module):
        if not isinstance(var, nnx.Variable) or var.get_value() is None:
            continue
        x = var.get_value()
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            # rbg keys: XLA's RngBitGenerator compiles faster than threefry.
            key = jax.random.key(seed, impl="rbg")
            value = key if x.shape == () else jax.random.split(key, x.shape[0])
        elif jnp.issubdtype(x.dtype, jnp.integer):
            value = np.zeros(x.shape, x.dtype)
        else:
            draw = scale * rng.standard_normal(x.shape)
            value = jnp.asarray(1.0 + draw if path[-1] == "scale" else draw, x.dtype)
        var.set_value(value)
    return module


def layer_norm_ref(x, scale, bias, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * scale + bias


def gelu_exact(x):
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
