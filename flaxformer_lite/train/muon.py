"""Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable for LLM Training") over a model's
matrices: ``optax.contrib``'s Nesterov momentum and Newton-Schulz orthogonalization of each
projection as its own ``[in, out]`` matrix, the update's scale by its shape, decoupled weight
decay and the learning rate; and what its Newton-Schulz iterations cost.

    tx = muon(cfg, kernels, [], schedule, numbers)  # over the leaves optimizer_of gives it
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import optax
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from flaxformer_lite.nn.parametrization import by_role, path_key

if TYPE_CHECKING:
    from flaxformer_lite.train.sections import OptimizerConfig


def muon(cfg: OptimizerConfig, kernels: dict, scaled: list, learning_rate, numbers: dict):
    """Muon over the matrices (the other leaves masked out): each orthogonalized over its input
    and output axes (a scanned stack's layers and a fused q/k/v's three are batch axes), scaled
    by its shape (:func:`scale_by_shape`) and by muP's multipliers (``scaled``), decayed by
    ``weight_decay``, at ``muon_lr_ratio`` times ``learning_rate``.

    The Muon branch of ``optax.contrib.muon``, built here because that one's own AdamW branch
    decays every leaf it gets (norms and biases too) and labels leaves by mapping over the
    optimizer's ``nnx.Variable``s, which wraps its masked nodes in Variables."""

    def dimension_numbers(params):
        return by_role(kernels, lambda k: MuonDimensionNumbers(k.inputs, k.outputs), params)

    return optax.chain(
        scale_by_muon(
            ns_steps=cfg.muon_ns_steps,
            beta=numbers["muon_beta"],
            nesterov=True,
            weight_dimension_numbers=dimension_numbers,
        ),
        scale_by_shape(kernels, None if cfg.muon_rms is None else numbers["muon_rms"]),
        *scaled,
        optax.add_decayed_weights(numbers["weight_decay"]),
        optax.scale_by_learning_rate(lambda count: numbers["muon_lr_ratio"] * learning_rate(count)),
    )


def scale_by_shape(kernels: dict, rms) -> optax.GradientTransformation:
    """Each orthogonalized update times ``rms * sqrt(max(fan_in, fan_out))`` (an update of RMS
    ``rms``, Moonlight's), or without ``rms`` Keller Jordan's ``sqrt(max(1, fan_out / fan_in))``:
    the scale of ``optax.contrib.muon`` (not exported), over our matrices' input and output
    axes."""

    def update(updates, state, params=None):
        del params

        def scaled(path, update):
            kernel = kernels[path_key(path)]
            fan_in = math.prod(update.shape[i] for i in kernel.inputs)
            fan_out = math.prod(update.shape[i] for i in kernel.outputs)
            if rms is None:
                return update * math.sqrt(max(1.0, fan_out / fan_in))
            return update * (rms * math.sqrt(max(fan_in, fan_out)))

        return jax.tree_util.tree_map_with_path(scaled, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def newton_schulz_flops(cfg: OptimizerConfig, kernels: dict) -> float:
    """The FLOPs of Muon's Newton-Schulz iterations in one optimizer step, over the matrices of
    ``kernels`` (0 under AdamW): an iteration on an ``[m, n]`` matrix (``m <= n``) forms
    ``X X^T`` (``2 m^2 n``), its square (``2 m^3``) and their product with ``X`` (``2 m^2 n``)."""
    if cfg.name != "muon":
        return 0.0
    total = 0.0
    for kernel in kernels.values():
        if not kernel.matrix:
            continue
        fan_in = math.prod(kernel.shape[i] for i in kernel.inputs)
        fan_out = math.prod(kernel.shape[i] for i in kernel.outputs)
        copies = math.prod(kernel.shape) // (fan_in * fan_out)  # layers, a fused q/k/v's three
        m, n = sorted((fan_in, fan_out))
        total += copies * cfg.muon_ns_steps * (4 * m * m * n + 2 * m**3)
    return total
