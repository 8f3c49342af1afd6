"""The position-wise feed-forward network, plain or gated."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from flaxformer_lite.choices import ACTIVATIONS
from flaxformer_lite.nn.dense import XAVIER, Dense, KernelInit

# Elementwise nonlinearities; a gated MLP multiplies one of them into a second projection.
_NONLINEARITIES = {
    "relu": jax.nn.relu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "silu": jax.nn.silu,
}


def nonlinearity_of(activation: str):
    """The elementwise function behind an activation name (the gate's for swiglu/geglu)."""
    return _NONLINEARITIES[ACTIVATIONS[activation][0]]


class MLP(nnx.Module):
    """``FFN(x) = act(x W1 + b1) W2 + b2`` (the paper's ReLU network), or a gated variant
    ``(act(x W_gate) * (x W_up)) W_down`` for ``swiglu`` / ``geglu``.

    Args:
      d_model: input and output size D.
      d_ff: hidden size F.
      activation: one of ``relu`` (the paper), ``gelu`` (exact, BERT), ``gelu_tanh`` (GPT-2),
        ``silu``, ``swiglu`` (LLaMA), ``geglu``.
      use_bias: biases on the projections.
      init: initializer of the input projections; ``out_init`` of the output projection (which
        writes into the residual stream, so GPT-2 scales it down).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        activation: str = "relu",
        use_bias: bool = True,
        init: KernelInit = XAVIER,
        out_init: KernelInit | None = None,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
        nonlinearity, gated = ACTIVATIONS[activation]
        self.nonlinearity = _NONLINEARITIES[nonlinearity]
        common = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.wi = Dense(d_model, d_ff, names=("embed", "mlp"), init=init, **common)
        self.wi_gate = (
            Dense(d_model, d_ff, names=("embed", "mlp"), init=init, **common) if gated else None
        )
        self.wo = Dense(d_ff, d_model, names=("mlp", "embed"), init=out_init or init, **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[B, T, D] -> [B, T, D]``."""
        if self.wi_gate is None:
            hidden = self.nonlinearity(self.wi(x))
        else:
            hidden = self.nonlinearity(self.wi_gate(x)) * self.wi(x)
        return self.wo(hidden)
