"""BERT (``BertForMaskedLM`` and ``BertForSequenceClassification``) <-> our ``Encoder``.

BERT is a post-LN encoder: learned positions, token-type (segment A/B) embeddings, a LayerNorm on
the embedding sum (our ``embed_norm``), biases everywhere and, by default, the exact GELU. Its
projections are ``torch.nn.Linear`` weights stored ``[outputs, inputs]``: transposed, then
reshaped (``attention.self.query.weight [H * Dh, D]`` -> our ``[D, H, Dh]``).

The two architectures share that body and differ in their heads, which choose our config:

* ``BertForMaskedLM``: the MLM transform (dense, activation, LayerNorm: our ``mlm_transform``),
  then a decoder tied to the word embeddings with a bias of its own, ``cls.predictions.bias``
  (our ``output_bias``). It has no pooler: checkpoints converted from ``BertForPreTraining``
  (such as ``bert-base-uncased``) also hold the pooler and the next-sentence head, which are
  ignored, as ``BertForMaskedLM`` ignores them. With ``tie_word_embeddings: false`` the decoder
  has its own weight and bias, ``cls.predictions.decoder.{weight,bias}``; the
  ``cls.predictions.bias`` that transformers 5.x then also stores is not used by its forward
  pass, so it is not read (``save_hf`` writes it as a copy of the decoder's bias).
* ``BertForSequenceClassification``: BERT's tanh pooler on the first token, [CLS]
  (``pooler_dense``, ``pooling="first"``), and a linear classifier (``num_classes`` =
  ``num_labels``). It has no masked-LM head, so our config gets none of its parameters:
  ``mlm_transform=False``, ``output_bias=False`` and a head tied to the word embeddings (no
  parameters of its own). With ``num_classes`` our ``model(...)`` gives the class logits
  ``[B, num_labels]``, as HF's class does. Label names (``id2label``) are not kept.

:func:`config_to_hf` writes a config with ``num_classes`` as ``BertForSequenceClassification``
and any other as ``BertForMaskedLM``. A classifier's masked-LM head, when its config has one
(``bert-tiny`` with ``num_classes``), is left out (:func:`unwritten`): the HF class has no place
for it, and it plays no part in the class logits.

HF's call arguments, ``model(input_ids, token_type_ids=None, attention_mask=None)`` with an
int 0/1 ``attention_mask`` (0 at padding), are ours through
:func:`~flaxformer_lite.interop.hf_arguments`: ``model(**hf_arguments(input_ids, ...))``. Not
represented:
``classifier_dropout`` (training only; our classifier's dropout is ``hidden_dropout_prob``) and
``pad_token_id`` (it only freezes the padding row's gradient in HF).
"""

from __future__ import annotations

from typing import Any

from flaxformer_lite.interop.common import (
    ZERO_BIASES,
    Rule,
    layer_rules,
    multi_head_mismatches,
    require,
)
from flaxformer_lite.models.config import ModelConfig

MASKED_LM = "BertForMaskedLM"
SEQUENCE_CLASSIFICATION = "BertForSequenceClassification"
ARCHITECTURES = (MASKED_LM, SEQUENCE_CLASSIFICATION)
MODEL_TYPE = "bert"

# HF `hidden_act` -> our activation ("gelu" is exact, "gelu_new" and friends the tanh form).
ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}
_ACTIVATION_NAMES = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}

_ATTENTION = ("query", "key", "value")


def _norm_rules(hf: str, ours: str) -> list[Rule]:
    return [Rule(hf + "weight", ours + "scale"), Rule(hf + "bias", ours + "bias")]


def _dense_rules(hf: str, ours: str) -> list[Rule]:
    """A ``torch.nn.Linear`` ``hf`` (``...dense.``) <-> our ``Dense`` ``ours`` (``...wi.``)."""
    return [Rule(hf + "weight", ours + "kernel", "out_in", 1), Rule(hf + "bias", ours + "bias")]


def _layer_rules() -> list[Rule]:
    hf, ours = "bert.encoder.layer.{i}.", "encoder.layers.layers.{i}."
    attention, ours_attention = hf + "attention.", ours + "self_attention."
    return [
        *(
            Rule(f"{attention}self.{n}.weight", f"{ours_attention}{n}.kernel", "out_in", 1)
            for n in _ATTENTION
        ),
        *(
            Rule(f"{attention}self.{n}.bias", f"{ours_attention}{n}.bias", "flat")
            for n in _ATTENTION
        ),
        Rule(attention + "output.dense.weight", ours_attention + "out.kernel", "out_in", 2),
        Rule(attention + "output.dense.bias", ours_attention + "out.bias"),
        *_norm_rules(attention + "output.LayerNorm.", ours + "self_attention_norm."),
        *_dense_rules(hf + "intermediate.dense.", ours + "mlp.wi."),
        *_dense_rules(hf + "output.dense.", ours + "mlp.wo."),
        *_norm_rules(hf + "output.LayerNorm.", ours + "mlp_norm."),
    ]


LAYER_RULES = tuple(_layer_rules())
EMBEDDING_RULES = (
    Rule("bert.embeddings.word_embeddings.weight", "embed.tokens.embedding"),
    Rule("bert.embeddings.position_embeddings.weight", "embed.positions.embedding"),
    Rule("bert.embeddings.token_type_embeddings.weight", "embed.token_types.embedding"),
    *_norm_rules("bert.embeddings.LayerNorm.", "embed.norm."),
)
MLM_TRANSFORM_RULES = (
    *_dense_rules("cls.predictions.transform.dense.", "head.transform."),
    *_norm_rules("cls.predictions.transform.LayerNorm.", "head.transform_norm."),
)
TIED_DECODER_RULES = (Rule("cls.predictions.bias", "head.bias"),)
UNTIED_DECODER_RULES = (
    *_dense_rules("cls.predictions.decoder.", "head.projection."),
    Rule("cls.predictions.bias", "head.projection.bias", write_only=True),
)
CLASSIFIER_RULES = (
    *_dense_rules("bert.pooler.dense.", "pooler."),
    *_dense_rules("classifier.", "classifier."),
)


def architecture_of(hf: dict[str, Any]) -> str:
    """Which of :data:`ARCHITECTURES` a ``config.json`` dict is; a config that names none (only
    ``model_type: bert``) is read as a masked LM."""
    return next((a for a in hf.get("architectures") or [] if a in ARCHITECTURES), MASKED_LM)


def rules(cfg: ModelConfig) -> list[Rule]:
    """Every HF tensor of ``cfg``'s model and where it goes: the masked LM's without
    ``num_classes``, the sequence classifier's with."""
    if cfg.num_classes is not None:
        heads = CLASSIFIER_RULES
    else:
        heads = (
            *MLM_TRANSFORM_RULES,
            *(TIED_DECODER_RULES if cfg.tie_embeddings else UNTIED_DECODER_RULES),
        )
    return [*EMBEDDING_RULES, *layer_rules(LAYER_RULES, cfg.num_encoder_layers), *heads]


def hf_name(name: str) -> str:
    """Checkpoints converted from TensorFlow call the LayerNorm parameters ``gamma`` and
    ``beta``; they are read as ``weight`` and ``bias`` (as ``transformers`` renames them)."""
    stem, _, last = name.rpartition(".")
    if stem.endswith("LayerNorm") and last in ("gamma", "beta"):
        return f"{stem}.{'weight' if last == 'gamma' else 'bias'}"
    return name


def ignored(cfg: ModelConfig) -> tuple[str, ...]:
    """Buffers older checkpoints store; for a masked LM also the pooler and next-sentence head
    of ``BertForPreTraining`` conversions, and the copies of a tied decoder."""
    names = [r"bert\.embeddings\.(position_ids|token_type_ids)"]
    if cfg.num_classes is None:
        names += [r"bert\.pooler\.dense\.(weight|bias)", r"cls\.seq_relationship\.(weight|bias)"]
        if cfg.tie_embeddings:
            names.append(r"cls\.predictions\.decoder\.(weight|bias)")
    return tuple(names)


def unwritten(cfg: ModelConfig) -> tuple[str, ...]:
    """Our parameters that :func:`save_hf` leaves out: a classifier's masked-LM head (a
    ``BertForSequenceClassification`` has none)."""
    return (r"head\..*",) if cfg.num_classes is not None else ()


def _num_labels(hf: dict[str, Any]) -> Any:
    """``len(id2label)`` (what ``transformers`` writes), else ``num_labels``, else its 2."""
    labels = hf.get("id2label")
    return len(labels) if labels else hf.get("num_labels", 2)


def config_from_hf(hf: dict[str, Any], *, dtype: str = "float32") -> ModelConfig:
    """Our config for a HF ``BertConfig`` dict (``config.json``) of a ``BertForMaskedLM`` or
    a ``BertForSequenceClassification`` (its ``architectures`` say which; module doc).

    Raises:
      ValueError: naming every setting we cannot represent.
    """
    classifier = architecture_of(hf) == SEQUENCE_CLASSIFICATION
    activation = hf.get("hidden_act", "gelu")
    problems = []
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        problems.append(f"hidden_act={activation!r} (supported: {sorted(ACTIVATIONS)})")
    position = hf.get("position_embedding_type", "absolute")
    if position != "absolute":
        problems.append(f"position_embedding_type={position!r} (only 'absolute' is supported)")
    for key in ("is_decoder", "add_cross_attention"):
        if hf.get(key, False):
            problems.append(f"{key}=true (only BERT's bidirectional encoder is supported)")
    type_vocab_size = hf.get("type_vocab_size", 2)
    if not isinstance(type_vocab_size, int) or type_vocab_size < 1:
        problems.append(f"type_vocab_size={type_vocab_size!r} (BERT has token-type embeddings)")
    if hf["hidden_size"] % hf["num_attention_heads"]:
        problems.append(
            f"hidden_size={hf['hidden_size']} not divisible by num_attention_heads="
            f"{hf['num_attention_heads']}"
        )
    num_labels = _num_labels(hf) if classifier else None
    if classifier and (not isinstance(num_labels, int) or num_labels < 1):
        problems.append(f"num_labels={num_labels!r} (a classifier needs at least 1 label)")
    require(problems, "unsupported BERT config")
    dropout = float(hf.get("hidden_dropout_prob", 0.1))
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        num_heads=hf["num_attention_heads"],
        d_ff=hf["intermediate_size"],
        num_encoder_layers=hf["num_hidden_layers"],
        num_decoder_layers=0,
        max_length=hf.get("max_position_embeddings", 512),
        embedding_dropout=dropout,
        attention_dropout=float(hf.get("attention_probs_dropout_prob", 0.1)),
        residual_dropout=dropout,
        norm="layernorm",
        norm_eps=hf.get("layer_norm_eps", 1e-12),
        norm_position="post",
        embed_norm=True,
        positions="learned",
        activation=ACTIVATIONS[activation],
        # A classifier has no output projection: its (unused) head is the tied table.
        tie_embeddings=classifier or hf.get("tie_word_embeddings", True),
        scale_embeddings=False,
        fused_qkv=False,
        qkv_bias=True,
        attention_out_bias=True,
        mlp_bias=True,
        output_bias=not classifier,
        type_vocab_size=type_vocab_size,
        mlm_transform=not classifier,
        num_classes=num_labels,
        pooling="first",
        pooler_dense=True,
        init="normal",
        init_std=hf.get("initializer_range", 0.02),
        dtype=dtype,
        param_dtype=dtype,
    )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` of a BERT with ``cfg``'s architecture: a
    ``BertForSequenceClassification`` with ``num_classes`` (labels ``LABEL_0``, ...), else a
    ``BertForMaskedLM``.

    Raises:
      ValueError: naming every setting of ``cfg`` that BERT does not have.
    """
    require(mismatches(cfg), "this model is not a BERT")
    classifier = cfg.num_classes is not None
    hf = {
        "architectures": [SEQUENCE_CLASSIFICATION if classifier else MASKED_LM],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.num_encoder_layers,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.d_ff,
        "hidden_act": _ACTIVATION_NAMES[cfg.activation],
        "hidden_dropout_prob": cfg.residual_dropout,
        "attention_probs_dropout_prob": cfg.attention_dropout,
        "classifier_dropout": None,  # = hidden_dropout_prob, as ours
        "max_position_embeddings": cfg.max_length,
        "type_vocab_size": cfg.type_vocab_size,
        "layer_norm_eps": cfg.norm_eps,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": classifier or cfg.tie_embeddings,
        "is_decoder": False,
        "add_cross_attention": False,
        "pad_token_id": None,  # our model has no special padding row
        "dtype": cfg.param_dtype,
        "torch_dtype": cfg.param_dtype,  # the key transformers 4.x reads
    }
    if classifier:
        labels = [f"LABEL_{i}" for i in range(cfg.num_classes)]
        hf["id2label"] = {str(i): label for i, label in enumerate(labels)}
        hf["label2id"] = {label: i for i, label in enumerate(labels)}
    return hf


def mismatches(cfg: ModelConfig) -> list[str]:
    """The settings of ``cfg`` that a BERT cannot have (empty: it is a BERT, a masked LM
    without ``num_classes`` and a sequence classifier with)."""
    want = dict(
        kind="encoder",
        norm="layernorm",
        norm_bias=True,
        norm_position="post",
        positions="learned",
        embed_norm=True,
        scale_embeddings=False,
        parallel_block=False,
        fused_qkv=False,
        qkv_bias=True,
        attention_out_bias=True,
        mlp_bias=True,
        input_dim=None,
        output_dim=None,
    )
    if cfg.num_classes is None:  # BertForMaskedLM's head
        want.update(mlm_transform=True, output_bias=True)
    else:  # BertForSequenceClassification's
        want.update(pooler_dense=True, pooling="first")
    problems = multi_head_mismatches(cfg, "BERT", want, _ACTIVATION_NAMES, ZERO_BIASES)
    if cfg.type_vocab_size < 1:
        problems.append("type_vocab_size=0 (BERT has token-type embeddings)")
    if cfg.embedding_dropout != cfg.residual_dropout:
        problems.append(
            f"embedding_dropout={cfg.embedding_dropout} != residual_dropout="
            f"{cfg.residual_dropout} (BERT has one hidden_dropout_prob)"
        )
    return problems
