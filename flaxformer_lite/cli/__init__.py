"""The user commands: ``python train.py``, ``python sample.py``, ``python -m
flaxformer_lite.train`` and ``flaxformer-lite train|prepare|plot|generate|attention|compile``, one
module each.

    python train.py                                   # the embedded default
    python train.py --config configs/gpt2_small.yaml train.steps=200 optimizer.lr=3e-4
    flaxformer-lite prepare --out stores/lines data.source=text data.path=lines.txt
    flaxformer-lite plot runs/default
    flaxformer-lite generate --run_dir runs/default --prompt "12+34="
    flaxformer-lite attention --run_dir runs/default --text "12+34=" --out maps
    flaxformer-lite compile --config configs/gpt2_small.yaml --topology v5e-8

Errors the user can fix (config, data, files) print one line and exit with status 2; a run
stopped by a non-finite step exits 1; SIGTERM/SIGINT save a checkpoint and exit 128 + signal.
"""

from __future__ import annotations

import argparse
import sys

from flaxformer_lite.cli.attention import attention_main
from flaxformer_lite.cli.compile import compile_main
from flaxformer_lite.cli.generate import generate_main
from flaxformer_lite.cli.plot import plot_main
from flaxformer_lite.cli.prepare import prepare_main
from flaxformer_lite.cli.train import train_main


def main(argv: list[str] | None = None) -> int:
    """``flaxformer-lite``: the ``train`` (as ``train.py``), ``prepare``, ``plot``, ``generate``
    (as ``sample.py``), ``attention`` and ``compile`` subcommands."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="flaxformer-lite")
    commands = ("train", "prepare", "plot", "generate", "attention", "compile")
    parser.add_argument("command", choices=commands)
    if argv[:1] == ["train"]:
        return train_main(argv[1:])
    if argv[:1] == ["prepare"]:
        return prepare_main(argv[1:])
    if argv[:1] == ["plot"]:
        return plot_main(argv[1:])
    if argv[:1] == ["generate"]:
        return generate_main(argv[1:])
    if argv[:1] == ["attention"]:
        return attention_main(argv[1:])
    if argv[:1] == ["compile"]:
        return compile_main(argv[1:])
    parser.parse_args(argv[:1])  # prints the usage (and exits 2) for anything else
    return 2
