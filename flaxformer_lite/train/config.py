"""The typed training configuration: nested frozen dataclasses, read from YAML presets and
``key=value`` command-line overrides, every key and type checked with a message that names it.

    cfg = load_config("gpt2_small", ["train.steps=200", "optimizer.lr=3e-4"])

``load_config``'s file is a path, or the name of a recipe the package ships
(:mod:`flaxformer_lite.train.recipes`: ``gpt2_small``, ``ablations/aft_full``).

A YAML file mirrors the dataclasses (``model:``, ``optimizer:``, ``train:``, ...). The ``model``
section may start from a preset (``model: {preset: gpt2-tiny, num_heads: 4}``), or, with
``init_from=PATH`` (a Hugging Face checkpoint directory), from ``PATH/config.json``
(:mod:`flaxformer_lite.train.init_from`): then only the keys of
:data:`~flaxformer_lite.train.init_from.INIT_FROM_MODEL_KEYS` may be set in ``model`` (other keys
would change the architecture the weights were trained for) and none of ``data.tokenizer``,
``data.tokenizer_path``, ``data.vocab_size`` (the checkpoint's own tokenizer is used).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import pathlib
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import yaml

from flaxformer_lite.data import TASKS, DataConfig, Task, settled_parts
from flaxformer_lite.evals.config import EvalsConfig
from flaxformer_lite.models.config import ModelConfig, ModelKind
from flaxformer_lite.parallel.config import DistributedConfig, check_context_length
from flaxformer_lite.settings import flatten, setting
from flaxformer_lite.train.config_keys import OTHER_NAMES, renamed_key, renamed_keys
from flaxformer_lite.train.init_from import checkpoint_model
from flaxformer_lite.train.recipes import recipe_path, unknown_recipe_hint
from flaxformer_lite.train.schema import ConfigError, OverrideText, UnknownKeyError, build
from flaxformer_lite.train.sections import (
    CheckpointConfig,
    LoopConfig,
    LoraConfig,
    MeshConfig,
    OptimizerConfig,
)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs. ``run_dir`` holds its config, metrics and checkpoints.

    The defaults are the embedded default run (the recipe ``default``, ``configs/default.yaml``,
    spells them out): a GPT-2-style decoder of 0.1M parameters (no dropout: the data never repeat)
    learning three-digit addition and subtraction on a CPU in a few minutes.
    """

    run_dir: str = setting(
        "runs/default",
        help="the run's directory: config, metrics, checkpoints; the same one resumes",
    )
    seed: int = setting(0, help="the seed of initialization, data order and dropout")
    init_from: str | None = setting(
        None,
        help="a Hugging Face checkpoint directory to fine-tune (GPT-2, Llama, Marian): "
        "the model is its config.json, a fresh run starts from its weights, with its tokenizer",
    )
    model: ModelConfig = setting(
        factory=lambda: ModelConfig.from_preset(
            "gpt2-tiny", embedding_dropout=0.0, attention_dropout=0.0, residual_dropout=0.0
        ),
        help="the architecture (model.preset=NAME starts from a preset, e.g. gpt2-tiny)",
    )
    data: DataConfig = setting(
        factory=DataConfig, help="where the data come from and how they become batches"
    )
    optimizer: OptimizerConfig = setting(
        factory=OptimizerConfig, help="AdamW, its learning-rate schedule and clipping"
    )
    train: LoopConfig = setting(factory=LoopConfig, help="the training loop")
    lora: LoraConfig = setting(
        factory=LoraConfig,
        help="low-rank adapters (LoRA): with lora.rank set, only they train, the base stays",
    )
    evals: EvalsConfig = setting(
        factory=EvalsConfig,
        help="downstream tasks (HellaSwag, ARC, PIQA, LAMBADA, a text's perplexity, one's own) "
        "scored as lm-evaluation-harness scores them while training",
    )
    checkpoint: CheckpointConfig = setting(
        factory=CheckpointConfig, help="Orbax checkpoints in <run_dir>/checkpoints"
    )
    mesh: MeshConfig = setting(
        factory=MeshConfig,
        help="the device mesh (devices = data x fsdp x context x tensor) and how arrays are "
        "sharded on it",
    )
    distributed: DistributedConfig = setting(
        factory=DistributedConfig,
        help="how this process joins a multi-process run (jax.distributed)",
    )

    def __post_init__(self):
        model = self.model
        if model.positions == "learned" and self.data.seq_len > model.max_length:
            raise ConfigError(
                f"data.seq_len ({self.data.seq_len}) exceeds model.max_length "
                f"({model.max_length}), the rows of the learned position table: lower "
                "data.seq_len or raise model.max_length"
            )
        if model.parametrization == "mup" and self.optimizer.schedule == "inverse_sqrt":
            raise ConfigError(
                "model.parametrization=mup with optimizer.schedule=inverse_sqrt: that schedule "
                "scales every learning rate by d_model^-0.5, which muP's per-parameter rates "
                "replace; use cosine, linear or constant"
            )
        if self.mesh.context > 1:
            self._check_context()
        if self.lora.rank is not None:
            self._check_lora()
        if self.evals.tasks and model.kind is not ModelKind.DECODER:
            raise ConfigError(
                f"evals.tasks are scored by a decoder LM's log-likelihoods; model.kind is "
                f"{model.kind}: leave evals.tasks empty"
            )

    def _check_lora(self):
        """Adapters train with AdamW on a standard model; a PEFT adapter belongs to a base."""
        if self.optimizer.name != "adamw":
            raise ConfigError(
                f"lora.rank with optimizer.name={self.optimizer.name}: the adapters train with "
                "adamw (Muon orthogonalizes whole matrices, not their low-rank factors)"
            )
        if self.model.parametrization != "standard":
            raise ConfigError(
                "lora.rank with model.parametrization=mup: muP has no rule for the adapters' "
                "factors; use the standard parametrization"
            )
        if self.lora.adapter is not None and self.init_from is None:
            raise ConfigError(
                f"lora.adapter={self.lora.adapter} needs init_from: the Hugging Face model the "
                "adapter was trained on"
            )

    def _check_context(self):
        """A sequence split over ``mesh.context`` devices: a decoder whose only mixer is
        attention (its keys are gathered across the devices), in whole zig-zag blocks."""
        context, model = self.mesh.context, self.model
        if model.kind is not ModelKind.DECODER:
            raise ConfigError(
                f"mesh.context={context} splits the sequences of decoder models; model.kind is "
                f"{model.kind}: use mesh.context=1"
            )
        if model.mixer != "attention":
            raise ConfigError(
                f"mesh.context={context} with model.mixer={model.mixer}: only attention mixes "
                "tokens across a split sequence; use mesh.context=1"
            )
        try:
            check_context_length(self.data.seq_len, context)
        except ValueError as error:
            raise ConfigError(str(error)) from None

    @functools.cached_property
    def task(self) -> Task:
        """What the model trains on (:func:`task_of`), resolved once."""
        return task_of(self.model)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (lists for tuples), ready for YAML and JSON;
        ``config_from_dict(cfg.to_dict()) == cfg``."""
        values = dataclasses.asdict(self)
        values["model"] = self.model.to_dict(derived=False)  # derived values stay derived
        return _plain(values)


def task_of(model: ModelConfig) -> Task:
    """What a model of ``model`` is trained on: next tokens (``lm``), target tokens given a
    source (``seq2seq``), masked tokens (``mlm``) or a label per sequence (``classify``)."""
    if model.kind is ModelKind.DECODER:
        return TASKS["lm"]
    if model.kind.is_seq2seq:
        return TASKS["seq2seq"]
    return TASKS["classify" if model.num_classes is not None else "mlm"]


# Keys that may change when a run resumes: they do not change what is being trained.
RUNTIME_KEYS = (
    "run_dir",
    "train.steps",
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.decode_examples",
    "train.log_samples",
    "train.compilation_cache",
    "evals.",
    "checkpoint.",
    "mesh.",
    "distributed.",
)


def load_config(
    path: str | pathlib.Path | None = None,
    overrides: Sequence[str] = (),
    notify: Callable[[str], None] | None = None,
) -> TrainConfig:
    """The config of a YAML file (or the defaults) with ``key=value`` overrides applied; ``path``
    that is no file but a shipped recipe's name (``gpt2_small``) reads that recipe. ``notify``
    gets a line for each old key name (:data:`~.config_keys.RENAMED_KEYS`) the file or an
    override uses.

    Raises:
      ConfigError: a missing or malformed file, an unknown key (with the closest valid key), a
        value of the wrong type, or a value the section rejects.
    """
    values: dict[str, Any] = {}
    if path is not None:
        path = pathlib.Path(path)
        if not path.is_file():
            path = recipe_path(path) or path
        try:
            loaded = yaml.load(path.read_text(encoding="utf-8"), Loader=_ConfigLoader)  # noqa: S506 - a SafeLoader
        except OSError as error:
            hint = "" if path.exists() else f" ({unknown_recipe_hint(path)})"
            raise ConfigError(f"cannot read config file {path}: {error.strerror}{hint}") from None
        except UnicodeDecodeError as error:
            raise ConfigError(
                f"config file {path} is not UTF-8 text (byte {error.start}: {error.reason})"
            ) from None
        except yaml.YAMLError as error:
            raise ConfigError(
                f"config file {path} is not valid YAML: {_yaml_line(error)}"
            ) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(
                f"config file {path} must hold a mapping, got {type(loaded).__name__}"
            )
        values = renamed_keys(loaded or {}, f"config file {path}", notify)
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep or not key:
            raise ConfigError(f"overrides are key=value, got {override!r}")
        set_dotted(values, renamed_key(key.strip(), override, notify), OverrideText(raw))
    init_from = values.get("init_from")
    if isinstance(init_from, OverrideText) and init_from.strip().lower() in ("", "none", "null"):
        init_from = values["init_from"] = None
    if init_from is not None:
        values["model"] = checkpoint_model(str(init_from), values)
    return config_from_dict(values)


class _ConfigLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that reads numbers as YAML writers emit them (``1e-3``, ``3.0E-4``:
    YAML 1.1 wants a dot and a signed exponent, ``1.0e-3``, and reads the others as strings)
    and refuses a key given twice in one mapping (YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[0-9][0-9_]*[eE][-+]?[0-9]+
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _yaml_line(error: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong and where (its text quotes the file's lines)."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return problem + (f" (line {mark.line + 1}, column {mark.column + 1})" if mark else "")


def config_from_dict(values: Mapping[str, Any]) -> TrainConfig:
    """A :class:`TrainConfig` from nested plain values, checked key by key; old key names
    (:data:`~.config_keys.RENAMED_KEYS`, as older runs saved them) are read as their new ones."""
    try:
        return build(TrainConfig, renamed_keys(values, "the config"), "")
    except UnknownKeyError as error:
        raise ConfigError(f"{error}{closest_key_hint(error.key)}") from None


def closest_key_hint(key: str) -> str:
    """`` (did you mean 'optimizer.lr'?)`` for an unknown dotted ``key``: our name for what other
    trainers call it (:data:`~.config_keys.OTHER_NAMES`), else the closest spelling; empty if
    neither."""
    ours = OTHER_NAMES.get(key.rpartition(".")[2])
    candidates = valid_keys() + _entry_keys(key)
    close = [ours] if ours and ours != key else difflib.get_close_matches(key, candidates, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _entry_keys(key: str, cls=TrainConfig, prefix: str = "") -> list[str]:
    """The keys of the named entry ``key`` is in, in a section of named entries
    (``data.mixture.<name>.weight``, ``evals.tasks.<name>.path``)."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        section, hint = prefix + field.name, hints[field.name]
        if dataclasses.is_dataclass(hint):
            if found := _entry_keys(key, hint, section + "."):
                return found
        elif typing.get_origin(hint) is dict and key.startswith(section + "."):
            entry = typing.get_args(hint)[1]
            name = key.removeprefix(section + ".").partition(".")[0]
            if dataclasses.is_dataclass(entry):
                return [f"{section}.{name}.{f.name}" for f in dataclasses.fields(entry)]
    return []


def config_diff(old: TrainConfig, new: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (old, new)}`` for every leaf that differs."""
    old_flat, new_flat = (flatten(_settled(cfg.to_dict())) for cfg in (old, new))
    return {
        key: (old_flat.get(key), new_flat.get(key))
        for key in sorted(old_flat.keys() | new_flat.keys())
        if old_flat.get(key) != new_flat.get(key)
    }


def is_runtime_key(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RUNTIME_KEYS)


def valid_keys(cls=TrainConfig, prefix: str = "") -> list[str]:
    """Every dotted key the schema accepts (sections and leaves)."""
    keys = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        key = prefix + field.name
        keys.append(key)
        if dataclasses.is_dataclass(hints[field.name]):
            keys += valid_keys(hints[field.name], key + ".")
    return keys + ([prefix + "preset"] if cls is ModelConfig else [])


def set_dotted(values: dict, key: str, value) -> None:
    """Sets the dotted ``key`` of nested ``values`` (sections made on the way).

    Raises:
      ConfigError: a key whose section is a value.
    """
    *sections, leaf = key.split(".")
    node = values
    for section in sections:
        child = node.setdefault(section, {})
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {key}: {section} is not a section")
        node = child
    node[leaf] = value


def _settled(values: dict[str, Any]) -> dict[str, Any]:
    """A config's plain values, a mixture's parts settled (:func:`~.data.config.settled_parts`)."""
    return {**values, "data": settled_parts(values["data"])}


def _plain(value):
    """``value`` with tuples as lists and mappings as dicts, recursively (JSON round-trips it)."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value
