"""``flaxformer-lite compare RUN [RUN ...]``: runs side by side (:mod:`flaxformer_lite.train.
compare`): their curves in one PNG, and tables of their final metrics and differing settings.

    flaxformer-lite compare runs/lr3e-3 runs/lr1e-3 --metric loss --metric eval_exact_match
"""

from __future__ import annotations

import pathlib

from flaxformer_lite.cli.errors import guarded, say
from flaxformer_lite.cli.flags import CommandParser

DEFAULT_OUT = pathlib.Path("compare.png")


def compare_main(argv: list[str] | None = None) -> int:
    """Writes the figure, prints the two tables; a directory that is not a run exits 2."""
    args = compare_parser().parse_intermixed_args(argv)
    return guarded(lambda: _compare(args))


def compare_parser() -> CommandParser:
    """The ``compare`` command's arguments."""
    parser = CommandParser(
        prog="flaxformer-lite compare",
        description="Put several runs side by side, as after an ablation: their curves of "
        "each metric on one figure (against steps and against tokens), a table of their "
        "final metrics, and a table of the settings in which their configs differ.",
        examples=(
            "flaxformer-lite compare runs/a runs/b",
            "flaxformer-lite compare runs/a runs/b --metric loss eval_exact_match --out ab.png",
        ),
    )
    parser.add_argument("runs", nargs="+", type=pathlib.Path, metavar="RUN", help="run dirs")
    parser.add_argument(
        "--metric",
        action="extend",
        nargs="+",
        metavar="NAME",
        help="metrics to plot (repeatable; default: loss eval_loss)",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        help=f"the figure (default: {DEFAULT_OUT}, if there is none in the current directory)",
    )
    return parser


def _compare(args) -> int:
    from flaxformer_lite.train import compare

    out = args.out or DEFAULT_OUT
    if args.out is None and out.exists():  # a file named only by default is not replaced
        raise FileExistsError(f"{out} exists; pass --out {out} to replace it, or another file")

    runs = compare.load_runs(args.runs)
    metrics = args.metric or [
        m for m in compare.DEFAULT_METRICS if m in compare.logged_metrics(runs)
    ]
    compare.check_metrics(runs, metrics)
    say(compare.final_metrics_table(runs))
    say("")
    say(compare.settings_table(runs))
    say(f"wrote {compare.plot_comparison(runs, metrics, out)}")
    return 0
