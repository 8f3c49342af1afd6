"""``flaxformer-lite sweep``: train the members of a sweep (the product of ``--vary`` values) in
one command, those that share a program as one compiled step (:mod:`flaxformer_lite.train.
sweep`), and print each seed group's metrics as mean ± std.

    flaxformer-lite sweep --vary seed=0,1,2 --vary optimizer.lr=1e-3,3e-3 run_dir=runs/lr

Exit status as ``train``'s: 2 for bad input, 128 + signal after SIGTERM/SIGINT (the members'
checkpoints written; the same command resumes).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time

from flaxformer_lite.cli.errors import exit_on_signals, guarded, notice, say
from flaxformer_lite.cli.flags import CONFIG_HELP, CommandParser, add_trust_code
from flaxformer_lite.cli.library_log import library_log_to

DESCRIPTION = """Train a sweep: one run for each combination of the --vary values, in
run_dir/<member> (each a run: generate, export, plot, compare and load_run read it). Members that
differ only in numbers (the seed, the optimizer's numbers and schedule, label smoothing, z-loss,
embedding and residual dropout, an initialization scale) train together as one compiled program
(each member then logs exactly what train.py --config run_dir/<member>/config.yaml
run_dir=ELSEWHERE logs); settings that change the model's
graph or shapes split them into programs run one after another. At the end, each group of
members that differ only in their seed gets its metrics as mean ± std, in run_dir/sweep.json.
The same command resumes."""
MANY_MEMBERS = 64  # more members than this need --yes
EXAMPLES = (
    "flaxformer-lite sweep --vary seed=0,1,2,3 run_dir=runs/seeds train.steps=300",
    "flaxformer-lite sweep --config shakespeare_char --vary seed=0,1,2 "
    "--vary optimizer.lr=1e-3,2e-3 run_dir=runs/sc_lr",
    "flaxformer-lite compare runs/seeds runs/sc_lr:lr=1e-3",
)


def sweep_main(argv: list[str] | None = None) -> int:
    """``flaxformer-lite sweep``: train (or resume) the sweep."""
    started = time.perf_counter()  # the closing line's wall time counts the imports
    args = sweep_parser().parse_intermixed_args(argv)
    with exit_on_signals():  # importing JAX takes seconds too
        return _sweep(args, started)


def sweep_parser() -> CommandParser:
    """The ``sweep`` command's arguments."""
    parser = CommandParser(prog="flaxformer-lite sweep", description=DESCRIPTION, examples=EXAMPLES)
    parser.add_argument("--config", type=pathlib.Path, help=CONFIG_HELP)
    parser.add_argument(
        "--vary",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="a setting and its values (repeatable; the members are the product)",
    )
    parser.add_argument(
        "--fresh", action="store_true", help="move an existing sweep directory aside first"
    )
    parser.add_argument(
        "--force", action="store_true", help="resume members whose settings changed"
    )
    parser.add_argument(
        "--vmap",
        action=argparse.BooleanOptionalAction,
        help="step a program's members as one vmapped step, or (--no-vmap) by one compiled "
        "step in turn (default: vmapped on accelerators, in turn on a CPU)",
    )
    parser.add_argument(
        "--yes",
        action="store_true",
        help=f"train a sweep of more than {MANY_MEMBERS} members (each starts as a run does: "
        "seconds a member before the first step)",
    )
    add_trust_code(parser)
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="settings of every member"
    )
    return parser


def _sweep(args, started: float) -> int:
    from flaxformer_lite.process import reuse_freed_host_memory, use_compilation_cache

    reuse_freed_host_memory()  # before JAX starts its backend's threads
    import jax

    from flaxformer_lite.train.config import load_config
    from flaxformer_lite.train.loop import Interrupted
    from flaxformer_lite.train.sweep import sweep
    from flaxformer_lite.train.sweep_dir import SweepDir
    from flaxformer_lite.train.sweep_members import parse_vary
    from flaxformer_lite.train.time_spent import TimeSpent

    def train():
        vary = parse_vary(args.vary)
        count = math.prod(len(values) for values in vary.values())
        if count > MANY_MEMBERS and not args.yes:
            raise ValueError(
                f"--vary makes {count:,} members, each started as a run is (its data, state and "
                f"directory) before the first step: pass --yes to train them all, or vary fewer "
                "values"
            )
        # The varied keys' first values complete the shared settings (every member gets its
        # own): a data.path that only --vary gives.
        firsts = [
            f"{key}={values[0]}"
            for key, values in vary.items()
            if key != "run_dir" and isinstance(values[0], str)
        ]
        cfg = load_config(args.config, [*args.overrides, *firsts], notify=notice)
        use_compilation_cache(cfg.train.compilation_cache)
        directory = SweepDir(cfg.run_dir)
        directory.refuse_if_not_a_sweep()  # before the libraries' log is written in it
        library_log_to(directory.library_log)
        spent = TimeSpent(started)
        sweep(cfg, vary, fresh=args.fresh, force=args.force, vmap=args.vmap, log=say, spent=spent)
        if jax.process_index() == 0:  # a multi-process sweep reports once
            say(
                f"done: {cfg.run_dir} (sweep.json: every member's results and each group's); "
                f"{spent.summary()}"
            )
        return 0

    try:
        return guarded(train, trust_code=args.trust_code)
    except Interrupted as error:
        say(str(error), stream=sys.stderr)
        return 128 + error.signum
