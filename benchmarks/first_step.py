"""A second run of a config reaches its first step sooner: ``train.py`` run twice in fresh run
directories with one fresh ``XDG_CACHE_HOME`` (the compilation cache empty, then warm), each timed
from its process's start to its first step's results (the line ``compiled the train step``,
logged once they are read) and to its exit.

    python benchmarks/first_step.py
    python benchmarks/first_step.py --steps 3 --set model.num_decoder_layers=1

Prints a markdown table with the second run's times as a share of the first's (the target: its
first step in at most 40%), the closing lines' compilation, and the load average. ``--set``
adds ``key=value`` overrides to both runs.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
FIRST_STEP = "compiled the train step"
COMPILATION = re.compile(r"compilation ([\d.]+) s")
TARGET = 0.4  # the second run's first step as a share of the first's


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1, help="train.steps of each run")
    parser.add_argument("--set", nargs="*", default=[], metavar="key=value")
    return parser


def timed_run(overrides: list[str], environ: dict[str, str]) -> dict[str, float]:
    """Runs ``train.py --no-progress`` with ``overrides``; seconds from its start to its first
    step's results (``first_step``) and to its exit (``exit``), and its closing line's
    ``compilation``."""
    command = [sys.executable, str(REPO / "train.py"), "--no-progress", *overrides]
    started = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=environ, cwd=REPO)
    times = {}
    for line in child.stdout:
        if line.startswith(FIRST_STEP):
            times["first_step"] = time.perf_counter() - started
        elif line.startswith("done:"):
            times["compilation"] = float(COMPILATION.search(line)[1])
    if child.wait() != 0:
        raise RuntimeError(f"{' '.join(command)} exited {child.returncode}")
    missing = {"first_step": FIRST_STEP, "compilation": "done: ..."}.keys() - times.keys()
    if missing:
        raise RuntimeError(f"{' '.join(command)} printed no {sorted(missing)} line")
    return times | {"exit": time.perf_counter() - started}


def table(first: dict[str, float], second: dict[str, float], load: float) -> str:
    """The markdown table of the two runs, the second's times also as shares of the first's."""
    rows = [
        "| run | first step | exit | closing line: compilation |",
        "|---|---|---|---|",
        f"| first, the cache empty | {first['first_step']:.1f} s | {first['exit']:.1f} s "
        f"| {first['compilation']:.1f} s |",
        f"| second, the cache warm | {second['first_step']:.1f} s "
        f"({second['first_step'] / first['first_step']:.0%}) | {second['exit']:.1f} s "
        f"({second['exit'] / first['exit']:.0%}) | {second['compilation']:.1f} s |",
    ]
    share = second["first_step"] / first["first_step"]
    verdict = "PASS" if share <= TARGET else "FAIL"
    return "\n".join(rows) + (
        f"\n\n{verdict}: the second run's first step at {share:.0%} of the first's (target: at "
        f"most {TARGET:.0%}); load average (1 min) before the runs: {load:.1f}"
    )


def main(argv: list[str] | None = None) -> str:
    args = parser().parse_args(argv)
    if args.steps < 1:
        parser().error(f"--steps must be at least 1, got {args.steps}")
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="first-step-") as scratch:
        environ = os.environ | {"XDG_CACHE_HOME": str(pathlib.Path(scratch) / "cache")}
        # A cache directory of the user's own would be kept over the fresh one.
        environ.pop("JAX_COMPILATION_CACHE_DIR", None)
        runs = [
            timed_run(
                [f"train.steps={args.steps}", f"run_dir={scratch}/run{number}", *args.set], environ
            )
            for number in (1, 2)
        ]
    text = table(*runs, load)
    print(text)
    return text


if __name__ == "__main__":
    main()
