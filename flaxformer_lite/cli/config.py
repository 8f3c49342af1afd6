"""``flaxformer-lite config``: the resolved training config as YAML, every key with its type,
default and one line of help (the same as ``train.py --show-config``); ``--list``: the recipes
the package ships, each with its one line.

    flaxformer-lite config                                   # the embedded default
    flaxformer-lite config --config gpt2_small train.steps=200 > my_run.yaml
    flaxformer-lite config --list
"""

from __future__ import annotations

import argparse
import pathlib

from flaxformer_lite.cli.errors import guarded, say
from flaxformer_lite.cli.flags import CONFIG_HELP, CommandParser
from flaxformer_lite.cli.train import show_config
from flaxformer_lite.train.recipes import recipes, summary


def config_main(argv: list[str] | None = None) -> int:
    """``flaxformer-lite config``: print the resolved config and exit 0 (2 on a bad key)."""
    parser = config_parser()
    args = parser.parse_args(argv)
    if args.list:
        if args.config or args.overrides:
            parser.error("--list takes neither --config nor overrides")
        return guarded(list_recipes)
    return guarded(lambda: show_config(args.config, args.overrides))


def config_parser() -> argparse.ArgumentParser:
    """The ``config`` command's flags and its ``key=value`` overrides."""
    parser = CommandParser(
        prog="flaxformer-lite config",
        description="Print the training config that train.py would run, as YAML: every key "
        "with its type, default and meaning. The output is a valid --config file.",
        examples=(
            "flaxformer-lite config",
            "flaxformer-lite config --config gpt2_small train.steps=200 > run.yaml",
            "flaxformer-lite config --list",
        ),
    )
    parser.add_argument("--config", type=pathlib.Path, help=CONFIG_HELP)
    parser.add_argument(
        "--list", action="store_true", help="list the shipped recipes (--config NAME) and exit"
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.steps=200"
    )
    return parser


def list_recipes() -> int:
    """Prints each shipped recipe's name and one line; returns 0."""
    found = recipes()
    width = max(map(len, found))
    for name, path in found.items():
        say(f"{name:<{width}}  {summary(path)}")
    return 0
