"""How each parameter scales with the model's width: the standard parametrization, or muP
(maximal update parametrization; Yang et al. 2022, Tensor Programs V, Table 8) relative to a base
width, under which the best learning rate of a narrow model is the best of a wide one.

A parameter's role follows from the logical names of its axes and which of them grow with the
width (under muP: those larger than in the base model, ``models.width.growing_axes``): a kernel
that maps a growing size to a growing size is ``hidden``, one that maps a fixed size to a growing
one (an embedding table, the projection of continuous inputs) is ``input``, one that maps a
growing size to a fixed one (the vocabulary head, a classifier) is ``output``; biases, norm
scales and whatever has no growing axis are ``vector``. :data:`MUP` gives each role's
multipliers as powers of the width multiplier ``m = d_model / base_width``; docs/reference.md
has the same table, and a test holds the two together. Muon's matrices are the projections
between :data:`WIDTH_AXES`, whatever the parametrization.

    roles = parameter_roles(model, growing)  # {("decoder", ..., "wi", "kernel"): Kernel(...)}
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from flaxformer_lite.choices import WIDTH_AXES

if TYPE_CHECKING:
    from flax import nnx

ROLES = ("input", "hidden", "output", "vector")


@dataclasses.dataclass(frozen=True)
class Rule:
    """A role's multipliers under muP, each the power of ``m`` it is multiplied by.

    Attributes:
      init_normal: the initial standard deviation of ``init=normal``.
      init_xavier: the same of ``init=xavier`` (Glorot's fans already grow with the width; an
        embedding table's ``D^-1/2`` is held at the base width's).
      adamw_lr: AdamW's learning rate (its decoupled weight decay with it, as PyTorch's
        per-group rate scales both).
      muon_lr: Muon's learning rate, with Muon's own shape scale ``sqrt(max(1, out / in))``.
      muon_rms_lr: the same with ``optimizer.muon_rms`` set (updates of a fixed RMS, whose
        spectral norm grows with ``sqrt(m)``).
      output: the multiplier of what the parameter computes (the logits of an output head).
    """

    init_normal: float = 0.0
    init_xavier: float = 0.0
    adamw_lr: float = 0.0
    muon_lr: float = 0.0
    muon_rms_lr: float = 0.0
    output: float = 0.0


MUP = {
    "input": Rule(init_xavier=0.5),
    "hidden": Rule(init_normal=-0.5, adamw_lr=-1.0, muon_rms_lr=-0.5),
    "output": Rule(output=-1.0),
    "vector": Rule(),
}


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A parameter's role and, for a projection kernel, which of its axes are its inputs,
    outputs and stacked copies (the layers of a scanned stack, the 3 of a fused q/k/v).

    ``matrix``: a projection between width-like axes, which Muon orthogonalizes. ``split``:
    separate projections concatenated along an output axis (a grouped q/k/v kernel
    ``[D, H + 2 Hk, Dh]``); ``shape``: the parameter's."""

    role: str
    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    matrix: bool = False
    split: bool = False
    shape: tuple[int, ...] = ()


def role_of(names: tuple, num_in_axes: int, growing: frozenset = WIDTH_AXES) -> str:
    """The role of a kernel whose axes have logical ``names``, the first ``num_in_axes`` its
    inputs (a leading ``"layers"`` axis of a scanned stack is neither), the ``growing`` ones
    those that grow with the width."""
    names = tuple(name for name in names if name != "layers")
    wide_in = bool(growing & set(names[:num_in_axes]))
    wide_out = bool(growing & set(names[num_in_axes:]))
    if wide_in and wide_out:
        return "hidden"
    if wide_in:
        return "output"
    return "input" if wide_out else "vector"


def multiplier(rule_field: str, role: str, width_multiplier: float | None) -> float:
    """``m ** MUP[role].<rule_field>`` under muP (``width_multiplier`` is ``m``); 1 under the
    standard parametrization (``width_multiplier`` None)."""
    if width_multiplier is None:
        return 1.0
    return width_multiplier ** getattr(MUP[role], rule_field)


def attention_scale(head_dim: int, base_head_dim: int | None) -> float | None:
    """The attention logits' multiplier: muP's ``1 / Dh`` (the dot product of two correlated
    vectors grows with ``Dh``), times ``sqrt(base_head_dim)`` so that at the base width it is
    the standard ``1 / sqrt(Dh)``; None (the standard) without a base."""
    if base_head_dim is None:
        return None
    return math.sqrt(base_head_dim) / head_dim


def parameter_roles(model: nnx.Module, growing: frozenset = WIDTH_AXES) -> dict[tuple, Kernel]:
    """Every ``nnx.Param`` of ``model`` by its path: its :class:`Kernel` (``Dense`` and ``Embed``
    hold their roles, from the ``growing`` axes of their init); role ``"unknown"`` for a
    parameter of several axes, some growing, not built by them (a user's piece): which of its
    axes are inputs its names do not say. Works on an abstract model (``nnx.eval_shape``)."""
    # The roles' table above is read by the config (muP's checks), which imports no JAX.
    from flax import nnx

    from flaxformer_lite.nn.dense import Dense
    from flaxformer_lite.nn.embed import Embed

    roles: dict[tuple, Kernel] = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Dense):
            roles[(*path, "kernel")] = node.kernel_axes()
            if node.bias is not None:
                roles[(*path, "bias")] = Kernel("vector")
        elif isinstance(node, Embed):
            roles[(*path, "embedding")] = Kernel(node.role)
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            kernel = roles[path] if path in roles else _role_by_names(node, growing)
            roles[path] = dataclasses.replace(kernel, shape=tuple(node.shape))
    return roles


def by_role(kernels: dict, value_of, params):
    """``params`` with each parameter replaced by ``value_of(its Kernel)`` (``kernels`` from
    :func:`parameter_roles`): works on an optimizer's trees of ``nnx.Variable``s (at init), of
    arrays (at each update) and on those an ``optax.partition`` has masked."""
    import jax
    from flax import nnx

    def value(path, _):
        return value_of(kernels[path_key(path)])

    return jax.tree_util.tree_map_with_path(
        value, params, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def path_key(path) -> tuple:
    """A tree path of a parameter as :func:`parameter_roles` keys it."""
    keys = tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path)
    return keys[:-1] if keys and keys[-1] == "value" else keys


def _role_by_names(param: nnx.Param, growing: frozenset) -> Kernel:
    """A parameter's role from its shape and logical names: one axis (besides the layers), or
    none that grows (AFT's pairwise position biases), is a ``vector``; else ``unknown``."""
    names = param.get_metadata().get("out_sharding") or ()
    layers = sum(name == "layers" for name in names)
    if param.ndim - layers <= 1:
        return Kernel("vector")
    if len(names) == param.ndim and not growing & set(names):
        return Kernel("vector")
    return Kernel("unknown")
