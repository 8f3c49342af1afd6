"""The optimizer and learning-rate schedules, built from optax.

Schedules: linear warmup then cosine, linear or constant decay (optax), and the paper's
inverse-square-root schedule ``lr = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)``
(Vaswani et al. 2017, eq. 3), which optax does not ship. The optimizer is AdamW with a
weight-decay mask (kernels decay; norms, biases and embedding tables do not, by default) behind
global-norm clipping.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from flaxformer_lite.settings import setting

SCHEDULES = ("cosine", "linear", "constant", "inverse_sqrt")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW, its schedule and clipping. Defaults suit the small CPU models; the paper presets use
    ``schedule="inverse_sqrt", lr=1.0, warmup_steps=4000, b2=0.98, eps=1e-9``. Each field's
    help is beside it. A run resumed with more ``train.steps`` keeps the span its schedule had
    (the rate stays at its end value after it), unless ``schedule_steps`` is set (with
    ``--force``) to stretch it.
    """

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

    def __post_init__(self):
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
NUMBERS = ("b1", "b2", "eps", "weight_decay", "clip_norm")


def make_optimizer(
    cfg: OptimizerConfig, *, total_steps: int, d_model: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``(transformation, schedule)``: clipping, then AdamW with the decay mask."""
    schedule = make_schedule(cfg, total_steps=total_steps, d_model=d_model)
    numbers = {name: getattr(cfg, name) for name in NUMBERS}
    return optimizer_of(cfg, schedule, numbers), schedule


def optimizer_of(
    cfg: OptimizerConfig, learning_rate: optax.Schedule, numbers: dict
) -> optax.GradientTransformation:
    """Clipping (if ``cfg.clip_norm`` is set), then AdamW with ``cfg``'s decay mask, at
    ``learning_rate`` by step and with the :data:`NUMBERS` of ``numbers``: floats, or scalar
    arrays traced in a step. The transformation's state has the same structure either way."""
    adamw = optax.adamw(
        learning_rate,
        b1=numbers["b1"],
        b2=numbers["b2"],
        eps=numbers["eps"],
        weight_decay=numbers["weight_decay"],
        mask=lambda params: weight_decay_mask(params, decay_embeddings=cfg.decay_embeddings),
    )
    if cfg.clip_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(numbers["clip_norm"]), adamw)


def schedule_table(schedule: optax.Schedule, steps: int) -> jax.Array:
    """``[steps]`` float32: the learning rate at optimizer steps ``0 .. steps - 1`` (computed op
    by op: a jitted table would compile once per schedule)."""
    return jax.vmap(schedule)(jnp.arange(steps)).astype(jnp.float32)


def table_schedule(table: jax.Array) -> optax.Schedule:
    """The schedule of a :func:`schedule_table`: its last rate after its last step."""
    return lambda count: table[jnp.minimum(count, table.shape[0] - 1)]
