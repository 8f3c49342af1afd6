"""The command line: ``python train.py``, ``flaxformer-lite train|plot|generate|attention``,
``python sample.py`` and ``python -m flaxformer_lite.train``.

    python train.py                                   # the embedded default
    python train.py --config configs/gpt2_small.yaml train.steps=200 optimizer.lr=3e-4
    flaxformer-lite plot runs/default
    flaxformer-lite generate --run_dir runs/default --prompt "12+34="
    flaxformer-lite attention --run_dir runs/default --text "12+34=" --out maps

Errors the user can fix (config, data, files) print one line and exit with status 2; a run
stopped by a non-finite step exits 1; SIGTERM/SIGINT save a checkpoint and exit 128 + signal.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from flaxformer_lite.train.config import ConfigError, load_config

USER_ERRORS = (ConfigError, ValueError, FileNotFoundError, NotADirectoryError)


def train_main(argv: list[str] | None = None) -> int:
    """``train.py``: train (or resume) the configured run."""
    parser = argparse.ArgumentParser(
        prog="train.py", description="Train a flaxformer_lite model; re-running resumes."
    )
    _add_train_arguments(parser)
    return _train(parser.parse_intermixed_args(argv))


def main(argv: list[str] | None = None) -> int:
    """``flaxformer-lite``: the ``train`` (as ``train.py``), ``plot``, ``generate`` (as
    ``sample.py``) and ``attention`` subcommands."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="flaxformer-lite")
    parser.add_argument("command", choices=("train", "plot", "generate", "attention"))
    if argv[:1] == ["train"]:
        return train_main(argv[1:])
    if argv[:1] == ["plot"]:
        plot = argparse.ArgumentParser(
            prog="flaxformer-lite plot", description="write the loss and learning-rate plots"
        )
        plot.add_argument("run_dir", type=pathlib.Path)
        run_dir = plot.parse_args(argv[1:]).run_dir
        return _guarded(lambda: _plot(run_dir))
    if argv[:1] == ["generate"]:
        return generate_main(argv[1:])
    if argv[:1] == ["attention"]:
        args = _attention_parser().parse_args(argv[1:])
        return _guarded(lambda: _attention(args))
    parser.parse_args(argv[:1])  # prints the usage (and exits 2) for anything else
    return 2


def generate_main(argv: list[str] | None = None, prog: str = "flaxformer-lite generate") -> int:
    """``flaxformer-lite generate`` / ``sample.py``: continue or translate prompts with a run or a
    Hugging Face checkpoint directory."""
    from flaxformer_lite.cli import generate

    args = generate.parser(prog).parse_args(argv)
    return _guarded(lambda: generate.run(args, say=_say))


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=pathlib.Path, help="a YAML preset (see configs/)")
    parser.add_argument(
        "--fresh", action="store_true", help="move an existing run directory aside and start over"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="resume even if the model/optimizer/data config changed",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.steps=200"
    )


def _train(args) -> int:
    from flaxformer_lite.train.host_memory import reuse_freed_host_memory

    reuse_freed_host_memory()  # before JAX starts its backend's threads
    import jax

    from flaxformer_lite.train.loop import Interrupted, TrainingError, run

    def train():
        cfg = load_config(args.config, args.overrides)
        last = run(cfg, fresh=args.fresh, force=args.force, progress=not args.no_progress, log=_say)
        summary = ", ".join(f"{k} {v:.4g}" for k, v in last.items() if v is not None)
        if jax.process_index() == 0:  # a multi-process run reports once
            _say(f"done: {cfg.run_dir} ({summary})")
        return 0

    try:
        return _guarded(train)
    except TrainingError as error:
        _say(f"error: {error}", stream=sys.stderr)
        return 1
    except Interrupted as error:
        _say(str(error), stream=sys.stderr)
        return 128 + error.signum


def _plot(run_dir: pathlib.Path) -> int:
    from flaxformer_lite.train.metrics import plot_run

    for path in plot_run(run_dir):
        _say(f"wrote {path}")
    return 0


def _attention_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flaxformer-lite attention",
        description="plot a trained run's attention weights on a text, one PNG per layer "
        "(a grid of heads; queries on rows, keys on columns)",
    )
    parser.add_argument("--run_dir", type=pathlib.Path, required=True, help="a trained run")
    parser.add_argument("--text", required=True, help="the input (an encoder-decoder's source)")
    parser.add_argument(
        "--out", type=pathlib.Path, help="where the PNGs go (default: RUN_DIR/plots/attention)"
    )
    parser.add_argument(
        "--target",
        help="an encoder-decoder's target text: adds the decoder's self- and cross-attention",
    )
    parser.add_argument("--step", type=int, help="the checkpoint (default: the newest)")
    return parser


def _attention(args) -> int:
    from flaxformer_lite.attention_maps import write_text_attention_maps
    from flaxformer_lite.train.restore import load_run

    run = load_run(args.run_dir, step=args.step)
    out = args.out if args.out is not None else args.run_dir / "plots" / "attention"
    paths = write_text_attention_maps(
        run.model, run.tokenizer, args.text, out, target=args.target, note=f"step {run.step}"
    )
    for path in paths:
        _say(f"wrote {path}")
    return 0


def _guarded(fn) -> int:
    try:
        return fn()
    except USER_ERRORS as error:
        _say(f"error: {error}", stream=sys.stderr)
        return 2


def _say(message: str, stream=None) -> None:
    print(message, file=stream or sys.stdout, flush=True)
