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

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from flaxformer_lite.models.build import abstract_model
from flaxformer_lite.models.config import ModelConfig
from flaxformer_lite.models.pieces import user_pieces
from flaxformer_lite.nn.parametrization import Kernel, multiplier, parameter_roles
from flaxformer_lite.settings import setting

SCHEDULES = ("cosine", "linear", "constant", "inverse_sqrt")
OPTIMIZERS = ("adamw", "muon")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW or Muon, the schedule and clipping. Defaults suit the small CPU models; the paper
    presets use ``schedule="inverse_sqrt", lr=1.0, warmup_steps=4000, b2=0.98, eps=1e-9``. Each
    field's help is beside it. A run resumed with more ``train.steps`` keeps the span its
    schedule had (the rate stays at its end value after it), unless ``schedule_steps`` is set
    (with ``--force``) to stretch it.
    """

    name: str = setting(
        "adamw",
        help="adamw, or muon: Muon (optax.contrib.muon) for the hidden matrices, AdamW (b1, b2, "
        "eps) for embeddings, the output head, norms and biases",
    )

    lr: float = setting(
        3e-3,
        help="the peak learning rate (inverse_sqrt: the multiplier of the paper's formula, 1.0 the "
        "paper's)",
    )
    schedule: str = setting(
        "cosine",
        help="cosine, linear (to end_lr_ratio * lr at the last step), constant (after warmup) or "
        "inverse_sqrt",
    )
    warmup_steps: int = setting(
        100,
        help="linear warmup steps from 0 to lr (a run shorter than it warms up over a tenth of its "
        "steps)",
    )
    end_lr_ratio: float = setting(
        0.1, help="the last learning rate of cosine / linear, as a share of lr"
    )
    b1: float = setting(0.9, help="Adam's first-moment decay")
    b2: float = setting(0.999, help="Adam's second-moment decay")
    eps: float = setting(1e-8, help="Adam's epsilon")
    weight_decay: float = setting(
        0.01, help="decoupled weight decay (AdamW) of the kernels; 0 is Adam"
    )
    decay_embeddings: bool = setting(
        False, help="also decay the embedding tables (norms and biases never)"
    )
    clip_norm: float | None = setting(
        1.0, help="clip the global gradient norm to this; null: no clipping"
    )
    schedule_steps: int | None = setting(
        None, help="steps the cosine / linear decay spans; null: train.steps (kept on resume)"
    )
    muon_lr_ratio: float = setting(
        1.0, help="muon: the matrices' learning rate as a multiple of lr (the schedule's)"
    )
    muon_rms: float | None = setting(
        0.2,
        help="muon: scale each orthogonalized update to this RMS times its rate, AdamW's typical "
        "RMS (Moonlight's rule: Muon then takes AdamW's lr and weight decay); null: Keller "
        "Jordan's scale sqrt(max(1, fan_out / fan_in)), which wants a larger muon_lr_ratio",
    )
    muon_beta: float = setting(0.95, help="muon: the momentum (Nesterov) of the matrices")
    muon_ns_steps: int = setting(5, help="muon: Newton-Schulz iterations per update")

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer.name must be one of {OPTIMIZERS}, got {self.name!r}")
        for name in ("muon_lr_ratio", "muon_rms"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or value <= 0
            ):
                raise ValueError(f"optimizer.{name} must be a number > 0, got {value!r}")
        if not 0 <= self.muon_beta < 1:
            raise ValueError(f"optimizer.muon_beta must be in [0, 1), got {self.muon_beta!r}")
        if not isinstance(self.muon_ns_steps, int) or self.muon_ns_steps < 1:
            raise ValueError(
                f"optimizer.muon_ns_steps must be an int >= 1, got {self.muon_ns_steps!r}"
            )
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"optimizer.schedule must be one of {SCHEDULES}, got {self.schedule!r}"
            )
        for name in ("lr", "b1", "b2", "eps", "weight_decay", "end_lr_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"optimizer.{name} must be a number >= 0, got {value!r}")
        if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
            raise ValueError(f"optimizer.b1 and b2 must be in [0, 1), got {self.b1}, {self.b2}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(
                f"optimizer.warmup_steps must be an int >= 0, got {self.warmup_steps!r}"
            )
        if self.schedule == "inverse_sqrt" and self.warmup_steps < 1:
            raise ValueError("optimizer.schedule='inverse_sqrt' needs warmup_steps >= 1")
        if self.schedule_steps is not None and self.schedule_steps < 1:
            raise ValueError(
                f"optimizer.schedule_steps must be >= 1 or None, got {self.schedule_steps!r}"
            )
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"optimizer.clip_norm must be > 0 or None, got {self.clip_norm!r}")


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
    if cfg.schedule != "constant" and 0 < total_steps == warmup_steps:
        # No steps left to decay over (optax refuses a span of 0): the limit of a shrinking
        # span, the end value from total_steps on, as when a decay reaches its end there.
        return optax.join_schedules([warmup, optax.constant_schedule(end)], [warmup_steps])
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
    """The warmup the schedule uses: ``cfg.warmup_steps``, or a tenth of a run shorter than it
    (a short smoke run then still reaches ``lr`` and decays). ``inverse_sqrt`` keeps its own."""
    if cfg.schedule == "inverse_sqrt" or cfg.warmup_steps <= total_steps:
        return cfg.warmup_steps
    return total_steps // 10


def warmup_notice(cfg: OptimizerConfig, total_steps: int) -> str | None:
    """The one-line notice for a warmup shortened to fit the run, else None."""
    fitted = fitted_warmup_steps(cfg, total_steps)
    if fitted == cfg.warmup_steps:
        return None
    return (
        f"optimizer.warmup_steps ({cfg.warmup_steps}) is longer than the run's {total_steps} "
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
    """True for the parameters weight decay applies to: projection kernels (and embedding
    tables if ``decay_embeddings``); never norm scales or biases.

    Works on any pytree whose paths name the parameters (``nnx.state(model, nnx.Param)``): the
    library names kernels ``kernel`` and tables ``embedding``.
    """
    decayed = {"kernel", "embedding"} if decay_embeddings else {"kernel"}

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
    """Clipping (if ``cfg.clip_norm`` is set), then AdamW with ``cfg``'s decay mask or Muon and
    AdamW, then muP's rate multipliers, at ``learning_rate`` by step and with the
    :data:`NUMBERS` of ``numbers``: floats, or scalar arrays traced in a step. The
    transformation's state has the same structure either way.

    Raises:
      ValueError: Muon or muP on parameters they cannot place (:func:`check_parameters`).
    """
    adamw = optax.adamw(
        learning_rate,
        b1=numbers["b1"],
        b2=numbers["b2"],
        eps=numbers["eps"],
        weight_decay=numbers["weight_decay"],
        mask=lambda params: weight_decay_mask(params, decay_embeddings=cfg.decay_embeddings),
    )
    steps = [] if cfg.clip_norm is None else [optax.clip_by_global_norm(numbers["clip_norm"])]
    if cfg.name == "adamw" and model.width_multiplier is None:
        return optax.chain(*steps, adamw) if steps else adamw
    check_parameters(cfg, model)
    kernels = model_kernels(model)
    if cfg.name == "muon":
        labels = functools.partial(_leaf_values, kernels, lambda k: _optimizer_of(cfg, k))
        update = optax.partition(
            {"muon": _muon(cfg, kernels, learning_rate, numbers), "adamw": adamw}, labels
        )
    else:
        update = adamw
    steps.append(update)
    for factor, mask in _rate_multipliers(cfg, model, kernels):
        steps.append(optax.masked(optax.scale(factor), mask))
    return optax.chain(*steps)


@functools.cache
def model_kernels(model: ModelConfig) -> dict[tuple, Kernel]:
    """Each parameter of ``model``'s by its path: its role and axes
    (:func:`~flaxformer_lite.nn.parametrization.parameter_roles` of the abstract model)."""
    return parameter_roles(abstract_model(model))


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
                f"model.parametrization=mup cannot scale parameter {_path_name(unknown[0])} "
                f"(of the user's pieces {pieces}): not built by Dense or Embed, its logical axis "
                "names do not say which of its axes grow with the width"
            )
    if cfg.name != "muon":
        return
    if any(kernel.split and kernel.role == "hidden" for kernel in kernels.values()):
        raise ValueError(
            "optimizer.name=muon orthogonalizes q, k and v apart; model.fused_qkv with "
            "num_kv_heads < num_heads concatenates them along one axis, which Muon cannot "
            "split: set model.fused_qkv=false (the same projections as three kernels)"
        )
    if not any(_optimizer_of(cfg, kernel) == "muon" for kernel in kernels.values()):
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
        entry = counts.setdefault(_optimizer_of(cfg, kernel), [0, 0])
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


def newton_schulz_flops(cfg: OptimizerConfig, model: ModelConfig) -> float:
    """The FLOPs of Muon's Newton-Schulz iterations in one optimizer step, over every matrix of
    ``model`` (0 under AdamW): an iteration on an ``[m, n]`` matrix (``m <= n``) forms ``X X^T``
    (``2 m^2 n``), its square (``2 m^3``) and their product with ``X`` (``2 m^2 n``)."""
    if cfg.name != "muon":
        return 0.0
    total = 0.0
    for kernel in model_kernels(model).values():
        if _optimizer_of(cfg, kernel) != "muon":
            continue
        fan_in = math.prod(kernel.shape[i] for i in kernel.inputs)
        fan_out = math.prod(kernel.shape[i] for i in kernel.outputs)
        copies = math.prod(kernel.shape) // (fan_in * fan_out)  # layers, the q/k/v of a fused one
        m, n = sorted((fan_in, fan_out))
        total += copies * cfg.muon_ns_steps * (4 * m * m * n + 2 * m**3)
    return total


def _optimizer_of(cfg: OptimizerConfig, kernel: Kernel) -> str:
    """``"muon"`` for a hidden projection kernel under Muon, else ``"adamw"``."""
    is_matrix = kernel.role == "hidden" and bool(kernel.inputs)
    return "muon" if cfg.name == "muon" and is_matrix else "adamw"


def _muon(cfg: OptimizerConfig, kernels: dict, learning_rate, numbers: dict):
    """Muon over the hidden matrices (the other leaves masked out): ``optax.contrib``'s
    momentum and Newton-Schulz orthogonalization of each matrix over its input and output axes
    (a scanned stack's layers and a fused q/k/v's three are batch axes), its shape scale, AdamW's
    decoupled weight decay, at ``muon_lr_ratio`` times ``learning_rate``: the Muon branch of
    ``optax.contrib.muon``, whose own AdamW branch would decay norms and biases."""

    def dimension_numbers(params):
        return _leaf_values(kernels, lambda k: MuonDimensionNumbers(k.inputs, k.outputs), params)

    return optax.chain(
        scale_by_muon(
            ns_steps=cfg.muon_ns_steps,
            beta=numbers["muon_beta"],
            nesterov=True,
            weight_dimension_numbers=dimension_numbers,
        ),
        _scale_by_shape(kernels, None if cfg.muon_rms is None else numbers["muon_rms"]),
        optax.add_decayed_weights(numbers["weight_decay"]),
        optax.scale_by_learning_rate(lambda count: numbers["muon_lr_ratio"] * learning_rate(count)),
    )


def _scale_by_shape(kernels: dict, rms) -> optax.GradientTransformation:
    """Each orthogonalized update times ``rms * sqrt(max(fan_in, fan_out))`` (an update of RMS
    ``rms``, Moonlight's), or without ``rms`` Keller Jordan's ``sqrt(max(1, fan_out / fan_in))``:
    ``optax.contrib.muon``'s scale, over our matrices' input and output axes."""

    def update(updates, state, params=None):
        del params

        def scaled(path, update):
            kernel = kernels[_path_key(path)]
            fan_in = math.prod(update.shape[i] for i in kernel.inputs)
            fan_out = math.prod(update.shape[i] for i in kernel.outputs)
            if rms is None:
                return update * math.sqrt(max(1.0, fan_out / fan_in))
            return update * (rms * math.sqrt(max(fan_in, fan_out)))

        return jax.tree_util.tree_map_with_path(scaled, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def _rate_multipliers(cfg: OptimizerConfig, model: ModelConfig, kernels: dict):
    """``[(factor, mask)]``: muP's learning-rate multiplier of each parameter by the optimizer
    that updates it, one masked scaling per factor other than 1 (none under the standard)."""
    m = model.width_multiplier
    if m is None:
        return []
    rms = "muon_rms_lr" if cfg.muon_rms is not None else "muon_lr"

    def factor(kernel: Kernel) -> float:
        field = rms if _optimizer_of(cfg, kernel) == "muon" else "adamw_lr"
        return multiplier(field, kernel.role, m)

    factors = sorted({factor(kernel) for kernel in kernels.values()} - {1.0})
    return [
        (f, functools.partial(_leaf_values, kernels, lambda k, f=f: factor(k) == f))
        for f in factors
    ]


def _leaf_values(kernels: dict, value_of, params):
    """``params`` with each parameter replaced by ``value_of(its Kernel)``: works on the
    optimizer's trees of ``nnx.Variable``s (at init) and of arrays (at each update)."""

    def value(path, _):
        return value_of(kernels[_path_key(path)])

    return jax.tree_util.tree_map_with_path(
        value, params, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


def _path_key(path) -> tuple:
    """A tree path as :func:`~flaxformer_lite.nn.parametrization.parameter_roles` keys it."""
    keys = tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path)
    return keys[:-1] if keys and keys[-1] == "value" else keys


def _path_name(path: tuple) -> str:
    return "/".join(map(str, path))


def schedule_table(schedule: optax.Schedule, steps: int) -> jax.Array:
    """``[steps]`` float32: the learning rate at optimizer steps ``0 .. steps - 1`` (computed op
    by op: a jitted table would compile once per schedule)."""
    return jax.vmap(schedule)(jnp.arange(steps)).astype(jnp.float32)


def table_schedule(table: jax.Array) -> optax.Schedule:
    """The schedule of a :func:`schedule_table`: its last rate after its last step."""
    return lambda count: table[jnp.minimum(count, table.shape[0] - 1)]
