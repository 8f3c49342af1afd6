"""The host's cost per step of ``train.py``'s loop: its per-step wall time against its train step
alone, at three sizes, in one process (``loop_vs_step.py``, as ``data.py`` and ``train_step.py
--train-py`` pair them).

- ``noop``: a step that does almost nothing on the device (width 8, one layer of one head, 8 rows
  of 16 tokens of the embedded default's data): the loop's wall time per step is then the
  host's work between steps (dispatching the step, taking the next batch, the data state,
  reading the metrics) wherever it is not hidden behind the step;
- ``default``: the embedded default (``train.py`` with no overrides);
- ``recipe``: nanoGPT's Tiny Shakespeare recipe (``configs/shakespeare_char.yaml``, the settings
  ``shakespeare_char.py`` trains).

For each, ``--windows`` fresh runs of the loop of 2 x steps, each logging the tokens/s of its last
half, are paired with windows of the very step it compiled, on its last batch, timed right before
and after it (:func:`loop_vs_step.train_py_against_step`). Per step: the loop's wall time
(``batch_size * seq_len`` over its logged tokens/s), the step's alone (the median window), and the
host's microseconds, their difference; the share is the median of the runs' paired shares.
Wall times on a shared machine move with its load, so each run also counts the loop thread's
CPU time from one step's call to the next (the median over the run's steps): the host's own
work per step, whatever the load (the data's prefetch thread makes and places the batches
apart from it).
Target: the loop at least 97% of its step alone at the default's and at the recipe's size. The
last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile

import jax

from flaxformer_lite.process import reuse_freed_host_memory, skip_absent_tpu

from loop_vs_step import train_py_against_step

RECIPE = pathlib.Path(__file__).resolve().parents[1] / "configs" / "shakespeare_char.yaml"
SHARE_TARGET = 0.97  # the loop's logged tokens/s over its step alone's
TARGET_SIZES = ("default", "recipe")
NOOP = [
    "model.d_model=8",
    "model.num_heads=1",
    "model.d_ff=16",
    "model.num_decoder_layers=1",
    "train.batch_size=8",
    "data.seq_len=16",
]
# name -> (description, config file (None: the embedded default), overrides)
SIZES = {
    "noop": ("no-op step: width 8, 1 layer, 8 x 16 tokens", None, NOOP),
    "default": ("embedded default: gpt2-tiny, 32 x 64 tokens", None, []),
    "recipe": ("nanoGPT recipe: 4 layers, width 128, 12 x 64 characters", RECIPE, []),
}


def parser() -> argparse.ArgumentParser:
    command_line = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    command_line.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    command_line.add_argument(
        "--windows", type=int, default=5, help="loop runs paired with the step (median)"
    )
    command_line.add_argument("--noop-steps", type=int, default=200, help="steps per window")
    command_line.add_argument("--default-steps", type=int, default=50, help="steps per window")
    command_line.add_argument("--recipe-steps", type=int, default=100, help="steps per window")
    return command_line


def per_step(measured: dict) -> dict:
    """Microseconds per step: the loop's (median logged rate), the step's alone (median
    window), the host's, the loop's less the step's, and the loop thread's CPU time (median)."""
    loop = measured["tokens_per_step"] / measured["train_py_tokens_per_sec"]
    alone = statistics.median(measured["step_seconds"])
    return {
        "loop_us": 1e6 * loop,
        "step_us": 1e6 * alone,
        "host_us": 1e6 * (loop - alone),
        "host_cpu_us": 1e6 * statistics.median(measured["host_cpu_seconds"]),
    }


def run(args) -> dict:
    summary = {"jax": jax.__version__, "backend": jax.default_backend(), "sizes": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.sizes:
            description, config, overrides = SIZES[name]
            steps = getattr(args, f"{name}_steps")
            directory = pathlib.Path(scratch) / name
            measured = train_py_against_step(overrides, steps, args.windows, directory, config)
            summary["sizes"][name] = {"description": description, **measured}
            summary["sizes"][name] |= per_step(measured)
    return summary


def table(summary: dict) -> list[str]:
    lines = [
        "| size | tokens/step | loop µs/step | step alone µs/step | host µs/step "
        "| loop thread CPU µs/step | loop tokens/s / step alone tokens/s (median of pairs) |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in summary["sizes"].values():
        lines.append(
            f"| {m['description']} | {m['tokens_per_step']} | {m['loop_us']:.0f} | "
            f"{m['step_us']:.0f} | {m['host_us']:.0f} | {m['host_cpu_us']:.0f} | "
            f"{100 * m['share']:.1f}% |"
        )
    return lines


def checks(summary: dict) -> list[str]:
    out = []
    for name in TARGET_SIZES:
        if (m := summary["sizes"].get(name)) is not None:
            verdict = "PASS" if m["share"] >= SHARE_TARGET else "FAIL"
            out.append(
                f"{verdict}: {name}: the loop's logged tokens/s = {100 * m['share']:.1f}% of its "
                f"step alone's >= {100 * SHARE_TARGET:.0f}%"
            )
    return out


def main(argv=None) -> dict:
    command_line = parser()
    args = command_line.parse_args(argv)
    if min(args.windows, args.noop_steps, args.default_steps, args.recipe_steps) < 1:
        command_line.error("--windows and the --*-steps must be positive")
    summary = run(args)
    print(
        f"median of {args.windows} fresh runs, each against the step alone right before and after"
    )
    print("\n".join(table(summary) + checks(summary)))
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    skip_absent_tpu()  # as the commands do
    reuse_freed_host_memory()  # as train.py does, before JAX starts its backend
    main()
