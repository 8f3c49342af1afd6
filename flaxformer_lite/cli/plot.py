"""``flaxformer-lite plot RUN_DIR``: a run's loss and learning-rate curves as PNGs in
``RUN_DIR/plots``."""

from __future__ import annotations

import pathlib

from flaxformer_lite.cli.errors import guarded, say
from flaxformer_lite.cli.flags import CommandParser


def plot_main(argv: list[str] | None = None) -> int:
    """Writes the plots and prints their paths; a directory without logged metrics exits 2."""
    parser = CommandParser(
        prog="flaxformer-lite plot",
        description="Draw a run's logged curves (loss, learning rate, evaluations) as PNGs in "
        "RUN_DIR/plots and print their paths. To put several runs side by side: compare.",
        examples=("flaxformer-lite plot runs/default",),
    )
    parser.add_argument("run_dir", type=pathlib.Path, help="a train.py run directory")
    run_dir = parser.parse_args(argv).run_dir
    return guarded(lambda: _plot(run_dir))


def _plot(run_dir: pathlib.Path) -> int:
    from flaxformer_lite.train.metrics import plot_run
    from flaxformer_lite.train.run_dir import RunDir

    written = plot_run(run_dir)
    if not written:
        raise ValueError(f"{RunDir(run_dir).metrics}: no metrics logged yet, nothing to plot")
    for path in written:
        say(f"wrote {path}")
    return 0
