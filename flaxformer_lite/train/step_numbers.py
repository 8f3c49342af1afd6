"""The numbers a run's train step takes as arguments rather than as constants of its program:
the learning rate by step (a table of its schedule's rates), the optimizer's other numbers, the
loss's and the dropout rates of the embedding and the residual branches (where a run drops at
all: dropout on or off is the model's graph). Every run passes its own, so the members of a
sweep that differ only in these run one compiled program, and each member runs the very program
its own run does.

    numbers = step_numbers(cfg, schedule)   # {"lr": [train.steps], "b1": [], ...} float32
"""

from __future__ import annotations

import numpy as np

from flaxformer_lite.train.config import TrainConfig, flatten
from flaxformer_lite.train.optim import NUMBERS, schedule_table

# The loss settings the step takes as numbers.
LOSS_NUMBERS = ("label_smoothing", "z_loss")
# The model's dropout rates the step takes as numbers, by the kind of layer they apply to
# (:func:`flaxformer_lite.nn.rngs.dropout_rates`). Attention dropout is not among them: the
# attention implementations take its rate as a constant.
DROPOUT_NUMBERS = {"embedding_dropout": "embedding", "residual_dropout": "residual"}
# The optimizer's settings that make up its learning-rate schedule, which the step reads from
# a table of rates (:func:`~.optim.schedule_table`).
SCHEDULE_SETTINGS = ("lr", "schedule", "warmup_steps", "end_lr_ratio", "schedule_steps")
# The settings that are a member's own in its group's program: its numbers, its seed (the
# initializer's and the data's, neither of them part of the step) and its directory.
PER_MEMBER = frozenset(
    {"seed", "run_dir"}
    | {f"train.{name}" for name in LOSS_NUMBERS}
    | {f"optimizer.{name}" for name in (*NUMBERS, *SCHEDULE_SETTINGS)}
    | {f"model.{name}" for name in DROPOUT_NUMBERS}
)


def step_numbers(cfg: TrainConfig, schedule) -> dict[str, np.ndarray]:
    """``cfg``'s numbers as its step takes them: ``lr`` ``[train.steps]`` (``schedule``'s rate
    at each optimizer step), the optimizer's :data:`~.optim.NUMBERS`, :data:`LOSS_NUMBERS` and
    :data:`DROPOUT_NUMBERS`, float32 scalars. An unset ``clip_norm`` or ``muon_rms`` is 0: a
    step without clipping (or Muon's RMS scale) never reads it."""
    numbers = {"lr": np.asarray(schedule_table(schedule, max(cfg.train.steps, 1)))}
    for name in NUMBERS:
        value = getattr(cfg.optimizer, name)
        numbers[name] = np.float32(0.0 if value is None else value)
    for name in LOSS_NUMBERS:
        numbers[name] = np.float32(getattr(cfg.train, name))
    for name in DROPOUT_NUMBERS:
        numbers[name] = np.float32(getattr(cfg.model, name))
    return numbers


def numbers_aside(cfg: TrainConfig) -> str:
    """``cfg`` without the settings that are a member's own (:data:`PER_MEMBER`): members that
    differ only in those train as one program. Whether ``clip_norm`` is set stays (clipping is
    a transformation of its own in the optimizer), whether Muon's ``muon_rms`` scale is, whether
    each dropout drops (a layer at
    rate 0 draws no key) and whether labels are smoothed (a term of the loss)."""
    flat = flatten(cfg.to_dict())
    kept = {key: value for key, value in flat.items() if key not in PER_MEMBER}
    kept["optimizer.clip_norm"] = flat["optimizer.clip_norm"] is not None
    kept["optimizer.muon_rms"] = flat["optimizer.muon_rms"] is not None
    for key in (*(f"model.{name}" for name in DROPOUT_NUMBERS), "train.label_smoothing"):
        kept[key] = flat[key] > 0
    return repr(sorted(kept.items()))
