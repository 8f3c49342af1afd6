"""The user commands: ``python train.py``, ``python sample.py``, ``python -m
flaxformer_lite.train`` and ``flaxformer-lite
train|sweep|ablation|config|prepare|plot|compare|generate|evaluate|export|attention|compile|coords|
transfer``,
one module each.

    python train.py                                   # the embedded default
    python train.py --config gpt2_small train.steps=200 optimizer.lr=3e-4
    flaxformer-lite sweep --vary seed=0,1,2 --vary optimizer.lr=1e-3,3e-3 run_dir=runs/lr
    flaxformer-lite ablation --steps 400              # the shipped ablations/*, 3 seeds each
    flaxformer-lite config train.steps=200            # every setting, as YAML
    flaxformer-lite prepare --out stores/lines data.source=text data.path=lines.txt
    flaxformer-lite plot runs/default
    flaxformer-lite compare runs/a runs/b --metric loss eval_exact_match
    flaxformer-lite generate --run-dir runs/default --prompt "012+034="
    flaxformer-lite evaluate --run-dir runs/shakespeare evals.tasks.hellaswag.path=hs.jsonl
    flaxformer-lite export --run-dir runs/default --out exports/default
    flaxformer-lite attention --run-dir runs/default --text "012+034=" --out maps
    flaxformer-lite compile --config gpt2_small --topology v5e-8
    flaxformer-lite coords --config shakespeare_char --out coords/sp optimizer.lr=1e-2
    flaxformer-lite transfer runs/mup

Errors the user can fix (config, data, files) print one line and exit with status 2; a run
stopped by a non-finite step exits 1; SIGTERM/SIGINT save a checkpoint and exit 128 + signal.
"""

from __future__ import annotations

import importlib
import sys

from flaxformer_lite.cli.flags import CommandParser

# name: what it does; each command's --help has its flags and examples. Command NAME is
# ``NAME_main`` of ``flaxformer_lite.cli.NAME``, imported when it runs: the listing and each
# command's --help import nothing another command needs (JAX, Flax, Orbax, matplotlib).
COMMANDS = {
    "train": "train or resume a run (as python train.py)",
    "sweep": "train several runs (seeds, settings) as one program; mean ± std",
    "ablation": "sweep configs over seeds and set them side by side, mean ± std",
    "config": "print the resolved config as YAML, every key explained",
    "prepare": "tokenize a source of files once into a store",
    "plot": "draw every metric a run logged (loss, evals, ...) as PNGs",
    "compare": "put runs side by side: curves, final metrics, config diff",
    "generate": "continue or translate prompts with a run (as sample.py)",
    "evaluate": "score a run or a Hugging Face model on downstream tasks (HellaSwag, LAMBADA, ...)",
    "export": "write a run as a Hugging Face directory (model and tokenizer)",
    "attention": "plot a run's attention weights on a text",
    "compile": "compile a config's step for a TPU slice: memory, collectives, MFU",
    "coords": "muP's coordinate check: activation scales against width, as a PNG",
    "transfer": "a sweep's loss against the learning rate, a curve per width, and the best rate "
    "per width",
}


def entry_point(name: str):
    """Command ``name``'s ``main(argv) -> exit status``, its module imported now."""
    return getattr(importlib.import_module(f"flaxformer_lite.cli.{name}"), f"{name}_main")


def main(argv: list[str] | None = None) -> int:
    """``flaxformer-lite COMMAND ...``: runs one of :data:`COMMANDS`."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in COMMANDS:
        return entry_point(argv[0])(argv[1:])
    width = max(map(len, COMMANDS))
    listing = "\n".join(f"  {name:<{width}}  {what}" for name, what in COMMANDS.items())
    parser = CommandParser(
        prog="flaxformer-lite",
        description="Train, inspect and sample flaxformer_lite models. "
        "'flaxformer-lite COMMAND --help' explains a command.",
        examples=(
            "flaxformer-lite train train.steps=200",
            "flaxformer-lite config --list",
            'flaxformer-lite generate --run-dir runs/default --prompt "012+034="',
        ),
    )
    parser.epilog = f"commands:\n{listing}\n\n{parser.epilog}"
    parser.add_argument("command", choices=tuple(COMMANDS), metavar="COMMAND", help="see below")
    parser.parse_args(argv[:1])  # --help prints the listing; anything else, the usage (exit 2)
    return 2
