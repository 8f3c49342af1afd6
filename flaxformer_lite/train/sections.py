"""The sections of the training config that no other package owns: the loop (``train``), the
checkpoints (``checkpoint``), the device mesh (``mesh``), low-rank adapters (``lora``) and the
optimizer (``optimizer``, which :mod:`.optim` builds); :mod:`.config` puts them together with
the model's, the data's and the evaluations' into :class:`~.config.TrainConfig`."""

from __future__ import annotations

import dataclasses

from flaxformer_lite.parallel.config import DEFAULT_RULES, MESH_AXES, check_rules
from flaxformer_lite.settings import setting
from flaxformer_lite.train.schema import ConfigError


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """The training loop. ``steps`` counts optimizer steps; ``batch_size`` is global (split into
    ``grad_accum_steps`` microbatches). A step with a non-finite loss or gradient stops the run,
    or is skipped with ``skip_nonfinite``. Each evaluation covers every validation token, or the
    first ``eval_batches`` batches (the log says what share). It also greedy-decodes the first
    ``decode_examples`` validation examples of LM prompt=answer tasks and seq2seq data, scores
    them (exact match, token accuracy, BLEU for translation) and logs ``log_samples`` of them;
    0 turns decoding off. On plain text, it logs ``log_samples`` continuations of validation
    prompts instead."""

    steps: int = setting(3000, help="optimizer steps of the whole run (may be raised on resume)")
    batch_size: int = setting(32, help="examples (rows) per optimizer step, over all devices")
    grad_accum_steps: int = setting(1, help="microbatches per step (batch_size must be a multiple)")
    log_every: int = setting(50, help="log training metrics every this many steps")
    eval_every: int = setting(500, help="evaluate every this many steps (and at the end)")
    eval_batches: int | None = setting(
        None, help="validation batches per evaluation; null: all (every token)"
    )
    decode_examples: int = setting(
        256, help="validation examples greedy-decoded and scored per evaluation"
    )
    log_samples: int = setting(3, help="decoded examples printed per evaluation")
    label_smoothing: float = setting(0.0, help="label smoothing of the loss, in [0, 1)")
    z_loss: float = setting(0.0, help="weight of the log(Z)^2 penalty on the logits (PaLM); 0: off")
    loss_chunk: int | None = setting(
        None,
        help="positions per block of the training loss: the logits of batch x loss_chunk tokens "
        "at a time, recomputed in the backward pass (same loss, less memory); null: all at once",
    )
    skip_nonfinite: bool = setting(
        False, help="skip a step with a non-finite loss or gradient instead of stopping"
    )
    compilation_cache: bool = setting(
        True,
        help="the commands keep compiled programs in ~/.cache/flaxformer_lite/jax "
        "($XDG_CACHE_HOME): a second run of a config compiles nothing it compiled before; false: "
        "compile every run (a script chooses with flaxformer_lite.process.use_compilation_cache)",
    )

    def __post_init__(self):
        if self.batch_size % max(self.grad_accum_steps, 1):
            raise ConfigError(
                f"train.batch_size ({self.batch_size}) must be a multiple of "
                f"train.grad_accum_steps ({self.grad_accum_steps})"
            )
        names = (
            "steps",
            "batch_size",
            "grad_accum_steps",
            "log_every",
            "eval_every",
        )
        for name in names:
            _check_positive(f"train.{name}", getattr(self, name))
        for name in ("eval_batches", "loss_chunk"):
            if getattr(self, name) is not None:
                _check_positive(f"train.{name}", getattr(self, name))
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(
                f"train.label_smoothing must be in [0, 1), got {self.label_smoothing}"
            )
        if self.z_loss < 0:
            raise ConfigError(f"train.z_loss must be >= 0, got {self.z_loss}")
        for name in ("decode_examples", "log_samples"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints every ``every`` steps (and at the end), keeping the last ``keep``."""

    every: int = setting(500, help="save every this many steps (and at the end)")
    keep: int = setting(3, help="keep the last this many checkpoints (and the best by eval loss)")

    def __post_init__(self):
        _check_positive("checkpoint.every", self.every)
        _check_positive("checkpoint.keep", self.keep)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The device mesh and how arrays are laid out on it (:mod:`flaxformer_lite.parallel`).

    ``data``, ``fsdp``, ``context``, ``tensor``: axis sizes; 1 leaves an axis unused, -1 takes
    the remaining devices. ``rules``: logical axis name -> the mesh axes that shard it (an empty
    list replicates); earlier rules take precedence when two names of one array want the same mesh
    axis. Rules given in a file or as ``mesh.rules.<name>=a,b`` (or ``=none``) replace the entries
    of :data:`~flaxformer_lite.parallel.DEFAULT_RULES` in place; new names come last.
    """

    data: int = setting(-1, help="the data-parallel axis size; -1: the remaining devices")
    fsdp: int = setting(
        1, help="the fully-sharded-data-parallel axis size; -1: the remaining devices"
    )
    tensor: int = setting(1, help="the tensor-parallel axis size; -1: the remaining devices")
    context: int = setting(
        1,
        help="the context-parallel axis size: each sequence split over this many devices "
        "(decoder models; data.seq_len divisible by 2 x context)",
    )
    rules: dict[str, tuple[str, ...]] = setting(
        factory=lambda: dict(DEFAULT_RULES),
        help="logical axis -> the mesh axes that shard it ([] replicates)",
    )

    def __post_init__(self):
        sizes = (self.data, self.fsdp, self.tensor, self.context)
        for name, size in zip(("data", "fsdp", "tensor", "context"), sizes, strict=True):
            if size == 0 or size < -1:
                raise ConfigError(f"mesh.{name} must be a positive int or -1, got {size}")
        if sizes.count(-1) > 1:
            raise ConfigError(f"at most one mesh axis may be -1, got {sizes}")
        try:
            check_rules(self.rules, MESH_AXES)
        except ValueError as error:
            raise ConfigError(str(error)) from None


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (:mod:`flaxformer_lite.nn.lora`, PEFT's LoRA) on the projections that
    ``targets`` name: with a ``rank``, only the adapters train; the base (``init_from``'s
    weights, or the seed's) stays as it is, and the checkpoints hold the adapters alone."""

    rank: int | None = setting(
        None, help="the adapters' rank r (PEFT's r); null: no adapters, every weight trains"
    )
    alpha: float = setting(8.0, help="PEFT's lora_alpha: the adapters' output times alpha / r")
    dropout: float = setting(0.0, help="PEFT's lora_dropout, on each adapter's input")
    targets: tuple[str, ...] = setting(
        ("attention", "mlp"),
        help="the projections adapted: attention, mlp, a projection's name (query, key, value, "
        "qkv, out, wi, wi_gate, wo) or parts of its path (cross_attention.query)",
    )
    rslora: bool = setting(False, help="rank-stabilized LoRA: alpha / sqrt(r) (use_rslora)")
    adapter: str | None = setting(
        None,
        help="a PEFT adapter directory (of init_from's model) whose weights a fresh run's "
        "adapters start from; null: fresh adapters (B = 0)",
    )

    def __post_init__(self):
        if self.rank is not None:
            _check_positive("lora.rank", self.rank)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise ConfigError("lora.targets is empty: name the projections to adapt")
        if self.adapter is not None and self.rank is None:
            raise ConfigError("lora.adapter needs lora.rank (the adapter's r)")


def _check_positive(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key} must be a positive int, got {value!r}")


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
