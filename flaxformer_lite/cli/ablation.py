"""``flaxformer-lite ablation``: configs that differ in one choice, each trained over several
seeds, set side by side as mean ± std over the seeds and tested against a baseline.

    flaxformer-lite ablation                            # the shipped ablations/*, 3 seeds each
    flaxformer-lite ablation --steps 400 --configs ablations/attention ablations/aft_simple
    flaxformer-lite ablation --configs a.yaml b.yaml --seeds 5 --runs runs/mine train.batch_size=16

Each config is one ``flaxformer-lite sweep --config CONFIG --vary seed=0,...,N-1`` subprocess
(its members stepped together by one compiled program, its progress printed as it trains) in
``--runs``/<config name>/seed=<n>, with the ``key=value`` overrides and ``--trust-code`` given;
the configs train one after another, so that they do not share the cores, and the same command
again resumes them (``--fresh`` starts over). ``--steps`` sets ``train.steps`` of all alike.
Printed: a table of each config's final ``eval_loss`` and ``eval_exact_match`` as mean ± sample
standard deviation over its seeds (the sweep's ``sweep.json`` summary), the sweep's last logged
tokens/s (every member logs its program's rate per member, so the sweep's is members x a
member's) and wall seconds, each config's difference from ``--baseline`` tested as ``compare``
tests it (paired over the shared seeds), the settings in which the configs differ, the figure
of their mean curves ± std over the seeds (against steps and tokens), and, as the last line, one
JSON object with the table.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

from flaxformer_lite.cli.errors import guarded, say
from flaxformer_lite.cli.flags import CommandParser, add_trust_code

METRICS = ("loss", "eval_loss", "eval_exact_match")
RESULTS = ("eval_loss", "eval_exact_match")  # the table's mean ± std columns
FLAXFORMER_LITE = "import sys; from flaxformer_lite.cli import main; sys.exit(main())"


def ablation_main(argv: list[str] | None = None) -> int:
    """``flaxformer-lite ablation``: sweep each config over seeds, then compare them."""
    args = parser().parse_args(argv)

    def run() -> int:
        ablation(args)
        return 0

    return guarded(run, trust_code=args.trust_code)


def parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="flaxformer-lite ablation",
        description="Train each config over several seeds (one sweep each, one after another) "
        "and set them side by side: final eval loss and exact match as mean ± std over the "
        "seeds, tokens/s, wall time, the settings that differ, and a figure of the mean curves.",
        examples=(
            "flaxformer-lite ablation --steps 400",
            "flaxformer-lite ablation --configs ablations/attention ablations/aft_simple --seeds 5",
        ),
    )
    p.add_argument(
        "--configs",
        nargs="+",
        default=None,
        help="YAML files or shipped recipes' names (default: every ablations/* recipe: "
        "flaxformer-lite config --list)",
    )
    p.add_argument(
        "--runs",
        type=pathlib.Path,
        default=pathlib.Path("runs/ablations"),
        help="a sweep directory per config in here (default: runs/ablations)",
    )
    p.add_argument("--seeds", type=int, default=3, help="seeds of every config (default: 3)")
    p.add_argument("--steps", type=int, help="train.steps of every run (default: each config's)")
    p.add_argument("--out", type=pathlib.Path, help="the figure (default: RUNS/compare.png)")
    p.add_argument(
        "--baseline", help="the config the others are tested against (default: the first)"
    )
    p.add_argument("--fresh", action="store_true", help="start every sweep over")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="settings of every config")
    add_trust_code(p)
    return p


def ablation(args: argparse.Namespace) -> dict:
    """Trains and compares ``args.configs``; prints the table and returns its JSON object.

    Raises:
      ValueError: ``--seeds`` or ``--steps`` below 1, or no ablations/* recipe shipped.
      SystemExit: a sweep failed, with its exit status (it has said why).
    """
    from flaxformer_lite.train.recipes import recipes

    if args.seeds < 1 or (args.steps is not None and args.steps < 1):
        raise ValueError(f"--seeds and --steps must be positive, got {args.seeds}, {args.steps}")
    configs = args.configs or [name for name in recipes() if name.startswith("ablations/")]
    names = [pathlib.Path(config).stem for config in configs]
    baseline = args.baseline or names[0]
    if baseline not in names:
        raise ValueError(f"--baseline {baseline}: not one of the configs ({', '.join(names)})")
    overrides = [*args.overrides, *([] if args.steps is None else [f"train.steps={args.steps}"])]
    for override in overrides:
        if override.partition("=")[0] in ("run_dir", "seed") or "=" not in override:
            raise ValueError(
                f"{override}: overrides are key=value, not run_dir or seed (--runs, --seeds)"
            )
    seconds = {}
    for config, name in zip(configs, names, strict=True):
        say(f"ablation: {name} ({configs.index(config) + 1} of {len(configs)})")
        flags = ["--fresh"] * args.fresh + ["--trust-code"] * args.trust_code
        seconds[name] = _sweep(config, args.runs / name, args.seeds, [*flags, *overrides])
    return _compare(configs, args.runs, seconds, args.out or args.runs / "compare.png", baseline)


def _sweep(config: str, sweep_dir: pathlib.Path, seeds: int, arguments: list[str]) -> float:
    """Trains ``seeds`` seeds of ``config`` into ``sweep_dir`` (resuming what is there) in a
    ``flaxformer-lite sweep`` subprocess that prints its progress; its wall seconds. A sweep that
    fails ends the ablation with its exit status (128 + signal if killed): it has printed what
    went wrong."""
    command = [sys.executable, "-c", FLAXFORMER_LITE, "sweep", "--config", config, *arguments]
    command += ["--vary", "seed=" + ",".join(map(str, range(seeds))), f"run_dir={sweep_dir}"]
    started = time.perf_counter()
    sys.stdout.flush()
    status = subprocess.run(command).returncode
    if status:
        raise SystemExit(status if status > 0 else 128 - status)
    return time.perf_counter() - started


def _compare(configs, runs: pathlib.Path, seconds: dict, out: pathlib.Path, baseline) -> dict:
    """Prints the table of the configs' sweeps, each one's difference from ``baseline``, their
    differing settings and the figure."""
    from flaxformer_lite.train import compare, sweep_summary
    from flaxformer_lite.train.sweep_dir import SweepDir
    from flaxformer_lite.train.sweep_plot import plot_groups

    rows, means, groups = [], [], {}
    for config in configs:
        name = pathlib.Path(config).stem
        summary = SweepDir(runs / name).read()["summary"]
        (group,) = summary["groups"].values()  # the members differ only in their seed
        # Its counted members: a diverged one's curves are not averaged in.
        members = compare.load_runs([runs / name / member for member in group["members"]])
        means.append(_mean_run(name, members))
        groups[name] = (group, summary["members"], members)
        rows.append(
            {
                "run": name,
                "seeds": len(members),
                **{metric: group.get(metric) for metric in RESULTS},
                "tokens_per_sec": len(members) * members[0].final("tokens_per_sec"),
                "wall_seconds": round(seconds[name], 1),
                "diverged": group["diverged"],
            }
        )
    header = ["run", "seeds", *RESULTS, "tokens_per_sec", "wall_seconds"]
    cells = [
        [row["run"], row["seeds"], *(_spread(row[m]) for m in RESULTS)]
        + [row["tokens_per_sec"], row["wall_seconds"]]
        for row in rows
    ]
    say(compare.format_table(header, cells))
    for row in rows:
        if row["diverged"]:
            say(f"{row['run']}: diverged and not counted: {', '.join(row['diverged'])}")
    say("")
    base, base_members, _ = groups[baseline]
    for name, (group, group_members, _) in groups.items():
        if name == baseline:
            continue
        say(f"{name} - {baseline}:")
        for metric in (m for m in RESULTS if m in group and m in base):
            diff = sweep_summary.difference(
                sweep_summary.metric_values(base, base_members, metric),
                sweep_summary.metric_values(group, group_members, metric),
            )
            say("  " + sweep_summary.difference_text(metric, diff))
    say("")
    say(compare.settings_table(means))
    figure = plot_groups({name: runs_of for name, (_, _, runs_of) in groups.items()}, out)
    say(f"\nfigure (each config's mean ± std over its seeds): {figure}")
    result = {"runs": rows, "baseline": baseline, "figure": str(figure)}
    say(json.dumps(result))
    return result


def _mean_run(name: str, members):
    """The members as one run for compare's figure: each metric's mean over them at the steps
    every member logged it (the sweep's own mean curves, ``sweep_plot.group_curve``)."""
    from flaxformer_lite.train import compare
    from flaxformer_lite.train.sweep_plot import group_curve

    by_step: dict[int, dict] = {}
    for metric in METRICS:
        steps, mean, _ = group_curve([member.records for member in members], metric)
        for step, value in zip(steps.tolist(), mean.tolist(), strict=True):
            by_step.setdefault(step, {"step": step})[metric] = value
    return compare.Run(name, [by_step[step] for step in sorted(by_step)], members[0].settings)


def _spread(stats: dict | None) -> str:
    """``mean ± std``; ``-`` for a metric no member logged."""
    if stats is None:
        return "-"
    std = "-" if stats["std"] is None else f"{stats['std']:.4f}"
    return f"{stats['mean']:.4f} ± {std}"
