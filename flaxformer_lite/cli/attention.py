"""``flaxformer-lite attention``: a trained run's attention weights on a text, one PNG per layer
(:mod:`flaxformer_lite.attention_maps` draws them).

    flaxformer-lite attention --run-dir runs/default --text "012+034=" --out maps
"""

from __future__ import annotations

import argparse
import pathlib

from flaxformer_lite.cli.errors import guarded, say
from flaxformer_lite.cli.flags import CommandParser, add_trust_code
from flaxformer_lite.cli.library_log import library_log_to


def attention_parser() -> argparse.ArgumentParser:
    """The ``attention`` command's flags."""
    parser = CommandParser(
        prog="flaxformer-lite attention",
        description="Plot a trained run's attention weights on a text, one PNG per layer "
        "(a grid of heads; queries on rows, keys on columns).",
        examples=('flaxformer-lite attention --run-dir runs/default --text "012+034=" --out maps',),
    )
    parser.add_argument("--run-dir", type=pathlib.Path, required=True, help="a trained run")
    parser.add_argument("--text", required=True, help="the input (an encoder-decoder's source)")
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        help="a new or empty folder for the PNGs (default: RUN_DIR/plots/attention)",
    )
    parser.add_argument(
        "--target",
        help="an encoder-decoder's target text: adds the decoder's self- and cross-attention",
    )
    parser.add_argument("--step", type=int, help="the checkpoint (default: the newest)")
    add_trust_code(parser)
    return parser


def attention_main(argv: list[str] | None = None) -> int:
    """Writes the PNGs and prints their paths."""
    args = attention_parser().parse_args(argv)
    library_log_to(None)  # a read of the run: the one-line errors say what went wrong
    return guarded(lambda: _attention(args), trust_code=args.trust_code)


def _attention(args) -> int:
    from flaxformer_lite.attention_maps import write_text_attention_maps
    from flaxformer_lite.choices import AFT_MIXERS
    from flaxformer_lite.train.run_dir import RunDir
    from flaxformer_lite.train.trained_run import load_run

    run = load_run(args.run_dir, step=args.step)
    model_cfg = run.config.model
    # An AFT mixer has no attention weights: only an encoder-decoder's cross-attention has maps.
    seq2seq = model_cfg.kind.is_seq2seq
    if model_cfg.mixer in AFT_MIXERS and (not seq2seq or args.target is None):
        raise ValueError(
            f"{args.run_dir}: the self-attention mixer is {model_cfg.mixer}, which has no "
            "attention weights" + ("; --target plots the cross-attention" if seq2seq else "")
        )
    if args.out is None:  # the run's own plots/: written only if no link leads out of it
        RunDir(args.run_dir).refuse_links()
    elif args.out.is_symlink() or (
        args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir()))
    ):  # as export and prepare: the user's files are never written over
        raise ValueError(
            f"--out {args.out} is not a new or empty folder: choose another (the maps are one "
            "PNG per layer, written into it)"
        )
    out = args.out if args.out is not None else RunDir(args.run_dir).plots / "attention"
    paths = write_text_attention_maps(
        run.model, run.tokenizer, args.text, out, target=args.target, note=f"step {run.step}"
    )
    for path in paths:
        say(f"wrote {path}")
    return 0
