"""A Hugging Face PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``)
merged into the model of its base, read from a local directory: each targeted kernel ``W``
becomes ``W + scale * A B``, the function PEFT's ``PeftModel`` computes on that base, with
``scale = alpha / r``
(``alpha / sqrt(r)`` under ``use_rslora``).

    model, cfg = load_hf("checkpoints/gpt2")
    merge_peft(model, cfg, "adapters/gpt2-shakespeare")  # in place

PEFT stores every pair in ``torch.nn.Linear``'s layout, ``lora_A.weight [r, in]`` and
``lora_B.weight [out, r]`` under ``base_model.model.<module>``, GPT-2's ``Conv1D`` modules too;
the base kernel's rule of the family (:mod:`.gpt2`, :mod:`.llama`, :mod:`.bert`) says how its
inputs and outputs lie in ours (a fused q/k/v ``[D, 3, H, Dh]``, an output ``[H, Dh, D]``).
"""

from __future__ import annotations

import json
import math
import os
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxformer_lite.interop import common
from flaxformer_lite.interop.common import Rule
from flaxformer_lite.models.config import ModelConfig

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<part>[AB])(\.default)?\.weight")


def merge_peft(model, cfg: ModelConfig, directory: str | os.PathLike) -> int:
    """Adds the LoRA adapter in ``directory`` to ``model``'s kernels (``cfg``: its config, as
    :func:`~flaxformer_lite.interop.load_hf` gives them); returns how many kernels it changed.

    Raises:
      FileNotFoundError: the directory or one of its two files is missing.
      ValueError: an adapter this does not read (not LoRA, DoRA, biases, modules saved whole,
        per-module alphas), a key that names no kernel of the model (an adapter of another
        architecture), a pair without its other half, or a shape that does not fit the base
        (an adapter of another size); each names the key. Nothing is changed then.
    """
    settings = _read_config(directory)
    tensors = common._load_file(_file(directory, WEIGHTS_FILE))
    from flaxformer_lite.interop.hf import _dotted, writable_family

    family = writable_family(cfg, who="merge_peft")
    rules = {rule.hf: rule for rule in family.rules(cfg)}
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise ValueError(f"{directory}: {key!r} is not a LoRA weight (lora_A or lora_B)")
        pairs.setdefault(match["module"], {})[match["part"]] = value
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    params = {_dotted(path): variable for path, variable in flat}
    updates = {}
    for module, pair in sorted(pairs.items()):
        where = f"{directory}: base_model.model.{module}"
        if set(pair) != {"A", "B"}:
            (missing,) = {"A", "B"} - set(pair)
            raise ValueError(f"{where}: lora_{missing} is missing")
        rule = rules.get(family.hf_name(module + ".weight"))
        if rule is None or rule.layout not in ("in_out", "out_in"):
            raise ValueError(f"{where}: the base ({cfg.kind}) has no projection of that name")
        kernel = params[rule.ours][...]
        rank = pair["A"].shape[0]
        in_shape, out_shape = kernel.shape[: rule.num_in], kernel.shape[rule.num_in :]
        try:
            a = Rule(rule.hf, rule.ours, "out_in", rule.num_in).to_ours(
                pair["A"], (*in_shape, rank)
            )
            b = Rule(rule.hf, rule.ours, "out_in", 1).to_ours(pair["B"], (rank, *out_shape))
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        scale = settings["lora_alpha"] / (math.sqrt(rank) if settings.get("use_rslora") else rank)
        delta = scale * np.tensordot(a.astype(np.float32), b.astype(np.float32), axes=1)
        updates[rule.ours] = (kernel.astype(jnp.float32) + delta).astype(kernel.dtype)
    # Every pair read and checked before the model changes.
    merged = [(p, v.replace(updates.get(_dotted(p), v[...]))) for p, v in flat]
    nnx.update(model, nnx.from_flat_state(merged))
    return len(updates)


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
    }
    for name, value in refused.items():
        if value:
            raise ValueError(f"{path}: {name}={value!r} is not read here (plain LoRA pairs only)")
    if not isinstance(settings.get("lora_alpha"), int | float):
        raise ValueError(f"{path}: lora_alpha must be a number")
    return settings


def _file(directory, name: str) -> str:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{directory}: no {name}; is it a PEFT adapter directory?")
    return path
