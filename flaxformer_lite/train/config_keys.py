"""The names settings went by: keys renamed since runs saved their configs (read under their new
names wherever they appear), and the names other libraries give our settings (an unknown key
is pointed to ours)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from flaxformer_lite.train.schema import ConfigError

# Keys renamed since runs saved their configs: old dotted key -> new, in the same section. An
# old key is read as its new name wherever it appears (a config file, an override, an older
# run's config.yaml or checkpoint), so an older run resumes without a difference.
RENAMED_KEYS = {
    "data.task": "data.generator",
    "data.task_options": "data.generator_options",
    "model.rope_scaling.kind": "model.rope_scaling.type",
}

# Our key for the names nanoGPT, Hugging Face's TrainingArguments / configs and levanter give a
# setting: an unknown key whose last part is one of them is pointed here, in whatever section it
# was typed, before any match by spelling (which finds `optimizer.end_lr_ratio` for
# `optimizer.learning_rate`).
OTHER_NAMES = {
    **dict.fromkeys(("learning_rate", "lr", "peak_lr", "max_lr"), "optimizer.lr"),
    **dict.fromkeys(("min_lr", "min_lr_ratio"), "optimizer.end_lr_ratio"),
    **dict.fromkeys(("warmup_steps", "warmup_iters", "warmup"), "optimizer.warmup_steps"),
    **dict.fromkeys(("lr_decay_iters", "decay_steps"), "optimizer.schedule_steps"),
    **dict.fromkeys(("lr_scheduler_type", "lr_schedule"), "optimizer.schedule"),
    **dict.fromkeys(("beta1", "adam_beta1"), "optimizer.b1"),
    **dict.fromkeys(("beta2", "adam_beta2"), "optimizer.b2"),
    **dict.fromkeys(("epsilon", "adam_epsilon", "adam_eps"), "optimizer.eps"),
    **dict.fromkeys(("grad_clip", "max_grad_norm", "clip_grad_norm"), "optimizer.clip_norm"),
    "weight_decay": "optimizer.weight_decay",
    **dict.fromkeys(("max_steps", "max_iters", "num_train_steps", "num_steps"), "train.steps"),
    **dict.fromkeys(
        ("batch_size", "train_batch_size", "per_device_train_batch_size"), "train.batch_size"
    ),
    "gradient_accumulation_steps": "train.grad_accum_steps",
    **dict.fromkeys(("eval_interval", "eval_steps", "steps_per_eval"), "train.eval_every"),
    **dict.fromkeys(("log_interval", "logging_steps"), "train.log_every"),
    **dict.fromkeys(("eval_iters", "max_eval_batches"), "train.eval_batches"),
    **dict.fromkeys(("save_steps", "steps_per_export"), "checkpoint.every"),
    **dict.fromkeys(("block_size", "seq_length", "max_seq_length"), "data.seq_len"),
    "dataset": "data.path",
    **dict.fromkeys(("out_dir", "output_dir"), "run_dir"),
    **dict.fromkeys(
        ("n_layer", "n_layers", "num_layers", "num_hidden_layers"), "model.num_decoder_layers"
    ),
    **dict.fromkeys(("n_head", "num_attention_heads"), "model.num_heads"),
    **dict.fromkeys(("n_embd", "hidden_size", "hidden_dim", "d_embed"), "model.d_model"),
    **dict.fromkeys(("intermediate_size", "mlp_dim", "n_inner"), "model.d_ff"),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads"), "model.num_kv_heads"),
    **dict.fromkeys(("n_positions", "max_position_embeddings"), "model.max_length"),
    "dropout": "model.residual_dropout",
}


def renamed_keys(
    values: Mapping[str, Any], where: str, notify: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Nested ``values`` with each old key of :data:`RENAMED_KEYS` under its new name (the
    sections on the way copied, ``values`` left as it is); ``notify`` gets a line for each.

    Raises:
      ConfigError: an old key and its new name both given.
    """
    values = dict(values)
    for old, new in RENAMED_KEYS.items():
        *sections, old_name = old.split(".")
        new_name = new.rpartition(".")[2]
        node = values
        for section in sections:
            if not isinstance(node.get(section), Mapping):
                break
            node[section] = node = dict(node[section])
        else:
            if old_name not in node:
                continue
            if new_name in node:
                raise ConfigError(
                    f"{where}: {old} and {new} are one setting ({old} is its old name): "
                    f"give only {new}"
                )
            node[new_name] = node.pop(old_name)
            if notify is not None:
                notify(f"{where}: {old} is now {new} (read as {new})")
    return values


def renamed_key(key: str, override: str, notify: Callable[[str], None] | None) -> str:
    """The dotted ``key`` of ``override`` with an old name (:data:`RENAMED_KEYS`) replaced."""
    for old, new in RENAMED_KEYS.items():
        if key == old or key.startswith(old + "."):
            if notify is not None:
                notify(f"{override}: {old} is now {new} (read as {new})")
            return new + key[len(old) :]
    return key
