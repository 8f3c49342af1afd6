"""What every Hugging Face family shares: reading and writing checkpoint directories, and the
table of rules that maps HF tensor names to our parameter paths (with the transposes and reshapes
between the two layouts).

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Weights are read with ``safetensors.numpy``: nothing read from
disk runs code (no pickle), and no network is ever used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"


# --------------------------------------------------------------------------- files
def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """``path/config.json`` as a dict.

    Raises:
      FileNotFoundError: ``path`` is not a directory or has no ``config.json``.
      ValueError: the file is not a JSON object.
    """
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Hugging Face checkpoint directory {str(path)!r} does not exist")
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no {CONFIG_FILE} in {str(path)!r}")
    with open(file, encoding="utf-8") as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(config).__name__}")
    return config


def read_tensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint in ``path``, by HF name, as numpy arrays in the stored dtype.

    Reads ``model.safetensors``, or the shards named by ``model.safetensors.index.json``.

    Raises:
      FileNotFoundError: neither file is there, or a shard named by the index is missing.
      ValueError: the index does not name where a tensor is, a shard lacks a tensor it lists, or
        a weights file is not safetensors (truncated, garbage).
    """
    single, index = os.path.join(path, WEIGHTS_FILE), os.path.join(path, INDEX_FILE)
    if os.path.isfile(single):
        return _load_file(single)
    if not os.path.isfile(index):
        others = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".h5")))
        hint = f" (found {others}: only safetensors weights are read)" if others else ""
        raise FileNotFoundError(f"no {WEIGHTS_FILE} or {INDEX_FILE} in {str(path)!r}{hint}")
    with open(index, encoding="utf-8") as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no 'weight_map' of tensor name -> shard file")
    tensors: dict[str, np.ndarray] = {}
    for shard in sorted(set(weight_map.values())):
        # Shard names come from a file: keep them inside the checkpoint directory.
        if os.path.basename(shard) != shard:
            raise ValueError(f"{index} names a shard outside the directory: {shard!r}")
        file = os.path.join(path, shard)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"shard {shard!r} listed in {index} is missing")
        tensors.update(_load_file(file))
    missing = sorted(set(weight_map) - set(tensors))
    if missing:
        raise ValueError(f"the shards of {str(path)!r} lack tensors their index lists: {missing}")
    return tensors


def _load_file(file: str) -> dict[str, np.ndarray]:
    """``load_file(file)``, its error (a truncated download, a file of something else) named
    as a ValueError with the file, which commands print as one line."""
    try:
        return load_file(file)
    except SafetensorError as error:
        raise ValueError(f"{file} is not a readable safetensors file ({error})") from None


def write_checkpoint(
    path: str | os.PathLike,
    config: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    *,
    generation_config: Mapping[str, Any] | None = None,
    weights_file: str = WEIGHTS_FILE,
    config_file: str = CONFIG_FILE,
) -> None:
    """Writes ``config.json`` and one ``model.safetensors`` (tagged ``format: pt``, which
    ``transformers`` expects) into ``path``, creating the directory, and ``generation_config``
    (if given) as ``generation_config.json``; other names for the first two (a PEFT adapter's
    files) as ``config_file`` and ``weights_file``.

    Each file is written under a temporary name and then renamed over the old one, weights
    first, so an interrupted save leaves no half-written file (at worst, when overwriting, new
    weights beside the previous ``config.json``)."""
    os.makedirs(path, exist_ok=True)
    weights = os.path.join(path, weights_file)
    contiguous = {name: np.ascontiguousarray(x) for name, x in tensors.items()}
    try:
        save_file(contiguous, weights + ".tmp", metadata={"format": "pt"})
    except SafetensorError as error:  # a full disk, say: an OSError, as other files' writes
        with contextlib.suppress(FileNotFoundError):
            os.remove(weights + ".tmp")
        raise OSError(f"{weights}: cannot write ({error})") from None
    # safetensors creates its file 0600 whatever the umask: the mode open() gives the others.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(weights + ".tmp", 0o666 & ~umask)
    os.replace(weights + ".tmp", weights)
    if generation_config is not None:
        write_json(os.path.join(path, GENERATION_CONFIG_FILE), generation_config)
    write_json(os.path.join(path, config_file), config)


def write_json(file: str | os.PathLike, content: Mapping[str, Any]) -> None:
    """``content`` as indented JSON in ``file``, written under a temporary name, then renamed."""
    with open(f"{file}.tmp", "w", encoding="utf-8") as f:
        json.dump(dict(content), f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")
    os.replace(f"{file}.tmp", file)


# --------------------------------------------------------------------------- rules
# How a HF tensor is laid out relative to our parameter:
#   "same":   identical (norm scales, embedding tables, biases of D or F features);
#   "flat":   HF stores it 1-D (a q/k/v bias [H * Dh] is our [H, Dh], fused [3, H, Dh]);
#   "in_out": a kernel stored [inputs, outputs] (GPT-2's Conv1D) flattened to 2-D: a reshape;
#   "out_in": a kernel stored [outputs, inputs] (torch.nn.Linear): a transpose, then a reshape.
LAYOUTS = ("same", "flat", "in_out", "out_in")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One HF tensor <-> one of our parameters.

    Attributes:
      hf: the HF name; ``{i}`` stands for the layer index.
      ours: our parameter path, dotted (``decoder.layers.layers.{i}.mlp.wi.kernel``).
      layout: one of ``LAYOUTS``.
      num_in: for kernels, how many leading axes of our kernel are inputs (1 for ``[D, H, Dh]``,
        2 for the attention output ``[H, Dh, D]``).
      write_only: a copy of a parameter that another rule reads, written only so that HF's loader
        finds every tensor it expects; on load it is neither required nor read (a checkpoint's
        copy may hold a value HF's forward pass does not use).
    """

    hf: str
    ours: str
    layout: str = "same"
    num_in: int = 1
    write_only: bool = False

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"Rule.layout must be one of {LAYOUTS}, got {self.layout!r}")

    def for_layer(self, i: int) -> Rule:
        return dataclasses.replace(self, hf=self.hf.format(i=i), ours=self.ours.format(i=i))

    def to_ours(self, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """HF tensor -> our parameter of ``shape`` (the shape is checked, naming the tensor)."""
        hf_shape = self.hf_shape(shape)
        if tuple(x.shape) != hf_shape:
            raise ValueError(
                f"tensor {self.hf!r} has shape {tuple(x.shape)}, but the config implies "
                f"{hf_shape} (for our {self.ours} of shape {shape})"
            )
        return (x.T if self.layout == "out_in" else x).reshape(shape)

    def to_hf(self, y: np.ndarray) -> np.ndarray:
        """Our parameter -> the HF tensor."""
        if self.layout in ("same", "flat"):
            return np.ascontiguousarray(y.reshape(self.hf_shape(y.shape)))
        in_out = y.reshape(math.prod(y.shape[: self.num_in]), -1)
        return np.ascontiguousarray(in_out.T if self.layout == "out_in" else in_out)

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The HF shape of our parameter of ``shape``."""
        if self.layout == "same":
            return tuple(shape)
        if self.layout == "flat":
            return (math.prod(shape),)
        rows, cols = math.prod(shape[: self.num_in]), math.prod(shape[self.num_in :])
        return (rows, cols) if self.layout == "in_out" else (cols, rows)


def layer_rules(rules: Iterable[Rule], num_layers: int) -> list[Rule]:
    """The per-layer ``rules`` instantiated for layers ``0 .. num_layers - 1``."""
    return [rule.for_layer(i) for i in range(num_layers) for rule in rules]


def tensors_to_params(
    rules: Iterable[Rule],
    tensors: Mapping[str, np.ndarray],
    shapes: Mapping[str, tuple[int, ...]],
    *,
    ignore: Iterable[str] = (),
    dtype=np.float32,
) -> dict[str, np.ndarray]:
    """Our parameters (dotted path -> array of ``dtype``) from the HF ``tensors``.

    Args:
      rules: one per parameter of our model (and ``write_only`` copies, skipped).
      tensors: HF name -> array.
      shapes: our parameter paths -> shapes (of the model the config builds).
      ignore: regular expressions of HF names that carry no parameter (buffers such as GPT-2's
        causal mask ``h.0.attn.bias``, or a tied head stored twice).
      dtype: the parameter dtype.

    Raises:
      ValueError: a tensor is missing, has the wrong shape, or is not used by any rule.
    """
    all_rules = list(rules)
    rules = [rule for rule in all_rules if not rule.write_only]
    missing = sorted(rule.hf for rule in rules if rule.hf not in tensors)
    if missing:
        raise ValueError(f"the checkpoint lacks tensors the config needs: {missing}")
    used = {rule.hf for rule in all_rules}
    patterns = [re.compile(p) for p in ignore]
    unused = sorted(
        name
        for name in tensors
        if name not in used and not any(p.fullmatch(name) for p in patterns)
    )
    if unused:
        raise ValueError(
            f"the checkpoint has tensors this model does not use (a feature the config does not "
            f"describe?): {unused}"
        )
    params = {rule.ours: rule.to_ours(tensors[rule.hf], shapes[rule.ours]) for rule in rules}
    unmapped = sorted(set(shapes) - set(params))
    if unmapped:  # a bug in a family's table, not in the checkpoint
        raise AssertionError(f"no rule fills our parameters {unmapped}")
    return {path: np.asarray(x, dtype) for path, x in params.items()}


def params_to_tensors(
    rules: Iterable[Rule], params: Mapping[str, np.ndarray], *, ignore: Iterable[str] = ()
) -> dict[str, np.ndarray]:
    """The HF tensors (name -> array) of our parameters (dotted path -> array).

    Args:
      rules: one per HF tensor.
      params: our dotted path -> array.
      ignore: regular expressions of our paths that the HF architecture has no place for and
        that are left out (the masked-LM head of a model saved as a sequence classifier).

    Raises:
      ValueError: the model has parameters no rule writes (its config has a feature the HF
        family lacks), or lacks one a rule needs.
    """
    rules = list(rules)
    patterns = [re.compile(p) for p in ignore]
    params = {k: v for k, v in params.items() if not any(p.fullmatch(k) for p in patterns)}
    missing = sorted(rule.ours for rule in rules if rule.ours not in params)
    extra = sorted(set(params) - {rule.ours for rule in rules})
    if missing or extra:
        raise ValueError(
            f"the model's parameters do not match the Hugging Face layout: missing {missing}, "
            f"unexpected {extra}"
        )
    return {rule.hf: rule.to_hf(np.asarray(params[rule.ours])) for rule in rules}


# The biases every GPT-2, BERT and Marian layer has: a model without them is the same model
# with zero biases, and is written so (hf.save_hf).
ZERO_BIASES = ("norm_bias", "qkv_bias", "attention_out_bias", "mlp_bias")


def multi_head_mismatches(cfg, family: str, want: dict, activations, zero_biases=()) -> list[str]:
    """What in ``cfg`` a ``family`` model (plain multi-head attention) cannot have: each field
    differing from ``want`` (but a bias of ``zero_biases`` left out: zeros), grouped-query
    attention, a head size other than ``d_model // num_heads``, and an activation outside
    ``activations``."""
    problems = [
        f"{name}={getattr(cfg, name)!r} ({family} has {value!r})"
        for name, value in want.items()
        if getattr(cfg, name) != value and name not in zero_biases
    ]
    if cfg.num_kv_heads != cfg.num_heads:
        problems.append(
            f"num_kv_heads={cfg.num_kv_heads} ({family} has no grouped-query attention)"
        )
    if cfg.head_dim * cfg.num_heads != cfg.d_model:
        problems.append(f"head_dim={cfg.head_dim} ({family} has d_model // num_heads)")
    if cfg.activation not in activations:
        problems.append(f"activation={cfg.activation!r} (supported: {sorted(activations)})")
    return problems


def require(problems: list[str], what: str) -> None:
    """Raises one ValueError listing every problem (settings that cannot be represented)."""
    if problems:
        raise ValueError(f"{what}: " + "; ".join(problems))
