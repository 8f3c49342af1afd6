"""Low-rank adapters (LoRA, Hu et al. 2021) on the projections of a built model, computed as
Hugging Face PEFT computes them: a targeted :class:`~.dense.Dense` ``x -> x W`` becomes

    y = x W + scale * dropout(x) A B,    A [*in, r],  B [r, *out],  scale = alpha / r

(``alpha / sqrt(r)`` with rsLoRA), ``A`` drawn as PEFT draws it (kaiming-uniform,
``U(±1/sqrt(in))``), ``B`` zeros, so a model with fresh adapters computes what its base does.
The factors are ``nnx.LoRAParam``s: a run with adapters trains those alone (:func:`trainable`)
and keeps the base's ``nnx.Param``s (:data:`BASE`) as they were.

    add_adapters(model, rank=8, alpha=16, targets=("attention", "mlp"), rngs=rngs)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from flaxformer_lite.nn.rngs import apply_dropout, dropout, next_key
from flaxformer_lite.ops.projection import project

# A target names projections by the parts of their path, besides these groups.
TARGET_GROUPS = {"attention": ("self_attention", "cross_attention"), "mlp": ("mlp",)}
BASE = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))  # the base model's parameters


class LoRA(nnx.Module):
    """The adapter of one projection ``[*in_shape] -> [*out_shape]``: ``x -> scale *
    dropout(x) A B``.

    Args:
      in_shape, out_shape: the projection's feature axes.
      in_names, out_names: their logical axis names (``A``'s rank axis and ``B``'s are
        replicated: ``r`` is small).
      rank: ``r``.
      scale: ``alpha / r`` (or ``alpha / sqrt(r)``).
      dropout_rate: PEFT's ``lora_dropout``, on the adapter's input only.
    """

    def __init__(
        self,
        in_shape: tuple[int, ...],
        out_shape: tuple[int, ...],
        *,
        in_names: tuple,
        out_names: tuple,
        rank: int,
        scale: float,
        dropout_rate: float = 0.0,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.num_in, self.scale, self.dtype = len(in_shape), scale, dtype
        # torch's kaiming_uniform_(a=sqrt(5)), PEFT's init of A: bound sqrt(3 / 3 fan_in).
        init_a = nnx.initializers.variance_scaling(
            1 / 3, "fan_in", "uniform", in_axis=tuple(range(len(in_shape))), out_axis=-1
        )
        self.a = nnx.LoRAParam(
            init_a(next_key(rngs.params), (*in_shape, rank), param_dtype),
            out_sharding=(*in_names, None),
            eager_sharding=False,
        )
        self.b = nnx.LoRAParam(
            jnp.zeros((rank, *out_shape), param_dtype),
            out_sharding=(None, *out_names),
            eager_sharding=False,
        )
        self.dropout = dropout(dropout_rate, rngs, "lora")

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[..., *in_shape] -> [..., *out_shape]`` in the compute dtype."""
        x = apply_dropout(self.dropout, x.astype(self.dtype))
        low = project(x, self.a[...].astype(self.dtype), self.num_in)
        return project(low, self.b[...].astype(self.dtype), 1) * self.scale

    def delta(self) -> jax.Array:
        """``scale * A B``, what merging adds to the kernel ``[*in, *out]``, in float32."""
        a, b = self.a[...].astype(jnp.float32), self.b[...].astype(jnp.float32)
        product = functools.partial(jnp.tensordot, axes=1)
        if a.ndim > self.num_in + 1:  # a scanned stack's: one pair per layer
            product = jax.vmap(product)
        return self.scale * product(a, b)


def lora_scale(alpha: float, rank: int, rslora: bool = False) -> float:
    """PEFT's ``scaling``: ``alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``."""
    return alpha / (math.sqrt(rank) if rslora else rank)


def projections(model: nnx.Module) -> dict[str, nnx.Module]:
    """Every :class:`~.dense.Dense` of ``model`` by its dotted path (a loop stack's layers
    as ``layers.{i}``)."""
    from flaxformer_lite.nn.dense import Dense

    return {
        ".".join(map(str, path)): node
        for path, node in nnx.iter_graph(model)
        if isinstance(node, Dense)
    }


def targeted(model: nnx.Module, targets: Sequence[str]) -> dict[str, nnx.Module]:
    """The projections of ``model`` that ``targets`` name, by path: a target is a group
    (``attention``: every projection of self- and cross-attention; ``mlp``), a projection's name
    (``query``, ``qkv``, ``out``, ``wi``, ``wo``, ...), or consecutive parts of its path
    (``cross_attention.query``, ``self_attention``).

    Raises:
      ValueError: a target that names no projection (the model's names listed), or none given.
    """
    if not targets:
        raise ValueError("lora.targets is empty: name the projections to adapt")
    found = projections(model)
    chosen: dict[str, nnx.Module] = {}
    for target in targets:
        alternatives = [(part,) for part in TARGET_GROUPS.get(target, ())] or [
            tuple(target.split("."))
        ]
        matched = {
            path: dense
            for path, dense in found.items()
            if any(_contains(path.split("."), parts) for parts in alternatives)
        }
        if not matched:
            names = sorted({path.rsplit(".", 1)[-1] for path in found})
            raise ValueError(
                f"lora.targets: {target!r} names no projection of this model (its projections: "
                f"{', '.join(names)}; groups: {', '.join(TARGET_GROUPS)})"
            )
        chosen.update(matched)
    return dict(sorted(chosen.items()))


def _contains(parts: list[str], sub: tuple[str, ...]) -> bool:
    return any(tuple(parts[i : i + len(sub)]) == sub for i in range(len(parts) - len(sub) + 1))


def add_adapters(
    model: nnx.Module,
    *,
    rank: int,
    alpha: float,
    targets: Sequence[str],
    dropout_rate: float = 0.0,
    rslora: bool = False,
    rngs: nnx.Rngs,
) -> list[str]:
    """Gives each projection of ``model`` that ``targets`` name (:func:`targeted`) a fresh
    :class:`LoRA` of ``rank``; returns their paths. A scanned stack's projection gets one
    adapter per layer (a leading ``layers`` axis), as its kernel has.

    Raises:
      ValueError: a target that names no projection; a rank below 1 or above a targeted
        matrix's smaller side (naming it).
    """
    chosen = targeted(model, targets)
    if rank < 1:
        raise ValueError(f"lora.rank must be at least 1, got {rank}")
    for path, dense in chosen.items():
        in_size, out_size = math.prod(dense.in_shape), math.prod(dense.out_shape)
        if rank > min(in_size, out_size):
            raise ValueError(
                f"lora.rank={rank} is larger than the matrix {path} ({in_size} x {out_size}): "
                f"at most {min(in_size, out_size)}"
            )
    scale = lora_scale(alpha, rank, rslora)
    for dense in chosen.values():
        dense.lora = _adapter_of(dense, rank, scale, dropout_rate, rngs)
    return list(chosen)


def _adapter_of(dense, rank: int, scale: float, dropout_rate: float, rngs: nnx.Rngs) -> LoRA:
    names = tuple(dense.kernel.get_metadata()["out_sharding"])
    layers = dense.kernel.ndim - len(dense.in_shape) - len(dense.out_shape)
    names = names[layers:]
    num_in = len(dense.in_shape)

    def make(rngs):
        return LoRA(
            dense.in_shape,
            dense.out_shape,
            in_names=names[:num_in],
            out_names=names[num_in:],
            rank=rank,
            scale=scale,
            dropout_rate=dropout_rate,
            dtype=dense.dtype,
            param_dtype=dense.kernel.dtype,
            rngs=rngs,
        )

    if not layers:
        return make(rngs)
    # A scanned stack's layers: one adapter each, stacked as LayerStack stacks its layers.
    stacked = nnx.split_rngs(splits=dense.kernel.shape[0])(
        nnx.vmap(make, in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    )
    return stacked(rngs)


def has_adapters(tree) -> bool:
    """Whether a model or state holds :class:`LoRA` factors."""
    state = tree if isinstance(tree, nnx.State) else nnx.state(tree)
    return bool(jax.tree.leaves(nnx.filter_state(state, nnx.LoRAParam)))


def trainable(tree) -> nnx.filterlib.Filter:
    """What a step trains: the adapters of a model (or state) that has them, else every
    ``nnx.Param``."""
    return nnx.LoRAParam if has_adapters(tree) else nnx.Param


def merge_adapters(model: nnx.Module) -> int:
    """Adds each adapter's ``scale * A B`` to its kernel and removes the adapter, in place:
    the model then computes what it did (dropout off) with plain projections, the function a
    merged export holds. Returns how many were merged."""
    merged = 0
    for dense in projections(model).values():
        if dense.lora is None:
            continue
        kernel = dense.kernel[...]
        delta = dense.lora.delta()
        dense.kernel[...] = (kernel.astype(jnp.float32) + delta).astype(kernel.dtype)
        dense.lora = None
        merged += 1
    return merged
