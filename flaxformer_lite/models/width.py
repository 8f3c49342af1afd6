"""How a config's model scales with its width: under muP (``model.parametrization=mup``), the
axes that grow against the base model (the same config at ``d_model = mup_base_width``) and the
multipliers of the embeddings, the attention logits and the output logits that
:data:`~flaxformer_lite.nn.parametrization.MUP` gives; the standard's otherwise.

    growing_axes(cfg)       # frozenset({"embed", "embed_out", "aft_features", "mlp", ...})
    output_multiplier(cfg)  # 1 / m under muP
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from flaxformer_lite.choices import PARAMETRIZATIONS, WIDTH_AXES
from flaxformer_lite.nn.parametrization import (
    attention_scale as _attention_scale,
)
from flaxformer_lite.nn.parametrization import multiplier

if TYPE_CHECKING:
    from flaxformer_lite.models.config import ModelConfig


def growing_axes(cfg: ModelConfig) -> frozenset[str]:
    """The logical axes that grow with the width: under muP, those larger than in the base
    model (the same heads; ``d_ff`` and ``head_dim`` smaller there only when derived from
    ``d_model``); under the standard parametrization, every width-like axis."""
    m = cfg.width_multiplier
    if m is None:
        return WIDTH_AXES
    if m == 1:
        return frozenset()
    grown = {"embed", "embed_out", "aft_features"}
    if cfg.is_derived("d_ff"):
        grown.add("mlp")
    if cfg.is_derived("head_dim"):
        grown.add("head_dim")
    return frozenset(grown)


def attention_scale(cfg: ModelConfig) -> float | None:
    """The attention logits' multiplier; None: the standard ``1 / sqrt(Dh)``."""
    m = cfg.width_multiplier
    if m is None:
        return None
    # A head_dim derived from d_model grows with it; one set explicitly stays.
    base_head_dim = cfg.head_dim / m if cfg.is_derived("head_dim") else cfg.head_dim
    return _attention_scale(cfg.head_dim, base_head_dim)


def sqrt_d_model(cfg: ModelConfig) -> float:
    """The paper's embedding multiplier ``sqrt(d_model)`` (1 when ``scale_embeddings`` is off);
    under muP held at the base width's, ``sqrt(mup_base_width)``, as every input multiplier."""
    if not cfg.scale_embeddings:
        return 1.0
    return math.sqrt(cfg.d_model if cfg.width_multiplier is None else cfg.mup_base_width)


def output_multiplier(cfg: ModelConfig) -> float:
    """The multiplier of an output head's logits: muP's ``1 / m``; 1 under the standard."""
    m = cfg.width_multiplier
    return 1.0 if m is None else multiplier("output", "output", m)


def check_parametrization(cfg: ModelConfig) -> None:
    """Raises ValueError naming the setting: an unknown parametrization, a base width that is
    not a positive int, muP without a base or with one wider than ``d_model``. Under the
    standard a base width is kept unread (a sweep may vary the parametrization)."""
    if cfg.parametrization not in PARAMETRIZATIONS:
        raise ValueError(
            f"parametrization must be one of {PARAMETRIZATIONS}, got {cfg.parametrization!r}"
        )
    base = cfg.mup_base_width
    if base is not None and (isinstance(base, bool) or not isinstance(base, int) or base < 1):
        raise ValueError(f"mup_base_width must be a positive int, got {base!r}")
    if cfg.parametrization == "standard":
        return
    if base is None:
        raise ValueError(
            "model.parametrization=mup needs model.mup_base_width (the d_model at which "
            "muP is the standard parametrization)"
        )
    if base > cfg.d_model:
        raise ValueError(
            f"model.mup_base_width ({base}) is larger than model.d_model ({cfg.d_model}): muP "
            "scales a model up from its base width"
        )
