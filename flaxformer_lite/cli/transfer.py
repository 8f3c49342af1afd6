"""``flaxformer-lite transfer SWEEP``: a sweep's metric against the learning rate (or another
varied setting), a curve per width, each point mean ± std over seeds; the best rate of each width
(:mod:`flaxformer_lite.train.transfer`).

    flaxformer-lite transfer runs/mup
"""

from __future__ import annotations

import pathlib

from flaxformer_lite.cli.errors import guarded, say
from flaxformer_lite.cli.flags import CommandParser


def transfer_main(argv: list[str] | None = None) -> int:
    """Writes SWEEP/plots/transfer.png and prints the best value per curve; a directory that
    is not a sweep, or one that does not vary the settings, exits 2."""
    args = transfer_parser().parse_args(argv)
    return guarded(lambda: _transfer(args))


def transfer_parser() -> CommandParser:
    """The ``transfer`` command's arguments."""
    parser = CommandParser(
        prog="flaxformer-lite transfer",
        description="Check that a hyperparameter transfers across widths (muP): from a sweep "
        "over learning rates x widths x seeds, draw the metric against the learning rate, one "
        "curve per width with error bars of one standard deviation over the seeds, in "
        "SWEEP/plots/transfer.png (of the first SWEEP), and print each width's best learning "
        "rate.",
        examples=(
            "flaxformer-lite transfer runs/mup",
            "flaxformer-lite transfer runs/mup runs/mup_wide --metric best_eval_loss",
            "flaxformer-lite transfer runs/wd --x optimizer.weight_decay --curves model.d_model",
        ),
    )
    parser.add_argument(
        "sweeps",
        nargs="+",
        type=pathlib.Path,
        metavar="SWEEP",
        help="a sweep's directory, or several (say one per width); the figure goes in the first",
    )
    parser.add_argument("--x", default="optimizer.lr", help="the setting along the x axis")
    parser.add_argument("--curves", default="model.d_model", help="the setting of each curve")
    parser.add_argument("--metric", default="eval_loss", help="the metric (lower is better)")
    return parser


def _transfer(args) -> int:
    from flaxformer_lite.train.transfer import best_table, plot_transfer, transfer_table

    names = dict(x=args.x, curves=args.curves, metric=args.metric)
    table = transfer_table(args.sweeps, **names)
    say(best_table(table, **names))
    say(f"wrote {plot_transfer(args.sweeps[0], table, **names)}")
    return 0
