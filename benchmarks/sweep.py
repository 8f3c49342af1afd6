"""A sweep against the runs it replaces: the members of one ``flaxformer-lite sweep`` command
against the same configs trained by ``train.py`` one after another; wall time, where it went,
throughput and peak memory per member.

    python benchmarks/sweep.py                                   # both cases, as README says
    python benchmarks/sweep.py --cases recipe --recipe-members 4 --recipe-steps 100

Each case's members are seeds 0 to M-1 of one config (nothing else varied, so they share one
compiled program), trained twice, every training a subprocess of its own started afresh in a
temporary directory: first by ``flaxformer-lite sweep --config C --vary seed=0,...,M-1
train.steps=S`` (with ``--vmap``: its members as one vmapped step, where the default on a CPU
runs one compiled step for each member in turn), then by M ``flaxformer-lite train --config C
seed=N train.steps=S --no-progress`` (``train.py``'s command), one after another, every one
with ``train.compilation_cache=false`` (each process compiles what it runs, as on a new
machine: a cache the sweep warmed would spare the runs their compiling). The cases:

- ``default``: the embedded default (``--default-config``, by default none: what ``train.py``
  runs with no ``--config``), ``--seeds`` (4) members of ``--default-steps`` (240) steps.
- ``recipe``: the Tiny Shakespeare recipe (``--recipe-config``, ``shakespeare_char``),
  ``--recipe-members`` (8) members of ``--recipe-steps`` (200; the recipe's 2000 take half an
  hour for 16 trainings here).

The target (issue 58): on a CPU members' steps cannot get cheaper than their runs' (one member
keeps the cores busy), so a sweep's wall time is to be at most its members' step time (the
``steps`` part of its closing line) + one run's fixed cost (a run's wall less its steps, the
median over the runs) + 1 s a member.

Reported per case:

- wall s: each process from launch to exit; the runs' summed; their ratio.
- the limit above, and where the sweep's time and a run's went: the parts of each command's
  closing line (start-up, data, compilation, steps, evaluations, checkpoints, plots; a run's the
  median over the runs).
- tokens/s, steady: the median of a run's logged ``tokens_per_sec`` over its log windows, the
  first (after the compiling step) left out when there are others. Every member of a sweep logs
  the same rate, its program's per member: a step's tokens over the time of the step that
  advances every member. The sweep's throughput is therefore members x a member's steady rate;
  one run's is the median of the runs' steady rates.
- peak memory: each process's peak resident set (``ru_maxrss`` of ``os.wait4``): the host's
  memory, which on a CPU holds the arrays too. The sweep's over its members, and what a member
  adds to it, ``(sweep - run) / (M - 1)`` with the runs' median, against one run's.
- final loss: the largest difference between a member's last logged training loss and its
  run's (the same config trained alone: 0 for members stepped in turn, the same program).

Printed: the tables, a PASS/FAIL line per case for the limit and, as the last line, one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

import jax

from flaxformer_lite.train.metrics import read_metrics

SECONDS_A_MEMBER = 1.0  # what the limit allows a member past one run's fixed cost
PARTS = ("start-up", "data", "compilation", "steps", "evaluations", "checkpoints", "plots")
FLAXFORMER_LITE = "import sys; from flaxformer_lite.cli import main; sys.exit(main())"


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark (tests/test_readme.py parses the documented commands)."""
    command_line = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    command_line.add_argument(
        "--cases", nargs="+", choices=("default", "recipe"), default=["default", "recipe"]
    )
    command_line.add_argument("--seeds", type=int, default=4, help="members of the default case")
    command_line.add_argument("--default-steps", type=int, default=240)
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
    """Runs ``flaxformer-lite ARGV`` in a subprocess to its end; its wall seconds, peak resident
    MiB and the parts of its closing line. A process that fails ends the benchmark with its exit
    status (128 + signal if killed): it has printed what went wrong."""
    started = time.perf_counter()
    command = [sys.executable, "-c", FLAXFORMER_LITE, *argv]
    with tempfile.TemporaryFile("w+") as output:
        process = subprocess.Popen(command, stdout=output)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
        output.seek(0)
        printed = output.read()
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        code = process.returncode
        raise SystemExit(code if code > 0 else 128 - code)
    return {
        "wall_seconds": wall,
        "peak_mib": usage.ru_maxrss / 1024,  # Linux: KiB
        "parts": closing_parts(printed),
    }


def closing_parts(printed: str) -> dict[str, float] | None:
    """The seconds of each part in a command's closing line (``done: ...; 61.2 s: start-up
    3.1 s, data 2.5 s, ...``); None without one (``config --list``)."""
    done = [line for line in printed.splitlines() if line.startswith("done: ")]
    if not done:
        return None
    listed = done[-1].rsplit("; ", 1)[1].split(": ", 1)[1]
    pairs = (re.fullmatch(r"(\S+) (-?[\d.]+) s", part).groups() for part in listed.split(", "))
    return {name: float(seconds) for name, seconds in pairs}


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
    # Every process compiles what it runs: a cache warmed by the sweep would spare the runs.
    shared += [f"train.steps={steps}", "train.compilation_cache=false"]
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
    sweep_steps = sweep["parts"]["steps"]
    fixed = statistics.median(run["wall_seconds"] - run["parts"]["steps"] for run in runs)
    limit = sweep_steps + fixed + SECONDS_A_MEMBER * members
    run_parts = {part: statistics.median(run["parts"][part] for run in runs) for part in PARTS}
    return {
        "case": name,
        "config": config,
        "limit_seconds": limit,
        "run_fixed_seconds": fixed,
        "within_limit": sweep["wall_seconds"] <= limit,
        "run_parts": run_parts,
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
    """The cases as markdown tables: the sweep against its runs, then where their time went."""
    lines = [
        "| case | members x steps | sweep wall s | runs' wall s | wall ratio | limit s | sweep "
        "tokens/s | run tokens/s | tokens/s ratio | sweep MiB / member | MiB a member adds "
        "| run MiB | final loss max diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        cells = [
            c["case"],
            f"{c['members']} x {c['steps']}",
            f"{c['sweep']['wall_seconds']:.1f}",
            f"{c['runs_wall_seconds']:.1f}",
            f"{c['wall_ratio']:.2f}x",
            f"{c['limit_seconds']:.1f}",
            f"{c['sweep_tokens_per_sec'] / 1e3:.1f}k",
            f"{c['run_tokens_per_sec'] / 1e3:.1f}k",
            f"{c['tokens_per_sec_ratio']:.2f}x",
            f"{c['sweep_mib_per_member']:.0f}",
            f"{c['added_member_mib']:.0f}",
            f"{c['run_mib']:.0f}",
            f"{c['max_final_loss_difference']:.2g}",
        ]
        lines.append(f"| {' | '.join(cells)} |")
    lines += [
        "",
        f"| case | command | wall s | {' | '.join(PARTS)} |",
        "|---" * (3 + len(PARTS)) + "|",
    ]
    for c in cases:
        for who, wall, parts in (
            ("sweep", c["sweep"]["wall_seconds"], c["sweep"]["parts"]),
            (
                "a run (median)",
                statistics.median(r["wall_seconds"] for r in c["runs"]),
                c["run_parts"],
            ),
        ):
            cells = [c["case"], who, f"{wall:.1f}", *(f"{parts[part]:.1f}" for part in PARTS)]
            lines.append(f"| {' | '.join(cells)} |")
    return lines


def verdict(c: dict) -> str:
    """The case's line for the limit."""
    return (
        f"{'PASS' if c['within_limit'] else 'FAIL'}: {c['case']}, sweep wall "
        f"{c['sweep']['wall_seconds']:.1f} s <= {c['limit_seconds']:.1f} s (members' steps "
        f"{c['sweep']['parts']['steps']:.1f} s + one run's fixed cost "
        f"{c['run_fixed_seconds']:.1f} s + {SECONDS_A_MEMBER:.0f} s x {c['members']})"
    )


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
        print(verdict(c))
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
