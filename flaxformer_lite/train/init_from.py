"""The ``model`` section of a config that fine-tunes a Hugging Face checkpoint (``init_from=PATH``):
``PATH/config.json`` as our ``ModelConfig``, with only the keys of :data:`INIT_FROM_MODEL_KEYS`
set over it, and the checkpoint's tokenizer in place of ``data.tokenizer``
(:func:`checkpoint_model`, which :func:`~flaxformer_lite.train.config.load_config` calls).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from flaxformer_lite.data import DataConfig
from flaxformer_lite.train.schema import ConfigError

# The model keys that may be set with init_from: they change how the checkpoint's architecture
# computes or regularizes, not its parameters.
INIT_FROM_MODEL_KEYS = (
    "embedding_dropout",
    "attention_dropout",
    "residual_dropout",
    "dtype",
    "remat",
    "attention_implementation",
)
_TOKENIZER_KEYS = ("tokenizer", "tokenizer_path", "vocab_size")


def checkpoint_model(path: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """The ``model`` section for ``init_from=path``: the checkpoint's ``config.json`` as our
    ``ModelConfig`` (plain values), with the user's :data:`INIT_FROM_MODEL_KEYS` laid over it.

    Raises:
      ConfigError: another model key with another value than the checkpoint's, a tokenizer
        key other than its default, a missing directory or ``config.json``,
        an unsupported architecture, or an encoder-only model (naming ``init_from``).
    """
    from flaxformer_lite.interop import family_of
    from flaxformer_lite.interop.common import read_config

    model = values.get("model") or {}
    data = values.get("data") or {}
    if not isinstance(model, Mapping) or not isinstance(data, Mapping):
        raise ConfigError("model and data must be mappings")
    for key in _TOKENIZER_KEYS:
        # A run's resolved config.yaml repeats the (unused) defaults, or None (not set: a
        # prepared store's tokenizer).
        default = _plain_json(getattr(DataConfig(), key))
        if key in data and _plain_json(data[key]) not in (None, default):
            raise ConfigError(
                f"data.{key} cannot be set with init_from: the data are encoded "
                f"by the tokenizer of {path}"
            )
    try:
        hf_config = read_config(path)
        cfg = family_of(hf_config).config_from_hf(hf_config, dtype="float32")
    except (FileNotFoundError, ValueError) as error:
        raise ConfigError(f"init_from={path}: {error}") from None
    except KeyError as error:
        raise ConfigError(f"init_from={path}: config.json lacks the key {error}") from None
    if not cfg.kind.generates:
        raise ConfigError(
            f"init_from={path}: fine-tuning supports decoder LMs and "
            f"encoder-decoders, not {cfg.kind.words}"
        )
    checkpoint, underived = cfg.to_dict(), cfg.to_dict(derived=False)
    for key, value in model.items():
        # ... and the checkpoint's model values (a derived default as its value or None, as
        # config.yaml of older runs has it): those are no change.
        if key not in INIT_FROM_MODEL_KEYS and _plain_json(value) not in (
            _plain_json(checkpoint.get(key, _MISSING)),
            _plain_json(underived.get(key, _MISSING)),
        ):
            allowed = ", ".join(f"model.{k}" for k in INIT_FROM_MODEL_KEYS)
            raise ConfigError(
                f"model.{key} cannot be set with init_from: the architecture comes "
                f"from {path}/config.json (settable: {allowed})"
            )
    return {**checkpoint, **model}


_MISSING = object()


def _plain_json(value):
    """``value`` as JSON would read it back (tuples -> lists), for comparing a YAML value with a
    dataclass field; typed command-line text stays a string, so it never equals a number."""
    try:
        return json.loads(json.dumps(value))
    except TypeError:
        return value
