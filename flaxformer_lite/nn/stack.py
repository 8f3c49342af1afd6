"""A stack of identical layers, run as a Python loop or as one ``nnx.scan``-ned layer.

With ``scan=True`` the layers' parameters are stacked along a leading ``"layers"`` axis and XLA
compiles one layer body however deep the model is (compile time independent of depth). With
``scan=False`` the stack is an ``nnx.List`` of layers unrolled into the program. Both compute the
same function: :func:`stack_layer_states` converts the loop's parameters into the scan's.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from flaxformer_lite.nn.dense import ADAPTED
from flaxformer_lite.nn.sharding import ACTIVATION_NAMES, constrain

# NOTE: an adapted projection's output (``x W + x A B``, a LoRA model's) is a sum, not a matmul
# output: the policies that save matmul outputs save it by name, or the backward pass would
# keep the adapter's own output to recompute it, as large again.
_ADAPTED = jax.checkpoint_policies.save_only_these_names(ADAPTED)
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_saveable, _ADAPTED
    ),
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _ADAPTED
    ),
}


class LayerStack(nnx.Module):
    """``num_layers`` layers built by ``make_layer(rngs)``, applied in order.

    Args:
      num_layers: depth L.
      make_layer: builds one layer from an ``nnx.Rngs``.
      scan: stack the parameters and run the layers with ``nnx.scan``.
      remat: rematerialization of each layer in the backward pass: ``"none"``, ``"full"`` (save
        only the layer inputs), ``"dots_saveable"`` (save matmul outputs), or
        ``"dots_with_no_batch_dims_saveable"``. It changes memory and time, never values.
    """

    def __init__(
        self,
        num_layers: int,
        make_layer: Callable[[nnx.Rngs], nnx.Module],
        *,
        scan: bool = False,
        remat: str = "none",
        rngs: nnx.Rngs,
    ):
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {tuple(REMAT_POLICIES)}, got {remat!r}")
        self.num_layers, self.scan, self.remat = num_layers, scan, remat
        if scan:

            @nnx.split_rngs(splits=num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make_stacked(rngs):
                return make_layer(rngs)

            self.layers = make_stacked(rngs)
        else:
            self.layers = nnx.List([make_layer(rngs) for _ in range(num_layers)])

    def __call__(self, x: jax.Array, *args, **kwargs) -> jax.Array:
        """``x [B, T, D] -> [B, T, D]``; ``args`` and ``kwargs`` go unchanged to every layer."""

        def apply(layer, x):
            return constrain(
                layer(constrain(x, ACTIVATION_NAMES), *args, **kwargs), ACTIVATION_NAMES
            )

        if self.remat != "none":
            # Inside a scan, the loop already keeps XLA from merging the recomputation away
            # (the JAX docs recommend prevent_cse=False there).
            apply = nnx.remat(apply, policy=REMAT_POLICIES[self.remat], prevent_cse=not self.scan)
        if self.scan:

            @nnx.scan(
                in_axes=(0, nnx.Carry),
                out_axes=nnx.Carry,
                transform_metadata={nnx.PARTITION_NAME: "layers"},
            )
            def run(layer, x):
                return apply(layer, x)

            return run(self.layers, x)
        for layer in self.layers:
            x = apply(layer, x)
        return x

    def init_cache(
        self, batch_size: int, max_length: int, *, context_length: int | None = None, dtype=None
    ) -> None:
        """Calls every layer's ``init_cache(batch_size, max_length, context_length=...,
        dtype=..., num_layers=...)``: the layers of a scanned stack are one module whose caches
        get a leading layer axis of ``num_layers``."""
        layers = [self.layers] if self.scan else list(self.layers)
        num_layers = self.num_layers if self.scan else None
        for layer in layers:
            layer.init_cache(
                batch_size,
                max_length,
                context_length=context_length,
                dtype=dtype,
                num_layers=num_layers,
            )


def stack_layer_states(layer_states: list) -> nnx.State:
    """Stacks per-layer states (of a loop stack) into the state of the equivalent scanned stack.

    ``nnx.state(loop_stack.layers)`` holds ``{0: state, 1: state, ...}``; pass the values in
    order and ``nnx.update(scan_stack.layers, stack_layer_states(...))``. The stacked parameters'
    logical axis names start with ``"layers"``, as those of a scanned stack do.
    """
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layer_states)
    for _, variable in nnx.to_flat_state(stacked):
        names = variable.get_metadata().get("out_sharding")
        if names:
            variable.set_metadata("out_sharding", ("layers", *names))
    return stacked
