"""``python train.py``, ``flaxformer-lite train`` and ``python -m flaxformer_lite.train``: train
(or resume) the configured run.

    python train.py                                   # the embedded default
    python train.py --config gpt2_small train.steps=200 optimizer.lr=3e-4

A user error exits 2 (:mod:`flaxformer_lite.cli.errors`); a run stopped by a non-finite step
exits 1; SIGTERM/SIGINT save a checkpoint and exit 128 + signal. The closing line gives the last
metrics and where the command's time went (:mod:`flaxformer_lite.train.time_spent`).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

from flaxformer_lite.cli.errors import exit_on_signals, guarded, notice, say
from flaxformer_lite.cli.flags import CONFIG_HELP, CommandParser, add_trust_code
from flaxformer_lite.cli.library_log import library_log_to
from flaxformer_lite.train.run_dir import RunDir

DESCRIPTION = """Train a model as the config says, in its run directory: with no flags, the
embedded default (a small GPT-2-style decoder learning multi-digit arithmetic on a CPU). Running
the same command again resumes from the newest checkpoint. --show-config lists every setting."""
EXAMPLES = (
    "python train.py",
    "python train.py --config transformer_tiny train.steps=600 optimizer.lr=1e-3",
    "python train.py --show-config train.steps=200",
)


def train_main(argv: list[str] | None = None) -> int:
    """``train.py``: train (or resume) the configured run."""
    started = time.perf_counter()  # the closing line's wall time counts the imports
    parser = CommandParser(prog="train.py", description=DESCRIPTION, examples=EXAMPLES)
    add_train_arguments(parser)
    args = parser.parse_intermixed_args(argv)
    with exit_on_signals():  # importing JAX takes seconds too
        return _train(args, started)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """``train.py``'s flags and its ``key=value`` overrides."""
    parser.add_argument("--config", type=pathlib.Path, help=CONFIG_HELP)
    parser.add_argument(
        "--fresh", action="store_true", help="move an existing run directory aside and start over"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="resume even if the model/optimizer/data config changed",
    )
    parser.add_argument(
        "--stretch-schedule",
        action="store_true",
        help="the learning-rate schedule spans all of train.steps, also when a resumed run's "
        "steps were raised (by default it keeps the span it was trained with)",
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="a plain line per logged step instead of a progress bar (the default when the "
        "output is not a terminal)",
    )
    parser.add_argument(
        "--show-config",
        action="store_true",
        help="print the resolved config as YAML (every key: type, default, help) and exit",
    )
    add_trust_code(parser)
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.steps=200"
    )


def _train(args, started: float) -> int:
    if args.show_config:
        return guarded(lambda: show_config(args.config, args.overrides))
    from flaxformer_lite.process import reuse_freed_host_memory, use_compilation_cache

    reuse_freed_host_memory()  # before JAX starts its backend's threads
    import jax

    from flaxformer_lite.train.config import load_config
    from flaxformer_lite.train.loop import Interrupted, TrainingError, run
    from flaxformer_lite.train.resume import stretch_schedule
    from flaxformer_lite.train.time_spent import TimeSpent

    def train():
        cfg = load_config(args.config, args.overrides, notify=notice)
        if args.stretch_schedule:
            cfg = stretch_schedule(cfg)
        use_compilation_cache(cfg.train.compilation_cache)
        library_log_to(RunDir(cfg.run_dir).library_log)
        spent = TimeSpent(started)
        # A bar only on a terminal: written to a file or a pipe it is one line of carriage returns.
        bar = not args.no_progress and sys.stdout.isatty() and sys.stderr.isatty()
        last = run(cfg, fresh=args.fresh, force=args.force, progress=bar, log=say, spent=spent)
        summary = ", ".join(
            f"{k} {v:,}" if isinstance(v, int) else f"{k} {v:.4g}"
            for k, v in last.items()
            if v is not None
        )
        if jax.process_index() == 0:  # a multi-process run reports once
            say(f"done: {cfg.run_dir} ({summary}); {spent.summary()}")
        return 0

    try:
        return guarded(train, trust_code=args.trust_code)
    except TrainingError as error:
        say(f"error: {error}", stream=sys.stderr)
        return 1
    except Interrupted as error:
        say(str(error), stream=sys.stderr)
        return 128 + error.signum


def show_config(path: pathlib.Path | None, overrides: list[str]) -> int:
    """Prints the config of ``path`` and ``overrides`` as commented YAML; returns 0."""
    from flaxformer_lite.train.config import load_config
    from flaxformer_lite.train.config_help import annotated_yaml

    say(annotated_yaml(load_config(path, overrides, notify=notice)).rstrip("\n"))
    return 0
