"""The commands' argument parser: flags spelled with dashes (``--run-dir``), the older
underscore spellings (``--run_dir``) accepted as aliases, and examples in every ``--help``."""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence

# --config of every command that reads a training config (train/config.py's load_config).
CONFIG_HELP = "a YAML file, or a shipped recipe's name (flaxformer-lite config --list)"


def add_trust_code(parser: argparse.ArgumentParser) -> None:
    """``--trust-code``, of every command that builds a model (``models.pieces``)."""
    parser.add_argument(
        "--trust-code",
        action="store_true",
        help="import the code that settings name by import path (model.mixer=my_variants:"
        "TalkingHeads, also in a run's config.yaml); importing runs it, so only code you trust",
    )


class CommandParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with a wrapped ``description`` and an ``examples`` block
    after the flags; ``--max_new_tokens`` reads as ``--max-new-tokens`` (also ``--x_y=v``)."""

    def __init__(self, *, description: str, examples: Sequence[str], **kwargs):
        block = "\n".join(f"  {example}" for example in examples)
        super().__init__(
            description=textwrap.fill(" ".join(description.split()), width=88),
            epilog=f"example{'s' if len(examples) > 1 else ''}:\n{block}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
            **kwargs,
        )

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([self._dashed(arg) for arg in args], namespace)

    def _dashed(self, arg: str) -> str:
        """``arg`` with a known flag's underscores made dashes; anything else unchanged."""
        if not arg.startswith("--"):
            return arg
        flag, sep, value = arg.partition("=")
        dashed = flag.replace("_", "-")
        if dashed != flag and dashed in self._option_string_actions:
            return dashed + sep + value
        return arg
