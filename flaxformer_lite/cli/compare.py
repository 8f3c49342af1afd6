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
        "final metrics, and a table of the settings in which their configs differ. Two sweeps "
        "(or two groups of sweeps, or one sweep's two groups): the second's mean over seeds "
        "minus the first's for each metric, its 95% confidence interval and p by a t-test "
        "(paired over the seeds both groups trained on, else Welch's), within or beyond noise "
        "at the 5% level; the training loss (one batch) gets no verdict.",
        examples=(
            "flaxformer-lite compare runs/a runs/b",
            "flaxformer-lite compare runs/a runs/b --metric loss eval_exact_match --out ab.png",
            "flaxformer-lite compare runs/sweep:lr=1e-3 runs/sweep:lr=3e-3",
        ),
    )
    parser.add_argument(
        "runs",
        nargs="+",
        type=pathlib.Path,
        metavar="RUN",
        help="run dirs, or two sweeps (DIR, or DIR:GROUP for one group of a sweep), or one "
        "sweep of two groups",
    )
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
    from flaxformer_lite.train import compare, sweep_summary

    sweeps = [sweep_summary.is_sweep(path) for path in args.runs]
    if sweeps == [True]:  # one sweep: its two groups
        groups = list(sweep_summary.sweep_groups(args.runs[0]))
        if len(groups) != 2:
            raise ValueError(
                f"{args.runs[0]} has {len(groups)} groups; compare compares one sweep's groups "
                "when it has two, else name two as DIR:GROUP"
            )
        return _compare_sweeps(*map(pathlib.Path, groups), args.metric)
    if any(sweeps):
        if not all(sweeps) or len(args.runs) != 2:
            raise ValueError("compare takes two sweeps (DIR or DIR:GROUP), or run directories")
        return _compare_sweeps(*args.runs, args.metric)

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


def _compare_sweeps(first: pathlib.Path, second: pathlib.Path, metrics) -> int:
    """Each pair of groups: the second's mean minus the first's, tested (Welch's t, or paired
    over the seeds both trained on)."""
    from flaxformer_lite.train import sweep_summary

    a, b = sweep_summary.sweep_groups(first), sweep_summary.sweep_groups(second)
    for label_a, label_b in sweep_summary.compare_groups(a, b):
        (group_a, members_a), (group_b, members_b) = a[label_a], b[label_b]
        shared = [m for m in sweep_summary.TABLE_METRICS if m in group_a and m in group_b]
        chosen = metrics or shared
        if not chosen:  # a group whose members all diverged has no results
            raise ValueError(
                f"{label_a} and {label_b} have no metric in common to compare (a group whose "
                "members all diverged, or stopped before logging, has none)"
            )
        missing = [m for m in chosen if m not in group_a or m not in group_b]
        if missing:
            raise ValueError(f"{label_a} and {label_b} do not both have {', '.join(missing)}")
        say(f"{label_b} - {label_a} (n = {group_b[chosen[0]]['n']} and {group_a[chosen[0]]['n']}):")
        for metric in chosen:
            diff = sweep_summary.difference(
                sweep_summary.metric_values(group_a, members_a, metric),
                sweep_summary.metric_values(group_b, members_b, metric),
            )
            say("  " + sweep_summary.difference_text(metric, diff))
    return 0
