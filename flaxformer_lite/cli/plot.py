"""``flaxformer-lite plot RUN_DIR``: a run's loss and learning-rate curves as PNGs in
``RUN_DIR/plots``."""

from __future__ import annotations

import argparse
import pathlib

from flaxformer_lite.cli.errors import guarded, say


def plot_main(argv: list[str] | None = None) -> int:
    """Writes the plots and prints their paths; a directory without metrics exits 2."""
    parser = argparse.ArgumentParser(
        prog="flaxformer-lite plot", description="write the loss and learning-rate plots"
    )
    parser.add_argument("run_dir", type=pathlib.Path)
    run_dir = parser.parse_args(argv).run_dir
    return guarded(lambda: _plot(run_dir))


def _plot(run_dir: pathlib.Path) -> int:
    from flaxformer_lite.train.metrics import plot_run

    for path in plot_run(run_dir):
        say(f"wrote {path}")
    return 0
