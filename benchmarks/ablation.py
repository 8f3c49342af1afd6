"""The ablation of issue 28 with error bars (issue 42): each config of ``configs/ablations/``
trained with several seeds on the embedded task, set side by side as mean ± std over its seeds.

    python benchmarks/ablation.py                              # every config, as README says
    python benchmarks/ablation.py --steps 1000 --configs configs/ablations/aft_*.yaml

Each config is one ``flaxformer-lite sweep --config CONFIG --vary seed=0,...,N-1`` subprocess
(``--seeds`` N, 3), its members stepped together by one compiled program, in
``--runs``/<config name>/seed=<n> (started afresh: ``--fresh``); the configs train one after
another, so that they do not share the cores. The configs differ from ``configs/default.yaml``
only in the self-attention (``model.mixer``, ``model.local_window``, ``model.global_tokens``);
``--steps`` shortens all of them alike. Printed: a table of each config's final ``eval_loss``
and ``eval_exact_match`` as mean ± sample standard deviation over its seeds (the sweep's
``sweep.json`` summary), the sweep's last logged tokens/s (every member logs its program's rate
per member, so the sweep's is members x a member's) and wall seconds, the settings in which the
configs differ, the path of the figure of their mean curves over the seeds (against steps and
tokens), and, as the last line, one JSON object with the table.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

from flaxformer_lite.train import compare
from flaxformer_lite.train.sweep_plot import group_curve

REPO = pathlib.Path(__file__).resolve().parents[1]
METRICS = ("loss", "eval_loss", "eval_exact_match")
RESULTS = ("eval_loss", "eval_exact_match")  # the table's mean ± std columns
FLAXFORMER_LITE = "import sys; from flaxformer_lite.cli import main; sys.exit(main())"


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark (tests/test_readme.py parses the documented commands)."""
    command_line = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    command_line.add_argument(
        "--configs",
        nargs="+",
        type=pathlib.Path,
        default=sorted((REPO / "configs" / "ablations").glob("*.yaml")),
        help="the configs to train (default: configs/ablations/*.yaml)",
    )
    command_line.add_argument(
        "--runs", type=pathlib.Path, default=pathlib.Path("runs/ablations"), help="sweep dirs here"
    )
    command_line.add_argument("--seeds", type=int, default=3, help="seeds of every config")
    command_line.add_argument(
        "--steps", type=int, help="train.steps of every run (default: theirs)"
    )
    command_line.add_argument(
        "--out", type=pathlib.Path, help="the figure (default: RUNS/compare.png)"
    )
    return command_line


def train(config: pathlib.Path, sweep_dir: pathlib.Path, seeds: int, steps: int | None) -> float:
    """Trains ``seeds`` seeds of ``config`` into ``sweep_dir`` afresh in a ``flaxformer-lite
    sweep`` subprocess; its wall seconds. A sweep that fails ends the benchmark with its exit
    status (128 + signal if killed): it has printed what went wrong."""
    command = [sys.executable, "-c", FLAXFORMER_LITE, "sweep", "--config", str(config), "--fresh"]
    command += ["--vary", "seed=" + ",".join(map(str, range(seeds))), f"run_dir={sweep_dir}"]
    command += [] if steps is None else [f"train.steps={steps}"]
    started = time.perf_counter()
    status = subprocess.run(command, stdout=subprocess.DEVNULL).returncode
    if status:
        raise SystemExit(status if status > 0 else 128 - status)
    return time.perf_counter() - started


def mean_run(name: str, members: list[compare.Run]) -> compare.Run:
    """The members as one run for compare's figure: each metric's mean over them at the steps
    every member logged it (the sweep's own mean curves, ``sweep_plot.group_curve``)."""
    by_step: dict[int, dict] = {}
    for metric in METRICS:
        steps, mean, _ = group_curve([member.records for member in members], metric)
        for step, value in zip(steps.tolist(), mean.tolist(), strict=True):
            by_step.setdefault(step, {"step": step})[metric] = value
    return compare.Run(name, [by_step[step] for step in sorted(by_step)], members[0].settings)


def spread(stats: dict | None) -> str:
    """``mean ± std``; ``-`` for a metric no member logged."""
    if stats is None:
        return "-"
    std = "-" if stats["std"] is None else f"{stats['std']:.4f}"
    return f"{stats['mean']:.4f} ± {std}"


def main(argv: list[str] | None = None) -> dict:
    command_line = parser()
    args = command_line.parse_args(argv)
    if args.seeds < 1:
        command_line.error("--seeds must be positive")
    seconds = {}
    for config in args.configs:
        seconds[config.stem] = train(config, args.runs / config.stem, args.seeds, args.steps)
    rows, means = [], []
    for config in args.configs:
        sweep_dir = args.runs / config.stem
        summary = json.loads((sweep_dir / "sweep.json").read_text())["summary"]
        names = list(summary["members"])
        members = compare.load_runs([sweep_dir / name for name in names])
        means.append(mean_run(config.stem, members))
        (group,) = summary["groups"].values()  # the members differ only in their seed
        rows.append(
            {
                "run": config.stem,
                "seeds": len(names),
                **{metric: group.get(metric) for metric in RESULTS},
                "tokens_per_sec": len(names) * members[0].final("tokens_per_sec"),
                "wall_seconds": round(seconds[config.stem], 1),
                "diverged": group["diverged"],
            }
        )
    header = ["run", "seeds", *RESULTS, "tokens_per_sec", "wall_seconds"]
    cells = [[row["run"], row["seeds"], *(spread(row[m]) for m in RESULTS)] for row in rows]
    cells = [
        [*c, row["tokens_per_sec"], row["wall_seconds"]] for c, row in zip(cells, rows, strict=True)
    ]
    print(compare.format_table(header, cells))
    for row in rows:
        if row["diverged"]:
            print(f"{row['run']}: diverged and not counted: {', '.join(row['diverged'])}")
    print()
    print(compare.settings_table(means))
    metrics = [m for m in METRICS if m in compare.logged_metrics(means)]
    figure = compare.plot_comparison(means, metrics, args.out or args.runs / "compare.png")
    print(f"\nfigure (each config's mean over its seeds): {figure}")
    result = {"runs": rows, "figure": str(figure)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
