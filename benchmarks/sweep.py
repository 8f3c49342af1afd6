"""Issue 42's sweep against the runs it replaces: the members of one ``flaxformer-lite sweep``
command against the same configs trained by ``train.py`` one after another; wall time,
throughput and peak memory per member.

    python benchmarks/sweep.py                                   # both cases, as README says
    python benchmarks/sweep.py --cases recipe --recipe-members 4 --recipe-steps 100

Each case's members are seeds 0 to M-1 of one config (nothing else varied, so they share one
compiled program), trained twice, every training a subprocess of its own started afresh in a
temporary directory: first by ``flaxformer-lite sweep --config C --vary seed=0,...,M-1
train.steps=S`` (with ``--vmap``: its members as one vmapped step, where the default on a CPU
runs one compiled step for each member in turn), then by M ``flaxformer-lite train --config C
seed=N train.steps=S --no-progress`` (``train.py``'s command), one after another. The cases:

- ``default``: the embedded default (``--default-config``, by default none: what ``train.py``
  runs with no ``--config``), ``--seeds`` (4) members of ``--default-steps`` (300) steps; the
  target is the sweep's wall time <= 0.5x the runs' together.
- ``recipe``: the Tiny Shakespeare recipe (``--recipe-config``, ``shakespeare_char``),
  ``--recipe-members`` (8) members of ``--recipe-steps`` (200; the recipe's 2000 take half an
  hour for 16 trainings here); the ratio is reported.

Reported per case:

- wall s: each process from launch to exit; the runs' summed.
- tokens/s, steady: the median of a run's logged ``tokens_per_sec`` over its log windows, the
  first (after the compiling step) left out when there are others. Every member of a sweep logs
  the same rate, its program's per member: a step's tokens over the time of the step that
  advances every member. The sweep's throughput is therefore members x a member's steady rate;
  one run's is the median of the runs' steady rates.
- peak memory: each process's peak resident set (``ru_maxrss`` of ``os.wait4``): the host's
  memory, which on a CPU holds the arrays too. The sweep's over its members, and what a member
  adds to it, ``(sweep - run) / (M - 1)`` with the runs' median, against one run's.
- final loss: the largest difference between a member's last logged training loss and its
  run's (the same config trained alone: equal up to float reassociation).

Printed: the table, a PASS/FAIL line for the default case's 0.5x target and, as the last line,
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import jax

from flaxformer_lite.train.metrics import read_metrics

WALL_TARGET = 0.5  # the default case's sweep wall time over its runs'
FLAXFORMER_LITE = "import sys; from flaxformer_lite.cli import main; sys.exit(main())"


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark (tests/test_readme.py parses the documented commands)."""
    command_line = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    command_line.add_argument(
        "--cases", nargs="+", choices=("default", "recipe"), default=["default", "recipe"]
    )
    command_line.add_argument("--seeds", type=int, default=4, help="members of the default case")
    command_line.add_argument("--default-steps", type=int, default=300)
    command_line.add_argument(
        "--default-config", help="the default case's config (default: the embedded default)"
    )
    command_line.add_argument("--recipe-members", type=int, default=8)
    command_line.add_argument("--recipe-steps", type=int, default=200)
    command_line.add_argument("--recipe-config", default="shakespeare_char")
    command_line.add_argument(
        "--vmap", action="store_true", help="the sweeps' members as one vmapped step"
    )
    return command_line


def timed(argv: list[str]) -> dict:
    """Runs ``flaxformer-lite ARGV`` in a subprocess to its end; its wall seconds and peak
    resident MiB. A process that fails ends the benchmark with its exit status (128 + signal if
    killed): it has printed what went wrong."""
    started = time.perf_counter()
    command = [sys.executable, "-c", FLAXFORMER_LITE, *argv]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        code = process.returncode
        raise SystemExit(code if code > 0 else 128 - code)
    return {"wall_seconds": wall, "peak_mib": usage.ru_maxrss / 1024}  # Linux: KiB


def steady(run_dir: pathlib.Path) -> float:
    """The run's median logged tokens/s over its log windows, the first left out if others."""
    rates = [r["tokens_per_sec"] for r in read_metrics(run_dir) if r.get("tokens_per_sec")]
    return statistics.median(rates[1:] or rates)


def final_loss(run_dir: pathlib.Path) -> float:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r][-1]


def case(name: str, config: str | None, members: int, steps: int, directory: pathlib.Path, vmap):
    """The case's sweep and its runs, trained one after another; the figures of the module's
    docstring."""
    shared = [] if config is None else ["--config", config]
    shared.append(f"train.steps={steps}")
    seeds = ",".join(map(str, range(members)))
    sweep_dir = directory / name / "sweep"
    vary = ["--vary", f"seed={seeds}", *(["--vmap"] if vmap else [])]
    sweep = timed(["sweep", *shared, *vary, f"run_dir={sweep_dir}"])
    settings = json.loads((sweep_dir / "sweep.json").read_text())["members"]
    names = list(settings)
    runs = []
    for member in names:
        run_dir = directory / name / "runs" / member
        seed = settings[member]["seed"]
        runs.append(
            timed(["train", *shared, f"seed={seed}", f"run_dir={run_dir}", "--no-progress"])
        )
        runs[-1]["tokens_per_sec"] = steady(run_dir)
    run_mib = statistics.median(run["peak_mib"] for run in runs)
    runs_wall = sum(run["wall_seconds"] for run in runs)
    run_rate = statistics.median(run["tokens_per_sec"] for run in runs)
    sweep_rate = members * steady(sweep_dir / names[0])
    differences = [
        abs(final_loss(sweep_dir / member) - final_loss(directory / name / "runs" / member))
        for member in names
    ]
    return {
        "case": name,
        "config": config,
        "members": members,
        "steps": steps,
        "sweep": sweep,
        "runs": runs,
        "wall_ratio": sweep["wall_seconds"] / runs_wall,
        "runs_wall_seconds": runs_wall,
        "sweep_tokens_per_sec": sweep_rate,
        "run_tokens_per_sec": run_rate,
        "tokens_per_sec_ratio": sweep_rate / run_rate,
        "sweep_mib_per_member": sweep["peak_mib"] / members,
        "added_member_mib": (sweep["peak_mib"] - run_mib) / max(members - 1, 1),
        "run_mib": run_mib,
        "max_final_loss_difference": max(differences),
    }


def table(cases: list[dict]) -> list[str]:
    """The cases as a markdown table."""
    lines = [
        "| case | members x steps | sweep wall s | runs' wall s | wall ratio | sweep tokens/s "
        "| run tokens/s | tokens/s ratio | sweep MiB / member | MiB a member adds | run MiB "
        "| final loss max diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        cells = [
            c["case"],
            f"{c['members']} x {c['steps']}",
            f"{c['sweep']['wall_seconds']:.1f}",
            f"{c['runs_wall_seconds']:.1f}",
            f"{c['wall_ratio']:.2f}x",
            f"{c['sweep_tokens_per_sec'] / 1e3:.1f}k",
            f"{c['run_tokens_per_sec'] / 1e3:.1f}k",
            f"{c['tokens_per_sec_ratio']:.2f}x",
            f"{c['sweep_mib_per_member']:.0f}",
            f"{c['added_member_mib']:.0f}",
            f"{c['run_mib']:.0f}",
            f"{c['max_final_loss_difference']:.2g}",
        ]
        lines.append(f"| {' | '.join(cells)} |")
    return lines


def main(argv: list[str] | None = None) -> dict:
    command_line = parser()
    args = command_line.parse_args(argv)
    sizes = (args.seeds, args.default_steps, args.recipe_members, args.recipe_steps)
    if min(sizes) < 1:
        command_line.error("members and steps must be positive")
    settings = {
        "default": (args.default_config, args.seeds, args.default_steps),
        "recipe": (args.recipe_config, args.recipe_members, args.recipe_steps),
    }
    with tempfile.TemporaryDirectory() as directory:
        directory = pathlib.Path(directory)
        cases = [case(name, *settings[name], directory, args.vmap) for name in args.cases]
    summary = {
        "jax": jax.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "vmap": args.vmap,
        "cases": cases,
    }
    print("\n".join(table(cases)))
    for c in cases:
        if c["case"] == "default":
            verdict = "PASS" if c["wall_ratio"] <= WALL_TARGET else "FAIL"
            print(
                f"{verdict}: {c['members']} seeds of the default, sweep wall / runs' wall = "
                f"{c['wall_ratio']:.2f} <= {WALL_TARGET}"
            )
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
