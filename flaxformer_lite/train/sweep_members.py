"""A sweep's members: the product of the varied settings, each a run's config with a readable
name, and the groups of members that can train as one compiled program.

    members = sweep_members(cfg, {"seed": [0, 1, 2], "optimizer.lr": ["1e-3", "3e-3"]})
    # six members, "lr=1e-3,seed=0" ... in cfg.run_dir/<name>

Which members share a program is read from the program itself (:func:`.sweep.program_key`:
the traced step, whose arguments carry the numbers): members that differ only in the numbers the
step takes as arguments (:data:`~.step_numbers.PER_MEMBER`: the seed, the learning-rate schedule,
the optimizer's numbers, label smoothing, z-loss, the embedding and residual dropout rates) are
traced once (:func:`~.step_numbers.numbers_aside`); others are traced each, and share a program
when their steps are the same (an initialization scale, a data file) and not when they differ
(width, depth, norms, dropout on or off, attention dropout's rate, the attention variant).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from flaxformer_lite.train.config import (
    ConfigError,
    TrainConfig,
    config_from_dict,
    flatten,
    set_dotted,
    valid_keys,
)
from flaxformer_lite.train.schema import OverrideText


@dataclasses.dataclass(frozen=True)
class Member:
    """One run of a sweep.

    Attributes:
      name: the directory under the sweep's, from the varied values (``lr=1e-3,seed=0``).
      settings: the varied keys and this member's values, as given.
      cfg: the member's config; ``cfg.run_dir`` is ``<sweep run_dir>/<name>``.
    """

    name: str
    settings: dict[str, Any]
    cfg: TrainConfig


def parse_vary(texts: Sequence[str]) -> dict[str, list]:
    """``["seed=0,1,2", "optimizer.lr=1e-3,3e-3"]`` -> ``{"seed": ["0", "1", "2"], ...}``; values
    that hold commas as a YAML list: ``data.path=["a,b.txt", c.txt]``.

    Raises:
      ConfigError: a text that is not ``KEY=V1,V2,...`` or ``KEY=[V1, V2, ...]``, or a key
        given twice.
    """
    vary: dict[str, list] = {}
    for text in texts:
        key, sep, values = text.partition("=")
        key, values = key.strip(), values.strip()
        if values.startswith("["):
            listed = _yaml_list(text, values)
        else:
            listed = [value.strip() for value in values.split(",")]
        if not sep or not key or not listed or not all(v not in ("", None) for v in listed):
            raise ConfigError(
                f"--vary takes KEY=V1,V2,... (or KEY=[V1, V2, ...] for values with commas), "
                f"got {text!r}"
            )
        if key in vary:
            raise ConfigError(f"--vary {key} is given twice: give its values once, V1,V2,...")
        vary[key] = listed
    return vary


def _yaml_list(text: str, values: str) -> list:
    """The YAML flow list ``values`` of ``--vary text``.

    Raises:
      ConfigError: not a YAML list."""
    try:
        listed = yaml.safe_load(values)
    except yaml.YAMLError:
        listed = None
    if not isinstance(listed, list):
        raise ConfigError(f'--vary {text!r}: [...] must be a YAML list, e.g. [a, "b,c"]')
    return listed


def sweep_members(cfg: TrainConfig, vary: Mapping[str, Sequence[Any]]) -> list[Member]:
    """The members of the sweep of ``cfg`` over the product of ``vary``'s values (strings as
    on the command line, or Python values), in ``cfg.run_dir/<name>``.

    Raises:
      ConfigError: nothing varied, a key that is not a setting (with the closest one), a value
        of the wrong type, ``run_dir`` varied, or two members with one name or one config.
    """
    if not vary or not all(vary.values()):
        raise ConfigError("a sweep varies at least one setting: --vary KEY=V1,V2,...")
    leaves = set(flatten(cfg.to_dict()))
    for key in vary:
        if key == "run_dir":
            raise ConfigError("run_dir is the sweep's: each member runs in <run_dir>/<member>")
        if key not in valid_keys() and key not in leaves:  # a mixture's source is a leaf
            config_from_dict(_nested(key, 0))  # raises, naming the closest key
        if key not in leaves:
            raise ConfigError(f"--vary {key}: not a setting a sweep can vary; vary its keys")
    labels = _labels(list(vary))
    members, names, configs = [], {}, {}
    for values in itertools.product(*vary.values()):
        settings = dict(zip(vary, values, strict=True))
        name = _fitted(
            ",".join(f"{labels[key]}={_path_text(value)}" for key, value in settings.items())
        )
        member_cfg = member_config(cfg, settings, pathlib.Path(cfg.run_dir) / name)
        if name in names:
            raise ConfigError(f"two members are named {name!r}: {names[name]} and {settings}")
        key = repr(dataclasses.replace(member_cfg, run_dir=""))
        if key in configs:
            raise ConfigError(f"members {configs[key]!r} and {name!r} have the same config")
        names[name], configs[key] = settings, name
        members.append(Member(name, settings, member_cfg))
    return members


def member_config(cfg: TrainConfig, settings: Mapping[str, Any], run_dir) -> TrainConfig:
    """``cfg`` with ``settings`` (dotted keys; strings read as overrides are) and ``run_dir``.

    Raises:
      ConfigError: a value of the wrong type, naming its key.
    """
    values = cfg.to_dict()
    for key, value in settings.items():
        set_dotted(values, key, OverrideText(value) if isinstance(value, str) else value)
    values["run_dir"] = str(run_dir)
    try:
        return config_from_dict(values)
    except (ConfigError, ValueError) as error:
        raise ConfigError(f"--vary {', '.join(settings)}: {error}") from None


def split_settings(members: Sequence[Member], groups: Sequence[Sequence[Member]]) -> list[str]:
    """The varied keys whose values tell the groups apart: equal within every group, not
    across them."""
    if len(groups) < 2:
        return []
    return [
        key
        for key in members[0].settings
        if all(len({repr(m.settings[key]) for m in group}) == 1 for group in groups)
        and len({repr(group[0].settings[key]) for group in groups}) > 1
    ]


def group_of(member: Member) -> str:
    """The name of ``member``'s seed group: its varied values but the seed (``all`` when the
    seed is all it varies); the members of a group differ only in their seed."""
    labels = _labels(list(member.settings))
    parts = [
        f"{labels[key]}={_path_text(value)}"
        for key, value in member.settings.items()
        if key != "seed"
    ]
    return ",".join(parts) or "all"


def _labels(keys: list[str]) -> dict[str, str]:
    """Each dotted key's shortest suffix that no other key ends with (``lr``, ``model.dropout``)."""
    labels = {}
    for key in keys:
        parts = key.split(".")
        for size in range(1, len(parts) + 1):
            label = ".".join(parts[-size:])
            if not any(other != key and other.endswith("." + label) for other in keys) and not any(
                other == label for other in keys if other != key
            ):
                break
        labels[key] = label
    return labels


# A member's directory name, in bytes: file systems take 255, and a group's name beside it too.
NAME_BYTES = 200


def _fitted(name: str) -> str:
    """``name``, or where it is longer than :data:`NAME_BYTES`, its start and a hash of the
    whole (``sweep.json`` keeps each member's settings)."""
    encoded = name.encode()
    if len(encoded) <= NAME_BYTES:
        return name
    digest = hashlib.sha256(encoded).hexdigest()[:12]
    return encoded[: NAME_BYTES - 13].decode(errors="ignore") + "~" + digest


def _path_text(value: Any) -> str:
    """``value`` as a directory name's piece: as written, no slashes, spaces or colons (an import
    path's ``module:attr`` reads ``module.attr``: a colon is no file name's on every system);
    a small Python float as the command line writes it (``1e-3``, not ``0.001``)."""
    if isinstance(value, float) and value and abs(value) < 1e-2:
        mantissa, exponent = f"{value:.14e}".split("e")
        value = f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return re.sub(r"[/\s\\]+", "_", str(value)).replace(":", ".") or "_"


def _nested(key: str, value: Any) -> dict:
    nested: dict = {}
    set_dotted(nested, key, value)
    return nested
