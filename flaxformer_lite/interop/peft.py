"""Hugging Face PEFT LoRA adapters (``adapter_config.json`` + ``adapter_model.safetensors``), read
from and written to local directories, for the models of :func:`~.hf.load_hf`'s families:

    model, cfg = load_hf("checkpoints/gpt2")
    merge_peft(model, cfg, "adapters/gpt2-shakespeare")       # W + scale * A B, in place
    state = load_peft_adapters(state, cfg, "adapters/...")      # into a LoRA run's adapters
    save_peft(lora_model, cfg, "adapters/mine")                 # PeftModel.from_pretrained reads it

PEFT stores every pair in ``torch.nn.Linear``'s layout, ``lora_A.weight [r, in]`` and
``lora_B.weight [out, r]`` under ``base_model.model.<module>``, GPT-2's ``Conv1D`` modules too;
the base kernel's rule of the family (:mod:`.gpt2`, :mod:`.llama`, :mod:`.bert`, :mod:`.marian`)
says how its inputs and outputs lie in ours (a fused q/k/v ``[D, 3, H, Dh]``, an output
``[H, Dh, D]``): ``A`` is ours ``[*in, r]``, ``B`` ours ``[r, *out]``, with ``scale = alpha / r``
(``alpha / sqrt(r)`` under ``use_rslora``), the function ``PeftModel`` computes.
"""

from __future__ import annotations

import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from flaxformer_lite.interop import common
from flaxformer_lite.interop.common import Rule
from flaxformer_lite.models.config import ModelConfig, ModelKind
from flaxformer_lite.nn.lora import lora_scale, projections

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])(\.default)?\.weight")
# PEFT's task_type for each kind of model (a masked LM has none: a plain PeftModel).
TASK_TYPES = {ModelKind.DECODER: "CAUSAL_LM", ModelKind.ENCODER_DECODER: "SEQ_2_SEQ_LM"}


def read_peft(cfg: ModelConfig, directory) -> tuple[dict, dict[str, tuple]]:
    """The adapter's settings and its pairs as ours: ``{kernel path (a loop stack's, dotted):
    (A [*in, r], B [r, *out])}``, float32 numpy.

    Raises:
      FileNotFoundError: the directory or one of its two files is missing.
      ValueError: an adapter this does not read (not LoRA, DoRA, biases, modules saved whole,
        per-module alphas or ranks), a key that names no kernel of the model (an adapter of
        another architecture), a pair without its other half, or a shape that does not fit the
        base (an adapter of another size); each names the key.
    """
    settings = _read_config(directory)
    tensors = common._load_file(_file(directory, WEIGHTS_FILE))
    family, rules = _rules(cfg, "a PEFT adapter")
    by_hf = {rule.hf: rule for rule in rules.values()}
    shapes = _kernel_shapes(cfg)
    halves: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise ValueError(f"{directory}: {key!r} is not a LoRA weight (lora_A or lora_B)")
        halves.setdefault(match["module"], {})[match["part"]] = value
    pairs = {}
    for module, pair in sorted(halves.items()):
        where = f"{directory}: base_model.model.{module}"
        if set(pair) != {"A", "B"}:
            (missing,) = {"A", "B"} - set(pair)
            raise ValueError(f"{where}: lora_{missing} is missing")
        rule = by_hf.get(family.hf_name(module + ".weight"))
        if rule is None or rule.layout not in ("in_out", "out_in"):
            raise ValueError(f"{where}: the base ({cfg.kind}) has no projection of that name")
        shape, rank = shapes[rule.ours], pair["A"].shape[0]
        in_shape, out_shape = shape[: rule.num_in], shape[rule.num_in :]
        try:
            a = _factor(rule, rule.num_in).to_ours(pair["A"], (*in_shape, rank))
            b = _factor(rule, 1).to_ours(pair["B"], (rank, *out_shape))
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        if rank != settings["r"]:
            raise ValueError(f"{where}: rank {rank}, but r={settings['r']} in {CONFIG_FILE}")
        pairs[rule.ours] = (a.astype(np.float32), b.astype(np.float32))
    return settings, pairs


def merge_peft(model, cfg: ModelConfig, directory: str | os.PathLike) -> int:
    """Adds the LoRA adapter in ``directory`` to ``model``'s kernels (``cfg``: its config, as
    :func:`~flaxformer_lite.interop.load_hf` gives them); returns how many kernels it changed.
    Errors: as :func:`read_peft`'s; nothing is changed then."""
    if cfg.scan_layers:
        raise ValueError("merge_peft takes a model of stacked layers in a loop (load_hf's)")
    settings, pairs = read_peft(cfg, directory)
    scale = lora_scale(settings["lora_alpha"], settings["r"], bool(settings.get("use_rslora")))
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    updates = {}
    for path, variable in flat:
        if (name := _dotted(path)) in pairs:
            a, b = pairs[name]
            kernel = variable[...]
            merged = kernel.astype(jnp.float32) + scale * np.tensordot(a, b, axes=1)
            updates[name] = merged.astype(kernel.dtype)
    merged = [(p, v.replace(updates.get(_dotted(p), v[...]))) for p, v in flat]
    nnx.update(model, nnx.from_flat_state(merged))
    return len(updates)


def load_peft_adapters(state, cfg: ModelConfig, directory: str | os.PathLike, scale: float):
    """Writes the PEFT adapter in ``directory`` into the adapters of a created train state
    (``state[0]``: a model of ``cfg`` with LoRA adapters of ``scale``), each in the sharding
    of the array it replaces; returns ``state``. Errors: as :func:`peft_values`'."""
    values = peft_values(state[0], cfg, directory, scale)

    def place(path, like):
        value = np.asarray(values[path], like.dtype)
        return jax.make_array_from_callback(value.shape, like.sharding, lambda i: value[i])

    placed = {path: place(path, like) for path, like in _adapters(state[0]).items()}
    nnx.replace_by_pure_dict(state[0], traverse_util.unflatten_dict(placed))
    return state


def peft_values(model_state, cfg: ModelConfig, directory, scale: float) -> dict[tuple, np.ndarray]:
    """The PEFT adapter in ``directory`` as the values of the adapters of ``model_state`` (a
    model of ``cfg`` with LoRA adapters of ``scale``; its arrays may be abstract), by path.

    Raises:
      ValueError: as :func:`read_peft`; an adapter whose modules, rank or scale differ from the
        model's adapters (naming the first difference).
    """
    settings, pairs = read_peft(cfg, directory)
    theirs = lora_scale(settings["lora_alpha"], settings["r"], bool(settings.get("use_rslora")))
    adapters = {_dotted(path): path for path in _adapters(model_state)}
    factors = {
        f"{kernel.removesuffix('.kernel')}.lora.{part}": value
        for kernel, pair in pairs.items()
        for part, value in zip("ab", pair, strict=True)
    }
    values = _stacked(cfg, factors)
    rank = next(iter(_adapters(model_state).values())).shape[-1]  # a: [..., r]
    problems = [
        *(
            f"it adapts {name[:-7]}, which lora.targets leave out"
            for name in values.keys() - adapters.keys()
        ),
        *(f"it has no pair for {name[:-7]}" for name in adapters.keys() - values.keys()),
        *([f"its r is {settings['r']}, lora.rank {rank}"] if settings["r"] != rank else []),
        *(
            [f"its scale (lora_alpha / r) is {theirs:.6g}, the run's {scale:.6g}"]
            if not math.isclose(theirs, scale, rel_tol=1e-9)
            else []
        ),
    ]
    if problems:
        raise ValueError(f"{directory} does not fit the run's adapters: {sorted(problems)[0]}")
    return {path: values[name] for name, path in adapters.items()}


def _adapters(model_state) -> dict[tuple, object]:
    """The LoRA factors of a model's state by path."""
    pure = nnx.to_pure_dict(nnx.filter_state(model_state, nnx.LoRAParam))
    return traverse_util.flatten_dict(pure)


def save_peft(
    model, cfg: ModelConfig, directory: str | os.PathLike, *, base: str | None = None
) -> list[str]:
    """Writes ``model``'s LoRA adapters (:mod:`flaxformer_lite.nn.lora`) into ``directory`` as a
    PEFT adapter of the Hugging Face model :func:`~.hf.save_hf` writes for ``cfg``
    (``base``: its path, recorded as ``base_model_name_or_path``); returns the modules adapted.

    Raises:
      ValueError: a model without adapters, or one :func:`~.hf.save_hf` cannot write; an
        adapter on a projection of no Hugging Face module.
    """
    from flaxformer_lite.interop.hf import checkpoint_name, layer_params

    family, rules = _rules(cfg, "a PEFT adapter")
    lora = {name: dense.lora for name, dense in projections(model).items() if dense.lora}
    if not lora:
        raise ValueError("the model has no LoRA adapters to write as a PEFT adapter")
    (scale,) = {adapter.scale for adapter in lora.values()}
    factors = layer_params(model, cfg, nnx.LoRAParam)
    tensors, modules = {}, []
    for name in sorted(factors):
        if not name.endswith(".lora.a"):
            continue
        stem = name.removesuffix(".lora.a")
        rule = rules.get(stem + ".kernel")
        if rule is None:
            raise ValueError(f"{stem} is no projection of a Hugging Face {cfg.kind} module")
        module = checkpoint_name(family, rule.hf).removesuffix(".weight")
        key = f"base_model.model.{module}"
        tensors[f"{key}.lora_A.weight"] = _factor(rule, rule.num_in).to_hf(factors[name])
        tensors[f"{key}.lora_B.weight"] = _factor(rule, 1).to_hf(factors[stem + ".lora.b"])
        modules.append(module)
    rank = next(iter(tensors.values())).shape[0]
    settings = {
        "peft_type": "LORA",
        "task_type": TASK_TYPES.get(cfg.kind),
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": scale * rank,
        "lora_dropout": next(iter(lora.values())).dropout.rate,
        "target_modules": modules,
        "fan_in_fan_out": any(rule.layout == "in_out" for rule in rules.values()),
        "bias": "none",
        "use_rslora": False,
        "inference_mode": True,
    }
    common.write_checkpoint(
        directory, settings, tensors, weights_file=WEIGHTS_FILE, config_file=CONFIG_FILE
    )
    return modules


def _rules(cfg: ModelConfig, who: str):
    """The family ``cfg`` is written as and its kernel rules by our dotted path."""
    from flaxformer_lite.interop.hf import writable_family

    family = writable_family(cfg, who=who)
    return family, {rule.ours: rule for rule in family.rules(cfg)}


def _factor(rule: Rule, num_in: int) -> Rule:
    """The rule of one LoRA factor of ``rule``'s kernel: a ``torch.nn.Linear`` weight."""
    return Rule(rule.hf, rule.ours, "out_in", num_in)


def _kernel_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameters' shapes by dotted path, a loop stack's (as the rules name them)."""
    import dataclasses

    from flaxformer_lite.models.build import abstract_model

    loop = abstract_model(dataclasses.replace(cfg, scan_layers=False))
    return {_dotted(p): tuple(v.shape) for p, v in nnx.to_flat_state(nnx.state(loop, nnx.Param))}


def _stacked(cfg: ModelConfig, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Values named by a loop stack's paths (``layers.{i}.``) as a model of ``cfg`` names them:
    a scanned stack's layers stacked along a leading axis."""
    if not cfg.scan_layers:
        return values
    pattern = re.compile(r"(?P<stack>(?:en|de)coder\.layers\.layers)\.(?P<i>\d+)\.(?P<rest>.+)")
    stacked: dict[str, dict[int, np.ndarray]] = {}
    out = {}
    for name, value in values.items():
        match = pattern.fullmatch(name)
        if match is None:
            out[name] = value
        else:
            key = f"{match['stack']}.{match['rest']}"
            stacked.setdefault(key, {})[int(match["i"])] = value
    for key, layers in stacked.items():
        out[key] = np.stack([layers[i] for i in sorted(layers)])
    return out


def _dotted(path) -> str:
    return ".".join(map(str, path))


def _read_config(directory) -> dict:
    """The adapter's settings, refused where they ask what a merge of A and B cannot give."""
    path = _file(directory, CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as file:
            settings = json.load(file)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error.msg})") from None
    if not isinstance(settings, dict) or settings.get("peft_type") != "LORA":
        raise ValueError(f"{path}: not a LoRA adapter (peft_type {settings.get('peft_type')!r})")
    refused = {
        "use_dora": settings.get("use_dora"),
        "bias": settings.get("bias") not in (None, "none") and settings.get("bias"),
        "modules_to_save": settings.get("modules_to_save"),
        "alpha_pattern": settings.get("alpha_pattern"),
        "rank_pattern": settings.get("rank_pattern"),
    }
    for name, value in refused.items():
        if value:
            raise ValueError(f"{path}: {name}={value!r} is not read here (plain LoRA pairs only)")
    for name in ("lora_alpha", "r"):
        if not isinstance(settings.get(name), int | float) or settings[name] <= 0:
            raise ValueError(f"{path}: {name} must be a positive number")
    return settings


def _file(directory, name: str) -> str:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{directory}: no {name}; is it a PEFT adapter directory?")
    return path
