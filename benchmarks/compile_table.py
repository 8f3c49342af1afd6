"""The table of compiled plans in benchmarks/README.md: each decoder recipe on each slice in each
layout, compiled by ``flaxformer-lite compile`` in a process of its own.

    python benchmarks/compile_table.py --out compile_rows.jsonl
    python benchmarks/compile_table.py --out compile_rows.jsonl --topologies h100-8

Each row's JSON line (the compile's last line, with the row's name, command and compile time) is
appended to ``--out`` as soon as it is compiled; rows already there are not compiled again (but
failed ones), so an interrupted table goes on where it stopped. The markdown table of every row
asked for is printed at the end. ``h100-N`` rows need jax's CUDA plugin (the ``gpu-compile``
extra), TPU rows libtpu (``tpu``); each compile starts JAX on the CPU (``JAX_PLATFORMS=cpu``).
``--set key=value`` adds overrides to every row (the tests shrink the recipes with it); rows of
other overrides are other rows.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

# model -> (recipe, its overrides): gpt2-small's vocabulary padded to divide over the tensor axis
MODELS = {
    "gpt2-small": ("gpt2_small", ["model.vocab_size=50304"]),
    "llama-style": ("llama_style", []),
    "transformer-base": ("transformer_base", []),
}
LAYOUTS = {
    "data": ["mesh.data=-1"],
    "fsdp": ["mesh.data=1", "mesh.fsdp=-1"],
    "fsdp x tensor": ["mesh.data=1", "mesh.fsdp=-1", "mesh.tensor=2"],
}
TOPOLOGIES = ("v5e-8", "v5p-8", "h100-8")
ABBREVIATIONS = {
    "all-reduce": "AR",
    "all-gather": "AG",
    "reduce-scatter": "RS",
    "collective-permute": "CP",
    "all-to-all": "A2A",
}
GIB = 2**30


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True, help="the rows, JSON lines")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--topologies", nargs="+", default=list(TOPOLOGIES))
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--set", nargs="*", default=[], metavar="key=value")
    return parser


def row_arguments(model: str, topology: str, layout: str, extra: list[str]) -> list[str]:
    """The ``flaxformer-lite`` arguments that compile one row."""
    recipe, overrides = MODELS[model]
    return [
        "compile",
        "--config",
        recipe,
        "--topology",
        topology,
        *overrides,
        *LAYOUTS[layout],
        *extra,
    ]


def compile_command(arguments: list[str]) -> dict:
    """Runs ``flaxformer-lite ARGUMENTS`` in a fresh process (JAX on the CPU): its JSON summary
    with its command and wall time; ``error`` instead when it printed none."""
    program = [
        sys.executable,
        "-c",
        "import sys; from flaxformer_lite.cli import main; sys.exit(main())",
    ]
    start = time.perf_counter()
    done = subprocess.run(
        [*program, *arguments],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    row = {"command": "flaxformer-lite " + " ".join(arguments)}
    row["compile_seconds"] = round(time.perf_counter() - start, 1)
    lines = done.stdout.strip().splitlines()
    try:
        row.update(json.loads(lines[-1]))
    except (IndexError, json.JSONDecodeError):
        row["error"] = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
    return row


def compile_row(model: str, topology: str, layout: str, extra: list[str]) -> dict:
    """Compiles one row in a fresh process (:func:`compile_command`), named by its key."""
    row = {"model": model, "topology": topology, "layout": layout, "set": extra}
    return row | compile_command(row_arguments(model, topology, layout, extra))


def row_key(model: str, topology: str, layout: str, extra: list[str]) -> tuple:
    """What names a row: rows compiled with other ``--set`` overrides are other rows."""
    return model, topology, layout, tuple(extra)


def read_rows(path: pathlib.Path) -> dict[tuple, dict]:
    """The rows already in ``path`` by :func:`row_key`, but those that failed (a missing extra,
    say), which are compiled again; a later line of a row replaces an earlier one."""
    if not path.exists():
        return {}
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {
        row_key(row["model"], row["topology"], row["layout"], row.get("set", [])): row
        for row in rows
        if "error" not in row
    }


def table_line(row: dict) -> str:
    """One markdown row: memory per chip, fit, collectives per step, attention, the roofline."""
    mesh = row.get("mesh")  # none when the compile failed
    shape = mesh and " x ".join(str(mesh[axis]) for axis in ("data", "fsdp", "tensor"))
    cells = [row["model"], row["topology"], shape or row["layout"]]
    if "error" in row:
        return "| " + " | ".join([*cells, f"failed: {row['error']}", "", "", "", "", ""]) + " |"
    sizes = {key: value / GIB for key, value in row["per_chip_bytes"].items()}
    memory = "{params:.2f} + {optimizer:.2f} + {temp:.2f} = {total:.2f}".format(**sizes)
    fits = {True: "yes", False: "**no**", None: "n/a"}[row["fits"]]  # None: no chip to fill
    if row["collectives"] is None:  # the compiler refused the program
        return (
            "| " + " | ".join([*cells, memory, fits, "refused by the compiler", "", "", ""]) + " |"
        )
    collectives = " ".join(
        f"{ABBREVIATIONS[op]} {count}" for op, count in row["collectives"].items() if count
    )
    if row.get("collectives_exact") is False:  # a loop of unknown length counted once
        collectives = f"at least {collectives}"
    seconds, mfu = row["estimated_step_seconds"], row["estimated_mfu"]
    estimate = [f"{seconds * 1e3:.3g}", f"{mfu:.0%}"] if seconds else ["", ""]
    return (
        "| "
        + " | ".join([*cells, memory, fits, collectives or "none", row["attention"], *estimate])
        + " |"
    )


HEADER = (
    "| model | slice | mesh (data x fsdp x tensor) "
    "| GiB per chip: params + optimizer + temp = total | fits | collectives per step "
    "| attention | ceiling: ms/step | ceiling: MFU |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    done = read_rows(args.out)
    wanted = [
        (model, topology, layout)
        for topology in args.topologies
        for model in args.models
        for layout in args.layouts
    ]
    for row in wanted:
        key = row_key(*row, args.set)
        if key in done:
            continue
        done[key] = compile_row(*row, args.set)
        with args.out.open("a") as out:
            out.write(json.dumps(done[key]) + "\n")
        print(f"{' '.join(row)}: {done[key]['compile_seconds']} s", file=sys.stderr, flush=True)
    print(HEADER)
    for row in wanted:
        print(table_line(done[row_key(*row, args.set)]))


if __name__ == "__main__":
    main()
