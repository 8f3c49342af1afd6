"""``flaxformer-lite plot RUN_DIR``: the run's loss and learning rate, and a panel for every
metric it logged (a training metric with its ``eval_`` twin), as PNGs in ``RUN_DIR/plots``."""

from __future__ import annotations

import pathlib

from flaxformer_lite.cli.errors import guarded, say
from flaxformer_lite.cli.flags import CommandParser


def plot_main(argv: list[str] | None = None) -> int:
    """Writes the plots and prints their paths; a directory without logged metrics exits 2."""
    parser = CommandParser(
        prog="flaxformer-lite plot",
        description="Draw every metric a run logged (loss with eval_loss, learning rate, "
        "accuracy, the evaluations' scores, ...) against steps and tokens as PNGs in "
        "RUN_DIR/plots: loss.png, learning_rate.png and metrics.png (a panel each); print "
        "their paths. An evaluation logged once is a marked point. A sweep's directory: each "
        "group's mean curve over its seeds with a band of one standard deviation, in "
        "DIR/plots/sweep.png. Several runs side by side: compare.",
        examples=(
            "flaxformer-lite plot runs/default",
            "flaxformer-lite plot --run-dir runs/default",
            "flaxformer-lite plot runs/seeds",
        ),
    )
    parser.add_argument("run_dir", nargs="?", type=pathlib.Path, help="a train.py run directory")
    # The other commands name the run with --run-dir; either spelling works here.
    parser.add_argument(
        "--run-dir", dest="run_dir_flag", metavar="RUN_DIR", type=pathlib.Path, help="the same"
    )
    args = parser.parse_args(argv)
    if (args.run_dir is None) == (args.run_dir_flag is None):
        parser.error("name the run directory once: RUN_DIR or --run-dir RUN_DIR")
    run_dir = args.run_dir or args.run_dir_flag
    return guarded(lambda: _plot(run_dir))


def _plot(run_dir: pathlib.Path) -> int:
    from flaxformer_lite.train.metrics import plot_run
    from flaxformer_lite.train.run_dir import RunDir
    from flaxformer_lite.train.sweep_dir import SweepDir
    from flaxformer_lite.train.sweep_plot import plot_sweep, unlogged_members

    sweep = SweepDir(run_dir).is_sweep()
    if not sweep and run_dir.is_dir() and not RunDir(run_dir).is_run():  # plots/ is the user's
        raise ValueError(
            f"{run_dir} is neither a run directory (it has no {RunDir(run_dir).mark.name}, which "
            f"a run writes first) nor a sweep (no {SweepDir(run_dir).record.name}): plot draws "
            "into a run's or a sweep's plots/ only"
        )
    written = plot_sweep(run_dir) if sweep else plot_run(run_dir)
    waiting = unlogged_members(run_dir) if sweep else []
    if not written:
        where = f"no member of {run_dir}" if sweep else RunDir(run_dir).metrics
        raise ValueError(f"{where}: no metrics logged yet, nothing to plot")
    for path in written:
        say(f"wrote {path}")
    if waiting:
        say(f"left out, not logged yet: {', '.join(waiting)} (the same sweep command resumes)")
    return 0
