"""``flaxformer-lite config``: the resolved training config as YAML, every key with its type,
default and one line of help (the same as ``train.py --show-config``).

    flaxformer-lite config                                   # the embedded default
    flaxformer-lite config --config configs/gpt2_small.yaml train.steps=200 > my_run.yaml
"""

from __future__ import annotations

import pathlib

from flaxformer_lite.cli.errors import guarded
from flaxformer_lite.cli.flags import CommandParser
from flaxformer_lite.cli.train import show_config


def config_main(argv: list[str] | None = None) -> int:
    """``flaxformer-lite config``: print the resolved config and exit 0 (2 on a bad key)."""
    parser = CommandParser(
        prog="flaxformer-lite config",
        description="Print the training config that train.py would run, as YAML: every key "
        "with its type, default and meaning. The output is a valid --config file.",
        examples=(
            "flaxformer-lite config",
            "flaxformer-lite config --config configs/gpt2_small.yaml train.steps=200 > run.yaml",
        ),
    )
    parser.add_argument("--config", type=pathlib.Path, help="a YAML preset (see configs/)")
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.steps=200"
    )
    args = parser.parse_args(argv)
    return guarded(lambda: show_config(args.config, args.overrides))
