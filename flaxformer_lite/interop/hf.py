"""``load_hf`` / ``save_hf``: Hugging Face checkpoint directories <-> our models, dispatched by the
``architectures`` entry of ``config.json`` to one module per family: GPT-2 and Llama
(``DecoderLM``), BERT (``Encoder``: masked LM or sequence classifier) and Marian
(``EncoderDecoder``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxformer_lite.interop import bert, common, gpt2, llama, marian
from flaxformer_lite.models.build import build_model
from flaxformer_lite.models.config import DTYPES, ModelConfig
from flaxformer_lite.models.decoder_lm import DecoderLM
from flaxformer_lite.models.encoder import Encoder
from flaxformer_lite.models.encoder_decoder import EncoderDecoder
from flaxformer_lite.models.pieces import user_pieces
from flaxformer_lite.nn.lora import BASE, has_adapters, merge_adapters

Model = DecoderLM | Encoder | EncoderDecoder

# One module per family. Each has MODEL_TYPE, config_from_hf, config_to_hf, mismatches, rules,
# ignored and hf_name, and names the HF architecture it converts in ARCHITECTURE, or the several
# it converts in ARCHITECTURES (BERT's masked LM and sequence classifier: config_from_hf and
# config_to_hf then tell them apart). A module may also have unwritten(cfg): regular expressions
# of our parameters that save_hf leaves out, having no place in the HF architecture.
_MODULES = (gpt2, llama, bert, marian)


def _architectures(family: ModuleType) -> tuple[str, ...]:
    return getattr(family, "ARCHITECTURES", None) or (family.ARCHITECTURE,)


# HF architecture name -> the module that converts it.
FAMILIES: dict[str, ModuleType] = {
    name: family for family in _MODULES for name in _architectures(family)
}
SUPPORTED = tuple(FAMILIES)

# Where our layer parameters live: "decoder.layers.layers.{i}...." in a loop stack, the same
# path without the index (and a leading layer axis) in a scanned one.
_LAYERS = "decoder.layers.layers"
_STACKS = ("encoder.layers.layers", _LAYERS)


def family_of(hf_config: dict) -> ModuleType:
    """The family module of a ``config.json`` dict.

    Raises:
      ValueError: an architecture (or model type) we do not convert, listing those we do.
    """
    architectures = hf_config.get("architectures") or []
    for name in architectures:
        if name in FAMILIES:
            return FAMILIES[name]
    if not architectures:  # older configs name only the model type
        for family in FAMILIES.values():
            if hf_config.get("model_type") == family.MODEL_TYPE:
                return family
    what = architectures or hf_config.get("model_type")
    raise ValueError(
        f"unsupported Hugging Face architecture {what!r}; supported: {', '.join(SUPPORTED)}"
    )


def load_hf(path: str | os.PathLike, *, dtype=None) -> tuple[Model, ModelConfig]:
    """A Hugging Face checkpoint directory as our model, in eval mode, and its config.

    Reads ``config.json`` and ``model.safetensors`` (or the shards of
    ``model.safetensors.index.json``) from the local directory ``path``; nothing is downloaded.

    Args:
      path: a directory written by ``save_pretrained`` (or :func:`save_hf`).
      dtype: parameter and compute dtype (``"float32"``, ``"bfloat16"``, ``"float16"`` or a
        numpy/jax dtype); None is float32, whatever dtype the checkpoint is stored in.

    Returns:
      ``(model, config)``: the model and its ``ModelConfig``. Inputs are numpy or jax ints:
      a ``DecoderLM`` (GPT-2, Llama): ``model(input_ids [B, T]) -> logits [B, T, V]``;
      an ``Encoder`` (BERT): ``model(input_ids [B, T], token_types=None, padding_mask=None)``
      (the mask bool, False at padding) -> masked-LM logits ``[B, T, V]``, or class logits
      ``[B, num_labels]`` for ``BertForSequenceClassification``; an ``EncoderDecoder``
      (Marian): ``model(src [B, S], tgt [B, T], padding_mask=bool [B, S]) -> logits
      [B, T, V]``. :func:`~flaxformer_lite.interop.hf_arguments` turns HF's call arguments
      (``attention_mask``, ``token_type_ids``) into these.

    Raises:
      FileNotFoundError: the directory, ``config.json`` or the weights are missing.
      ValueError: an unsupported architecture or setting, or tensors that do not fit the config.
    """
    dtype = _dtype_name(dtype)
    hf_config = common.read_config(path)
    family = family_of(hf_config)
    try:
        cfg = family.config_from_hf(hf_config, dtype=dtype)
    except KeyError as e:
        raise ValueError(f"{path}/config.json lacks the {family.MODEL_TYPE} key {e}") from None
    tensors = {family.hf_name(name): x for name, x in common.read_tensors(path).items()}
    graphdef, abstract_params, others = _abstract_split(cfg)
    shapes = {_dotted(p): tuple(v.shape) for p, v in nnx.to_flat_state(abstract_params)}
    params = common.tensors_to_params(
        family.rules(cfg), tensors, shapes, ignore=family.ignored(cfg), dtype=jnp.dtype(dtype)
    )
    filled = nnx.from_flat_state(
        [
            (p, v.replace(jnp.asarray(params[_dotted(p)])))
            for p, v in nnx.to_flat_state(abstract_params)
        ]
    )
    model = nnx.merge(graphdef, filled, others)
    model.eval()
    return model, cfg


def save_hf(
    model: Model,
    config: ModelConfig,
    path: str | os.PathLike,
    *,
    special_ids: Mapping[str, int | None] | None = None,
) -> None:
    """Writes ``config.json`` and ``model.safetensors`` that ``transformers``' ``from_pretrained``
    loads as the matching HF model (GPT-2, Llama, BERT or Marian, chosen by ``config``; a BERT
    with ``num_classes`` as ``BertForSequenceClassification``, see ``interop.bert``); a model
    with LoRA adapters is written merged (``W + scale * A B``; ``interop.save_peft`` writes the
    adapters alone).

    Args:
      model: our ``DecoderLM``, ``Encoder`` or ``EncoderDecoder`` (loop or scanned layers).
      config: its ``ModelConfig``.
      path: the output directory (created if needed; existing files are overwritten).
      special_ids: the tokenizer's ``pad``, ``bos`` (what a decoder's input starts with) and
        ``eos`` ids; given, they go into ``config.json`` (``pad_token_id``, ``bos_token_id``,
        ``eos_token_id``, an encoder-decoder's ``decoder_start_token_id`` = ``bos``) and a
        ``generation_config.json``, so that ``generate`` starts and stops where ours does.
        None: each family's defaults (HF's own, Marian's OPUS-MT ids), no generation config.

    Raises:
      ValueError: ``config`` fits none of the families (what does not fit the closest), its
        ``mixer`` is not attention, or its attention is sparse (``local_window``).
    """
    family = writable_family(config)
    if has_adapters(model):  # a LoRA model is written merged: the function it computes
        model = nnx.clone(model)
        merge_adapters(model)
    params = layer_params(model, config)
    config, params = _with_zero_biases(config, params, getattr(family, "ZERO_BIASES", ()))
    hf_config = family.config_to_hf(config)
    unwritten = family.unwritten(config) if hasattr(family, "unwritten") else ()
    tensors = common.params_to_tensors(family.rules(config), params, ignore=unwritten)
    tensors = {checkpoint_name(family, name): x for name, x in tensors.items()}
    generation = None
    if special_ids is not None:
        generation = _generation_ids(config, special_ids)
        hf_config = {**hf_config, **generation}
        if "forced_eos_token_id" in hf_config:  # Marian's OPUS-MT id; our decoding forces none
            hf_config["forced_eos_token_id"] = None
    common.write_checkpoint(path, hf_config, tensors, generation_config=generation)


def checkpoint_name(family: ModuleType, name: str) -> str:
    """A rule's HF name as the family's model names the tensor (and its module):
    ``GPT2LMHeadModel`` holds the body under ``transformer.``."""
    if family is gpt2 and name != "lm_head.weight":
        return "transformer." + name
    return name


def writable_family(config: ModelConfig, who: str = "save_hf") -> ModuleType:
    """The family module that :func:`save_hf` writes ``config`` as.

    Raises:
      ValueError: starting with ``who``: a piece of the user's (``models.pieces``), muP away
        from its base width, a ``mixer``
        that is not attention, sparse attention (``local_window``), or a model that fits none
        of the families (what does not fit the closest, then how much each other one differs).
    """
    refuse_user_pieces(config, who)
    if config.width_multiplier not in (None, 1.0):
        raise ValueError(
            f"{who}: model.parametrization=mup at {config.width_multiplier:g}x its base width "
            "multiplies the logits and the attention scores by factors no Hugging Face "
            "architecture has; only standard models (or muP at its base width) are written"
        )
    if config.mixer != "attention":
        raise ValueError(
            f"{who}: model.mixer={config.mixer} (the Attention Free Transformer) has no "
            "Hugging Face counterpart; only models with mixer=attention are written"
        )
    if config.local_window is not None:
        raise ValueError(
            f"{who}: model.local_window={list(config.local_window)} (global_tokens="
            f"{config.global_tokens}) has no counterpart in the Hugging Face families written "
            "here: they attend to every position"
        )
    problems = {family: family.mismatches(config) for family in _MODULES}
    for family, found in problems.items():
        if not found:
            return family
    # Closest first: a family of the model's kind (decoder, encoder, encoder-decoder), then the
    # fewest settings apart; the others only by how many.
    closest, *others = sorted(
        problems, key=lambda f: (any(p.startswith("kind=") for p in problems[f]), len(problems[f]))
    )
    rest = ", ".join(f"{'/'.join(_architectures(f))} {len(problems[f])}" for f in others)
    raise ValueError(
        f"{who}: no Hugging Face family fits; closest {'/'.join(_architectures(closest))}, "
        f"which differs in {'; '.join(problems[closest])} (settings apart in the others: {rest})"
    )


def refuse_user_pieces(config: ModelConfig, who: str) -> None:
    """Raises a ValueError starting with ``who`` if ``config`` has a piece of the user's (an
    attention function, mixer, position bias, norm or feed-forward block of
    ``models.pieces``): no Hugging Face architecture expresses one."""
    user = user_pieces(config)
    if user:
        setting, value = next(iter(user.items()))
        raise ValueError(
            f"{who}: {setting}={value!r} is a variant of the user's, which no Hugging Face "
            "architecture expresses; only models of built-in pieces are written"
        )


# --------------------------------------------------------------------------- helpers
def _dtype_name(dtype) -> str:
    name = "float32" if dtype is None else jnp.dtype(dtype).name
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return name


def _dotted(path: tuple) -> str:
    return ".".join(str(part) for part in path)


def _abstract_split(cfg: ModelConfig):
    """``(graphdef, params, others)`` of the model ``cfg`` builds, without initializing the
    parameters: they are shapes only (the checkpoint fills them), while the RNG state of dropout
    (``others``) is made for real; XLA drops the unused parameter initialization from that jit."""
    abstract = nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0)))
    graphdef, params, _ = nnx.split(abstract, nnx.Param, ...)
    others = jax.jit(lambda: nnx.split(build_model(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)[2])()
    return graphdef, params, others


def _with_zero_biases(config: ModelConfig, params: dict, biases) -> tuple[ModelConfig, dict]:
    """``config`` with the ``biases`` it lacks turned on, and ``params`` with those biases as
    zeros (their shapes from the abstract model of that config, with a loop stack's paths as
    :func:`layer_params` names them): the same function, in the family's layout."""
    absent = {name: True for name in biases if not getattr(config, name)}
    if not absent:
        return config, params
    config = dataclasses.replace(config, **absent)
    loop = dataclasses.replace(config, scan_layers=False)
    abstract = nnx.eval_shape(lambda: build_model(loop, rngs=nnx.Rngs(0)))
    for path, variable in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        name = _dotted(path)
        if name not in params:
            params[name] = np.zeros(variable.shape, variable.dtype)
    return config, params


def layer_params(model, config: ModelConfig, kind=BASE) -> dict[str, np.ndarray]:
    """Our parameters of ``kind`` (default: the base model's, no adapters) as dotted path ->
    numpy array, with a scanned stack's layers split into the paths of a loop stack
    (``{encoder,decoder}.layers.layers.{i}....``) that the rules name."""
    params = {}
    for path, variable in nnx.to_flat_state(nnx.state(model, kind)):
        name, value = _dotted(path), np.asarray(jax.device_get(variable[...]))
        stack = next((s for s in _STACKS if name.startswith(s + ".")), None)
        if config.scan_layers and stack is not None:
            rest = name.removeprefix(stack + ".")
            for i in range(value.shape[0]):
                params[f"{stack}.{i}.{rest}"] = value[i]
        else:
            params[name] = value
    return params


def _generation_ids(config: ModelConfig, ids: Mapping[str, int | None]) -> dict[str, int | None]:
    """HF's token-id keys for our ``pad``/``bos``/``eos`` ids, each checked to be a token."""
    for name in ("pad", "bos", "eos"):
        value = ids.get(name)
        if value is not None and not 0 <= value < config.vocab_size:
            raise ValueError(
                f"save_hf: the {name} id {value} is outside the vocabulary [0, {config.vocab_size})"
            )
    found = {"pad_token_id": ids.get("pad"), "bos_token_id": ids.get("bos")}
    found["eos_token_id"] = ids.get("eos")
    if config.kind.is_seq2seq:
        found["decoder_start_token_id"] = ids.get("bos")
    return found
