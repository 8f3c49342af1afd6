"""The ablation of issue 28: each config of ``configs/ablations/`` trained on the embedded task,
then set side by side by ``flaxformer-lite compare``'s functions.

    python benchmarks/ablation.py                              # every config, as README says
    python benchmarks/ablation.py --steps 1000 --configs configs/ablations/aft_*.yaml

Each config is one ``train.py`` run in a subprocess (its own compilation, its own process
memory), one after another so that they do not share the cores, in ``--runs``/<config name>
(started afresh). The configs differ from ``configs/default.yaml`` only in the self-attention
(``model.mixer``, ``model.local_window``, ``model.global_tokens``); ``--steps`` shortens all of
them alike. Printed: a table of each run's final ``eval_loss``, ``eval_exact_match`` and last
logged ``tokens_per_sec``, the settings in which the runs differ, the path of the figure of their
curves (against steps and tokens), and, as the last line, one JSON object with the table.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

from flaxformer_lite.train import compare

REPO = pathlib.Path(__file__).resolve().parents[1]
METRICS = ("loss", "eval_loss", "eval_exact_match")


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
        "--runs", type=pathlib.Path, default=pathlib.Path("runs/ablations"), help="run dirs here"
    )
    command_line.add_argument(
        "--steps", type=int, help="train.steps of every run (default: theirs)"
    )
    command_line.add_argument(
        "--out", type=pathlib.Path, help="the figure (default: RUNS/compare.png)"
    )
    return command_line


def train(config: pathlib.Path, run_dir: pathlib.Path, steps: int | None) -> float:
    """Trains ``config`` into ``run_dir`` afresh in a ``train.py`` subprocess; its wall seconds.
    A run that fails ends the benchmark with its exit status (128 + signal if killed): train.py
    has printed what went wrong."""
    command = [sys.executable, str(REPO / "train.py"), "--config", str(config), "--fresh"]
    command += ["--no-progress", f"run_dir={run_dir}"]
    command += [] if steps is None else [f"train.steps={steps}"]
    started = time.perf_counter()
    status = subprocess.run(command, stdout=subprocess.DEVNULL).returncode
    if status:
        raise SystemExit(status if status > 0 else 128 - status)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    seconds = {}
    for config in args.configs:
        seconds[config.stem] = train(config, args.runs / config.stem, args.steps)
    runs = compare.load_runs([args.runs / config.stem for config in args.configs])
    rows = [
        {
            "run": config.stem,
            **{key: run.final(key) for key in ("eval_loss", "eval_exact_match", "tokens_per_sec")},
            "wall_seconds": round(seconds[config.stem], 1),
        }
        for config, run in zip(args.configs, runs, strict=True)
    ]
    header = ["run", "eval_loss", "eval_exact_match", "tokens_per_sec", "wall_seconds"]
    print(compare.format_table(header, [[row[key] for key in header] for row in rows]))
    print()
    print(compare.settings_table(runs))
    metrics = [m for m in METRICS if m in compare.logged_metrics(runs)]
    figure = compare.plot_comparison(runs, metrics, args.out or args.runs / "compare.png")
    print(f"\nfigure: {figure}")
    result = {"runs": rows, "figure": str(figure)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
