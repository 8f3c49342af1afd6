"""One line of help for every key of :class:`~flaxformer_lite.train.config.TrainConfig`, and the
resolved config as YAML with each key's type, default and help as a comment
(``train.py --show-config``, ``flaxformer-lite config``).

The help lives here, in one place, next to the schema; ``tests/test_show_config.py`` checks that
every key of the schema has a line and that no line names a key the schema lacks.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import yaml

from flaxformer_lite.train.config import TrainConfig

SECTIONS = {
    "model": "the architecture (model.preset=NAME starts from a preset, e.g. gpt2-tiny)",
    "data": "where the data come from and how they become batches",
    "optimizer": "AdamW, its learning-rate schedule and clipping",
    "train": "the training loop",
    "checkpoint": "Orbax checkpoints in <run_dir>/checkpoints",
    "mesh": "the device mesh (devices = data x fsdp x tensor) and how arrays are sharded on it",
    "distributed": "how this process joins a multi-process run (jax.distributed)",
}

HELP = {
    "run_dir": "the run's directory: config, metrics, checkpoints; the same one resumes",
    "seed": "the seed of initialization, data order and dropout",
    "init_from": "a Hugging Face checkpoint directory to fine-tune (GPT-2, Llama, Marian)",
    "model.vocab_size": "token ids (set to the tokenizer's size when it differs)",
    "model.d_model": "the model width D",
    "model.num_heads": "query heads H",
    "model.num_kv_heads": "key/value heads Hk (fewer is GQA, 1 is MQA); null: num_heads",
    "model.head_dim": "Dh; null: d_model // num_heads",
    "model.d_ff": "the MLP's hidden width F",
    "model.num_encoder_layers": "encoder layers (0 with decoder layers: a decoder-only LM)",
    "model.num_decoder_layers": "decoder layers (0 with encoder layers: an encoder, e.g. BERT)",
    "model.max_length": "the longest sequence (learned positions have this many rows)",
    "model.embedding_dropout": "dropout on the embedding sum",
    "model.attention_dropout": "dropout on the attention weights",
    "model.residual_dropout": "dropout on each sublayer's output",
    "model.norm": "layernorm or rmsnorm",
    "model.norm_eps": "the norms' epsilon",
    "model.norm_bias": "LayerNorm's additive bias (false: none, as nanoGPT's bias=False)",
    "model.norm_position": "pre (GPT-2, Llama) or post (the paper, BERT) the sublayer",
    "model.embed_norm": "normalize the embedding sum (BERT)",
    "model.positions": "sinusoidal, learned, rope, relative (T5 buckets), alibi or none",
    "model.sinusoidal_layout": "sin/cos interleaved (the paper) or concat (Marian)",
    "model.rope_base": "RoPE's base wavelength theta",
    "model.rope_layout": "RoPE's pairing of features: half (GPT-NeoX, Llama) or interleaved",
    "model.rope_scaling": "null, or {kind: linear|ntk|llama3|dynamic, factor: ...} to stretch RoPE",
    "model.relative_buckets": "relative positions: the number of distance buckets",
    "model.relative_max_distance": "relative positions: distances from here share a bucket",
    "model.activation": "the MLP's activation (relu, gelu, gelu_tanh, swiglu, ...)",
    "model.tie_embeddings": "the output projection is the token embedding transposed",
    "model.share_src_tgt_embeddings": "encoder-decoder: one embedding table for both sides",
    "model.scale_embeddings": "multiply token embeddings by sqrt(d_model) (the paper)",
    "model.parallel_block": "attention and MLP side by side from one norm (GPT-J)",
    "model.fused_qkv": "one projection for queries, keys and values",
    "model.qkv_bias": "biases on the query, key and value projections",
    "model.attention_out_bias": "a bias on the attention output projection",
    "model.mlp_bias": "biases in the MLP",
    "model.output_bias": "a bias on the vocabulary logits (BERT, Marian)",
    "model.type_vocab_size": "token-type (segment A/B) embeddings, BERT; 0: none",
    "model.mlm_transform": "BERT's dense + activation + norm before the MLM decoder",
    "model.num_classes": "encoder: a sequence-classification head with this many classes",
    "model.pooling": "classification: the first token ([CLS]) or the mean of real tokens",
    "model.pooler_dense": "BERT's dense + tanh on the pooled vector",
    "model.input_dim": "continuous inputs [B, T, input_dim] instead of token ids",
    "model.output_dim": "a regression head [B, T, output_dim] instead of logits",
    "model.init": "xavier (Glorot uniform) or normal with init_std (GPT-2, BERT)",
    "model.init_std": "the standard deviation of init=normal",
    "model.scale_residual_init": "GPT-2: residual projections' init times 1/sqrt(2 layers)",
    "model.dtype": "the compute dtype: float32, bfloat16 or float16",
    "model.param_dtype": "the parameters' storage dtype",
    "model.scan_layers": "run the layers in a lax.scan (one layer compiled)",
    "model.remat": "recompute activations in the backward pass: none, full, ... (saves memory)",
    "model.attention_implementation": "null (chosen per input), xla, chunked, cudnn or pallas",
    "model.local_window": "null, or [left, right]: self-attention sees only that many neighbours",
    "model.global_tokens": "with local_window: the first N positions see and are seen by all",
    "model.mixer": "self-attention's mixer: attention, aft_full, aft_local or aft_simple (AFT)",
    "model.aft_window": "aft_local: its pairwise bias counts within this many positions",
    "data.source": "synthetic (a built-in generator), text, jsonl, parallel or prepared (a store)",
    "data.generator": "the synthetic data: arithmetic, reverse, number_words or sentiment "
    "(old name: data.task)",
    "data.generator_options": "the generator's options, e.g. {max_digits: 4}; {}: its defaults",
    "data.path": "the files of a text, jsonl or parallel source (or builtin:tinyshakespeare), "
    "or a prepared store",
    "data.field": "the JSONL field that holds the text",
    "data.text_documents": "a text file's documents: file (whole), paragraphs or lines; "
    "null: file, or a prepared store's own",
    "data.validation_path": "validation data of data.path's kind, used whole; "
    "null: hold out data.validation_fraction",
    "data.tokenizer": "byte; char, word or bpe fitted on the data; or sentencepiece",
    "data.tokenizer_path": "a SentencePiece .model file",
    "data.vocab_size": "the BPE vocabulary size (required for bpe), or a cap on word's",
    "data.seq_len": "tokens per row of every [B, seq_len] batch",
    "data.packing": "pack several documents into each row (LM); null: pack LM, pad others",
    "data.lm_rows": "LM rows of documents in pieces of seq_len, or windows cut end to end",
    "data.validation_fraction": "share held out for validation: of the documents, or each "
    "whole file's tail",
    "data.mlm_probability": "share of an MLM example's tokens to predict",
    "data.train_size": "at most this many training examples; null: all",
    "data.eval_size": "at most this many validation examples; null: all",
    "optimizer.lr": "the peak learning rate (inverse_sqrt: the formula's multiplier)",
    "optimizer.schedule": "cosine, linear, constant (after warmup) or inverse_sqrt",
    "optimizer.warmup_steps": "linear warmup steps (a longer one than the run is shortened)",
    "optimizer.end_lr_ratio": "the last learning rate of cosine / linear, as a share of lr",
    "optimizer.b1": "Adam's first-moment decay",
    "optimizer.b2": "Adam's second-moment decay",
    "optimizer.eps": "Adam's epsilon",
    "optimizer.weight_decay": "decoupled weight decay (AdamW) of the kernels; 0 is Adam",
    "optimizer.decay_embeddings": "also decay the embedding tables",
    "optimizer.clip_norm": "clip the global gradient norm to this; null: no clipping",
    "optimizer.schedule_steps": "steps the decay spans; null: train.steps (kept on resume)",
    "train.steps": "optimizer steps of the whole run (may be raised on resume)",
    "train.batch_size": "examples (rows) per optimizer step, over all devices",
    "train.grad_accum_steps": "microbatches per step (batch_size must be a multiple)",
    "train.log_every": "log training metrics every this many steps",
    "train.eval_every": "evaluate every this many steps (and at the end)",
    "train.eval_batches": "validation batches per evaluation; null: all (every token)",
    "train.decode_examples": "validation examples greedy-decoded and scored per evaluation",
    "train.log_samples": "decoded examples printed per evaluation",
    "train.label_smoothing": "label smoothing of the loss, in [0, 1)",
    "train.z_loss": "weight of the log(Z)^2 penalty on the logits (PaLM); 0: off",
    "train.skip_nonfinite": "skip a step with a non-finite loss or gradient instead of stopping",
    "checkpoint.every": "save every this many steps (and at the end)",
    "checkpoint.keep": "keep the last this many checkpoints (and the best by eval loss)",
    "mesh.data": "the data-parallel axis size; -1: the remaining devices",
    "mesh.fsdp": "the fully-sharded-data-parallel axis size; -1: the remaining devices",
    "mesh.tensor": "the tensor-parallel axis size; -1: the remaining devices",
    "mesh.rules": "logical axis -> the mesh axes that shard it ([] replicates)",
    "distributed.enabled": "null: connect when an address or count is given; true/false",
    "distributed.coordinator_address": "host:port of process 0's coordination service",
    "distributed.num_processes": "how many processes take part",
    "distributed.process_id": "this process's index in [0, num_processes)",
    "distributed.initialization_timeout": "seconds to wait for every process to connect",
    "distributed.heartbeat_timeout": "seconds without a heartbeat before a process counts dead",
}


def leaf_keys(cls=TrainConfig, prefix: str = "") -> dict[str, Any]:
    """``{dotted key: type annotation}`` of every leaf of the schema, in field order."""
    leaves = {}
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        annotation = hints[field.name]
        if not prefix and dataclasses.is_dataclass(annotation):
            leaves |= leaf_keys(annotation, f"{prefix}{field.name}.")
        else:
            leaves[prefix + field.name] = annotation
    return leaves


def annotated_yaml(cfg: TrainConfig) -> str:
    """``cfg`` as YAML, every key preceded by a comment with its type, default and help;
    ``yaml.safe_load`` of it gives ``cfg.to_dict()``."""
    values, defaults = _flatten(cfg.to_dict()), _flatten(TrainConfig().to_dict())
    lines = [
        "# The resolved configuration: every key with its type, default and meaning.",
        "# Save it as a file for --config, or set any key with key=value.",
    ]
    section = None
    for key, annotation in leaf_keys().items():
        head, _, name = key.rpartition(".")
        if head != section:
            section = head
            lines += ["", f"{head}:  # {SECTIONS[head]}"] if head else [""]
        indent = "  " if head else ""
        default = _flow(defaults[key])
        if isinstance(defaults[key], dict) and defaults[key] and defaults[key] == values[key]:
            default = "the entries below"
        lines.append(f"{indent}# {type_name(annotation)}, default {default}: {HELP[key]}")
        lines += _entry(indent, name, values[key])
    return "\n".join(lines) + "\n"


def type_name(annotation) -> str:
    """``int``, ``str | None``, ``tuple[str, ...]``, ``dict[str, int | bool]``, ..."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else type_name(a) for a in args)
    if origin is tuple:
        return f"tuple[{type_name(args[0])}, ...]"
    if origin is dict:
        return f"dict[{type_name(args[0])}, {type_name(args[1])}]"
    return getattr(annotation, "__name__", str(annotation))


def _entry(indent: str, name: str, value) -> list[str]:
    """``name: value`` in YAML, a non-empty mapping as one line per entry below its name."""
    if isinstance(value, dict) and value:
        return [f"{indent}{name}:"] + [f"{indent}  {k}: {_flow(v)}" for k, v in value.items()]
    return [f"{indent}{name}: {_flow(value)}"]


def _flow(value) -> str:
    """One value as single-line YAML (``null``, ``[a, b]``, ``{}``, a quoted string if needed)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1_000_000)
    return text.removesuffix("\n...\n").removesuffix("\n")


def _flatten(values: dict, prefix: str = "") -> dict[str, Any]:
    """Sections flattened to dotted keys; other mappings (``mesh.rules``) stay values."""
    flat = {}
    for key, value in values.items():
        if key in SECTIONS and not prefix:
            flat |= _flatten(value, f"{key}.")
        else:
            flat[prefix + key] = value
    return flat
