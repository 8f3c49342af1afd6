"""The optimizer and learning-rate schedules, built from optax.

Schedules: linear warmup then cosine, linear or constant decay (optax), and the paper's
inverse-square-root schedule ``lr = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)``
(Vaswani et al. 2017, eq. 3), which optax does not ship. The optimizer is AdamW with a
weight-decay mask (kernels decay; norms, biases and embedding tables do not, by default) behind
global-norm clipping; or Muon (``optax.contrib.muon``) for the hidden matrices, each q, k, v and
output projection and each MLP kernel orthogonalized as its own ``[in, out]`` matrix, with AdamW
for the rest. Under muP each parameter's rate is multiplied by its role's power of the width
multiplier (:data:`~flaxformer_lite.nn.parametrization.MUP`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import optax

from flaxformer_lite.models.build import abstract_model
from flaxformer_lite.models.config import ModelConfig
from flaxformer_lite.models.pieces import user_pieces
from flaxformer_lite.models.width import growing_axes
from flaxformer_lite.nn.parametrization import Kernel, by_role, multiplier, parameter_roles
from flaxformer_lite.train.muon import muon
from flaxformer_lite.train.sections import OptimizerConfig


def make_schedule(cfg: OptimizerConfig, *, total_steps: int, d_model: int) -> optax.Schedule:
    """The learning rate at each optimizer step ``0 .. total_steps - 1``.

    Args:
      cfg: the optimizer configuration.
      total_steps: optimizer steps of the whole run (cosine and linear reach their end there).
      d_model: the model width, for ``inverse_sqrt``.
    """
    if cfg.schedule == "inverse_sqrt":
        return inverse_sqrt_schedule(cfg.lr, warmup_steps=cfg.warmup_steps, d_model=d_model)
    warmup_steps = fitted_warmup_steps(cfg, total_steps)
    end = cfg.lr * cfg.end_lr_ratio
    warmup = optax.linear_schedule(0.0, cfg.lr, warmup_steps)
    if cfg.schedule == "cosine":
        # optax counts the warmup inside decay_steps.
        return optax.warmup_cosine_decay_schedule(
            0.0, cfg.lr, warmup_steps, max(total_steps, 1), end_value=end
        )
    decay = (
        optax.linear_schedule(cfg.lr, end, max(total_steps - warmup_steps, 1))
        if cfg.schedule == "linear"
        else optax.constant_schedule(cfg.lr)
    )
    return optax.join_schedules([warmup, decay], [warmup_steps])


def fitted_warmup_steps(cfg: OptimizerConfig, total_steps: int) -> int:
    """The warmup the schedule uses: ``cfg.warmup_steps``, or a tenth of a run no longer than
    it (a short smoke run then still reaches ``lr`` and decays; a warmup as long as the run would
    reach ``lr`` only at its end). ``inverse_sqrt`` keeps its own."""
    if cfg.schedule == "inverse_sqrt" or cfg.warmup_steps < total_steps or not cfg.warmup_steps:
        return cfg.warmup_steps
    return total_steps // 10


def warmup_notice(cfg: OptimizerConfig, total_steps: int) -> str | None:
    """The one-line notice for a warmup shortened to fit the schedule's ``total_steps``."""
    fitted = fitted_warmup_steps(cfg, total_steps)
    if fitted == cfg.warmup_steps:
        return None
    longer = "longer than" if cfg.warmup_steps > total_steps else "as long as"
    return (
        f"optimizer.warmup_steps ({cfg.warmup_steps}) is {longer} the schedule's {total_steps} "
        f"steps: warming up over {fitted} steps instead"
    )


def inverse_sqrt_schedule(scale: float, *, warmup_steps: int, d_model: int) -> optax.Schedule:
    """The paper's ``scale * d_model^-0.5 * min(n^-0.5, n * warmup^-1.5)`` at step ``n = count + 1``
    (optax counts from 0; the paper's first step is 1): linear warmup, then 1/sqrt decay."""

    def schedule(count):
        n = jnp.asarray(count, jnp.float32) + 1.0
        return scale * d_model**-0.5 * jnp.minimum(n**-0.5, n * warmup_steps**-1.5)

    return schedule


def weight_decay_mask(params, *, decay_embeddings: bool = False):
    """True for the parameters weight decay applies to: projection kernels and their low-rank
    adapters' factors (and embedding tables if ``decay_embeddings``); never norm scales or
    biases.

    Works on any pytree whose paths name the parameters (``nnx.state(model, nnx.Param)``): the
    library names kernels ``kernel``, adapters ``lora`` and tables ``embedding``.
    """
    decayed = {"kernel", "lora", "embedding"} if decay_embeddings else {"kernel", "lora"}

    def decays(path, _):
        names = {getattr(key, "key", getattr(key, "name", None)) for key in path}
        return bool(names & decayed)

    return jax.tree_util.tree_map_with_path(decays, params)


# The optimizer's numbers besides its schedule: floats in a run's step, arrays in a sweep's (one
# compiled step for members that differ in them).
NUMBERS = ("b1", "b2", "eps", "weight_decay", "clip_norm", "muon_lr_ratio", "muon_rms", "muon_beta")


def make_optimizer(
    cfg: OptimizerConfig, model: ModelConfig, *, total_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``(transformation, schedule)`` of ``cfg`` for ``model``'s parameters."""
    schedule = make_schedule(cfg, total_steps=total_steps, d_model=model.d_model)
    numbers = {name: getattr(cfg, name) for name in NUMBERS}
    return optimizer_of(cfg, model, schedule, numbers), schedule


def optimizer_of(
    cfg: OptimizerConfig, model: ModelConfig, learning_rate: optax.Schedule, numbers: dict
) -> optax.GradientTransformation:
    """Clipping (if ``cfg.clip_norm`` is set), then AdamW with ``cfg``'s decay mask, or Muon for
    the matrices and AdamW for the rest, each with muP's rate multipliers, at ``learning_rate``
    by step and with the :data:`NUMBERS` of ``numbers``: floats, or scalar arrays traced in a
    step. The transformation's state has the same structure either way.

    Raises:
      ValueError: Muon or muP on parameters they cannot place (:func:`check_parameters`).
    """
    steps = [] if cfg.clip_norm is None else [optax.clip_by_global_norm(numbers["clip_norm"])]
    if cfg.name == "adamw" and model.width_multiplier is None:  # the chain runs always had
        adamw = optax.adamw(
            learning_rate,
            b1=numbers["b1"],
            b2=numbers["b2"],
            eps=numbers["eps"],
            weight_decay=numbers["weight_decay"],
            mask=functools.partial(weight_decay_mask, decay_embeddings=cfg.decay_embeddings),
        )
        return optax.chain(*steps, adamw) if steps else adamw
    check_parameters(cfg, model)
    kernels = model_kernels(model)
    adamw = _adamw(cfg, _rate_multipliers(model, kernels, "adamw_lr"), learning_rate, numbers)
    if cfg.name == "muon":
        field = "muon_rms_lr" if cfg.muon_rms is not None else "muon_lr"
        scaled = _rate_multipliers(model, kernels, field)
        labels = functools.partial(by_role, kernels, lambda k: "muon" if k.matrix else "adamw")
        update = optax.partition(
            {"muon": muon(cfg, kernels, scaled, learning_rate, numbers), "adamw": adamw}, labels
        )
    else:
        update = adamw
    return optax.chain(*steps, update)


def _adamw(cfg: OptimizerConfig, scaled: list, learning_rate, numbers: dict):
    """``optax.adamw`` as a chain with muP's multipliers (``scaled``) of the Adam direction
    before the decay: the decay per step stays ``lr * weight_decay``, as the mup package's
    MuAdamW keeps it (it divides a hidden matrix's rate by ``m`` and multiplies its decay)."""
    return optax.chain(
        optax.scale_by_adam(b1=numbers["b1"], b2=numbers["b2"], eps=numbers["eps"]),
        *scaled,
        optax.add_decayed_weights(
            numbers["weight_decay"],
            functools.partial(weight_decay_mask, decay_embeddings=cfg.decay_embeddings),
        ),
        optax.scale_by_learning_rate(learning_rate),
    )


def model_kernels(model: ModelConfig) -> dict[tuple, Kernel]:
    """Each parameter of ``model``'s by its path: its role and axes
    (:func:`~flaxformer_lite.nn.parametrization.parameter_roles` of the abstract model)."""
    # Configs equal as values may grow apart: a d_ff of 4 * d_model set, or left to derive.
    return _kernels(model, growing_axes(model))


@functools.cache
def _kernels(model: ModelConfig, growing: frozenset) -> dict[tuple, Kernel]:
    return parameter_roles(abstract_model(model), growing)


def check_parameters(cfg: OptimizerConfig, model: ModelConfig) -> None:
    """Muon needs a hidden matrix and cannot split a grouped q/k/v kernel; muP needs a role for
    every parameter. (A run checks before it writes anything.)

    Raises:
      ValueError: naming the setting (and the parameter) in the way.
    """
    if cfg.name == "adamw" and model.parametrization == "standard":
        return
    kernels = model_kernels(model)
    if model.parametrization == "mup":
        unknown = [path for path, kernel in kernels.items() if kernel.role == "unknown"]
        if unknown:
            pieces = ", ".join(f"model.{k}={v!r}" for k, v in user_pieces(model).items())
            raise ValueError(
                f"model.parametrization=mup cannot scale parameter {_path_name(unknown[0])}"
                + (f" (of {pieces})" if pieces else "")
                + ": not built by Dense or Embed, its logical axis names do not say which of its "
                "axes are inputs and which grow with the width"
            )
    if cfg.name != "muon":
        return
    if any(kernel.split and kernel.matrix for kernel in kernels.values()):
        raise ValueError(
            "optimizer.name=muon orthogonalizes q, k and v apart; model.fused_qkv with "
            "num_kv_heads < num_heads concatenates them along one axis, which Muon cannot "
            "split: set model.fused_qkv=false (the same projections as three kernels)"
        )
    if not any(kernel.matrix for kernel in kernels.values()):
        raise ValueError(
            "optimizer.name=muon: the model has no hidden matrix for Muon (no projection "
            "kernel from the width to the width); use optimizer.name=adamw"
        )


def optimizer_line(cfg: OptimizerConfig, model: ModelConfig) -> str | None:
    """The start-up line of Muon's and muP's share: how many parameters each optimizer
    updates, and the width multiplier; None for AdamW under the standard parametrization."""
    if cfg.name == "adamw" and model.width_multiplier is None:
        return None
    counts: dict[str, list[int]] = {}
    for kernel in model_kernels(model).values():
        name = "muon" if cfg.name == "muon" and kernel.matrix else "adamw"
        entry = counts.setdefault(name, [0, 0])
        entry[0] += 1
        entry[1] += math.prod(kernel.shape)
    parts = [f"{name} for {n} arrays ({size:,} parameters)" for name, (n, size) in counts.items()]
    line = "optimizer: " + ", ".join(sorted(parts, reverse=True))
    if model.width_multiplier is not None:
        line += (
            f"; muP at {model.width_multiplier:g}x its base width {model.mup_base_width} "
            "(docs/reference.md has each parameter's multipliers)"
        )
    return line


def _rate_multipliers(model: ModelConfig, kernels: dict, field: str) -> list:
    """muP's multiplier of each parameter's update by its role's ``field`` of
    :data:`~flaxformer_lite.nn.parametrization.MUP`: one masked ``optax.scale`` per factor other
    than 1 (none under the standard parametrization or at the base width)."""
    m = model.width_multiplier
    if m is None:
        return []
    factors = sorted({multiplier(field, k.role, m) for k in kernels.values()} - {1.0})
    return [
        optax.masked(
            optax.scale(f),
            functools.partial(by_role, kernels, lambda k, f=f: multiplier(field, k.role, m) == f),
        )
        for f in factors
    ]


def _path_name(path: tuple) -> str:
    return "/".join(map(str, path))


def schedule_table(schedule: optax.Schedule, steps: int) -> jax.Array:
    """``[steps]`` float32: the learning rate at optimizer steps ``0 .. steps - 1`` (computed op
    by op: a jitted table would compile once per schedule)."""
    return jax.vmap(schedule)(jnp.arange(steps)).astype(jnp.float32)


def table_schedule(table: jax.Array) -> optax.Schedule:
    """The schedule of a :func:`schedule_table`: its last rate after its last step."""
    return lambda count: table[jnp.minimum(count, table.shape[0] - 1)]
