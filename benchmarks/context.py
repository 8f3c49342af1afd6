"""Context parallelism (``mesh.context``) against its alternatives: the longest sequence that fits
a TPU slice, and the step time on 8 simulated CPU devices against data parallelism.

    python benchmarks/context.py memory --out context_rows.jsonl    # gpt2-small, v5e-8, 1/2/4/8
    python benchmarks/context.py time                               # gpt2-tiny on 8 CPU devices
    python benchmarks/context.py time --quick                       # the tests' size, seconds

``memory``: for each context size C, the recipe's train step compiled ahead of time for the slice
by ``flaxformer-lite compile`` (a process per compile, as ``compile_table.py``) over a mesh of
fsdp N/C x context C (N chips) at N/C sequences a step, so every chip holds T / C tokens of a
sequence of T. From ``--start`` x C tokens the length doubles while the step fits (halves while
it does not) until the longest power of two that fits is known. A step fits when XLA's total per
chip is within the chip's HBM, or within ``--budget-gib`` when given. Rows are appended to
``--out`` as compiled and not compiled again (an interrupted sweep goes on where it stopped).

``time``: the same tokens a step two ways, side by side in one process: one sequence of 8 x
``--seq`` tokens split over ``mesh.context=8``, and 8 sequences of ``--seq`` tokens over
``mesh.data=8``; both steps compiled, then timed in alternating windows, and the medians and
their ratio reported. The simulated devices share this host's cores, so the ratio measures the
work and the layout's overheads (gathers, the zig-zag permutation), not an interconnect.

The last line is one JSON object with every row.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import compile_table  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from flaxformer_lite.aot import parse_topology  # noqa: E402
from flaxformer_lite.data.tasks import TASKS
from flaxformer_lite.models import ModelConfig, build_model  # noqa: E402
from flaxformer_lite.models.accounting import training_flops_per_token  # noqa: E402
from flaxformer_lite.parallel import (  # noqa: E402
    DEFAULT_RULES,
    batch_sharding,
    create_sharded,
    make_mesh,
)
from flaxformer_lite.train.program import tracing_layout  # noqa: E402
from flaxformer_lite.train.step import make_train_step  # noqa: E402

CONTEXTS = (1, 2, 4, 8)
DEVICES = 8
GIB = 2**30


# ----------------------------------------------------------------------------- memory
def memory_arguments(
    model: str, topology: str, context: int, length: int, extra: list[str]
) -> list[str]:
    """The ``flaxformer-lite`` arguments of one row: fsdp N/C x context C, N/C sequences of
    ``length`` (a learned position table as long as the sequence)."""
    chips = parse_topology(topology).chips
    recipe, overrides = compile_table.MODELS[model]
    return [
        "compile",
        "--config",
        recipe,
        "--topology",
        topology,
        *overrides,
        "mesh.data=1",
        f"mesh.fsdp={chips // context}",
        f"mesh.context={context}",
        f"train.batch_size={chips // context}",
        f"data.seq_len={length}",
        f"model.max_length={length}",
        *extra,
    ]


def fits(row: dict, budget_gib: float | None) -> bool:
    """Whether a compiled row fits: XLA's total per chip within the budget (the chip's HBM when
    none is given: the compile's own verdict). A failed compile does not fit."""
    if "error" in row:
        return False
    if budget_gib is None:
        return bool(row["fits"])
    return row["per_chip_bytes"]["total"] <= budget_gib * GIB


def longest_fitting(compile_length, start: int, limit: int, fit) -> int | None:
    """The longest power-of-two multiple of ``start`` up to ``limit`` whose row fits, found by
    doubling from ``start`` while rows fit (halving while they do not); None when even the
    shortest tried, ``start`` halved down to 1, does not fit. ``compile_length(T)`` is a row."""
    length = start
    if fit(compile_length(length)):
        while length * 2 <= limit and fit(compile_length(length * 2)):
            length *= 2
        return length
    while length > 1:
        length //= 2
        if fit(compile_length(length)):
            return length
    return None


def memory_rows(args) -> tuple[list[dict], dict[int, int | None]]:
    """Every row compiled (or read from ``--out``, but those that failed, which are compiled
    again) and the longest fitting length per context."""
    done = {}
    if args.out.exists():
        for line in args.out.read_text().splitlines():
            row = json.loads(line)
            if "error" not in row:
                done[(row["context"], row["length"], tuple(row["set"]))] = row
    rows, longest = [], {}
    for context in args.contexts:

        def compile_length(length: int, context=context) -> dict:
            key = (context, length, tuple(args.set))
            if key not in done:
                arguments = memory_arguments(args.model, args.topology, context, length, args.set)
                sequences = parse_topology(args.topology).chips // context
                row = {"context": context, "length": length, "sequences": sequences}
                row["set"] = args.set
                done[key] = row | compile_table.compile_command(arguments)
                with args.out.open("a") as out:
                    out.write(json.dumps(done[key]) + "\n")
                print(
                    f"context {context}, {length} tokens: {done[key]['compile_seconds']} s",
                    file=sys.stderr,
                    flush=True,
                )
            rows.append(done[key])
            return done[key]

        longest[context] = longest_fitting(
            compile_length,
            args.start * context,
            args.max_length,
            lambda row: fits(row, args.budget_gib),
        )
    return rows, longest


def memory_table(rows: list[dict], longest: dict[int, int | None], budget) -> list[str]:
    """The markdown table: one line per compiled row, then the longest fitting per context."""
    lines = [
        "| context | mesh (fsdp x context) | tokens per sequence x sequences | tokens per chip "
        "| GiB per chip: params + optimizer + temp = total | fits |",
        "|---|---|---|---|---|---|",
    ]
    for row in sorted(rows, key=lambda row: (row["context"], row["length"])):
        shape = f"{row['sequences']} x {row['context']}"  # fsdp N/C: a sequence per fsdp shard
        if "error" in row:
            cells = [f"failed: {row['error']}", "**no**"]
        else:
            sizes = {key: value / GIB for key, value in row["per_chip_bytes"].items()}
            refused = "collectives" in row and row["collectives"] is None  # temp: as asked
            form = "{params:.2f} + {optimizer:.2f} + " + (
                "{temp:.2f} asked" if refused else "{temp:.2f} = {total:.2f}"
            )
            cells = [form.format(**sizes), "yes" if fits(row, budget) else "**no**"]
        lines.append(
            "| "
            + " | ".join(
                [
                    str(row["context"]),
                    shape,
                    f"{row['length']:,} x {row['sequences']}",
                    f"{row['length'] // row['context']:,}",
                    *cells,
                ]
            )
            + " |"
        )
    lines.append("")
    lines.append("| context | longest sequence that fits | of context 1's |")
    lines.append("|---|---|---|")
    base = longest.get(1)
    for context, length in longest.items():
        ratio = f"{length / base:g}x" if length and base else ""
        lines.append(f"| {context} | {f'{length:,}' if length else 'none'} | {ratio} |")
    return lines


# ----------------------------------------------------------------------------- time
def lm_batch(rng: np.random.Generator, sequences: int, length: int, vocab: int) -> dict:
    ids = rng.integers(0, vocab, (sequences, length + 1)).astype(np.int32)
    weights = np.ones((sequences, length), np.float32)
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:], "weights": weights}


def timed_step(cfg: ModelConfig, mesh, batch: dict):
    """``run(steps) -> seconds``: the train step of ``cfg`` over ``mesh`` compiled and warmed up
    on ``batch``, each call running ``steps`` steps and waiting for the last."""
    tx = optax.adamw(1e-4)

    def create():
        model = build_model(cfg, rngs=nnx.Rngs(params=0, dropout=1))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    graphdef, state, shardings = create_sharded(create, mesh, DEFAULT_RULES)
    batch = jax.device_put(batch, batch_sharding(mesh, DEFAULT_RULES))
    with tracing_layout(mesh, DEFAULT_RULES):
        step = make_train_step(graphdef, task=TASKS["lm"], state_shardings=shardings)
        holder = {"state": step(state, batch)[0]}  # compiles

    def run(steps: int) -> float:
        start = time.perf_counter()
        with tracing_layout(mesh, DEFAULT_RULES):
            for _ in range(steps):
                holder["state"], metrics = step(holder["state"], batch)
        jax.block_until_ready(metrics)
        return time.perf_counter() - start

    run(1)
    return run


def time_rows(args) -> dict:
    """Seconds per step of context and data parallelism at the same tokens, each layout's model
    FLOPs per step, and the median of the rounds' ratios of seconds (context / data)."""
    cfg = ModelConfig.from_preset(
        args.preset,
        max_length=args.seq * DEVICES,
        num_decoder_layers=args.layers,
        embedding_dropout=0.0,
        attention_dropout=0.0,
        residual_dropout=0.0,
    )
    devices = jax.devices("cpu")[:DEVICES]
    rng = np.random.default_rng(0)
    runs = {
        "context": timed_step(
            cfg,
            make_mesh(1, 1, 1, context=DEVICES, devices=devices),
            lm_batch(rng, 1, args.seq * DEVICES, cfg.vocab_size),
        ),
        "data": timed_step(
            cfg,
            make_mesh(DEVICES, 1, 1, devices=devices),
            lm_batch(rng, DEVICES, args.seq, cfg.vocab_size),
        ),
    }
    seconds = {name: [] for name in runs}
    for _ in range(args.rounds):  # alternating windows: the host's drift falls on both
        for name, run in runs.items():
            seconds[name].append(run(args.steps) / args.steps)
    ratios = [c / d for c, d in zip(seconds["context"], seconds["data"], strict=True)]
    tokens = args.seq * DEVICES
    shapes = {"context": (1, tokens), "data": (DEVICES, args.seq)}
    return {
        "preset": args.preset,
        "layers": args.layers,
        "tokens_per_step": tokens,
        **{
            name: {
                "sequences": sequences,
                "length": length,
                "flops": tokens * training_flops_per_token(cfg, length),
                "seconds": seconds[name],
            }
            for name, (sequences, length) in shapes.items()
        },
        "ratio": statistics.median(ratios),
    }


def time_table(result: dict) -> list[str]:
    """The markdown table; the FLOPs' ratio is the share of the time ratio that a causal
    sequence 8x as long needs anyway (attention's keys grow with it)."""
    lines = [
        "| layout | sequences x tokens | model GFLOPs per step | median ms per step "
        "| time of data 8's | FLOPs of data 8's |",
        "|---|---|---|---|---|---|",
    ]
    for name, mesh in (("context", "context 8"), ("data", "data 8")):
        part = result[name]
        median = statistics.median(part["seconds"])
        ratio = result["ratio"] if name == "context" else 1.0
        work = part["flops"] / result["data"]["flops"]
        lines.append(
            f"| {mesh} | {part['sequences']} x {part['length']:,} | {part['flops'] / 1e9:.2f} "
            f"| {median * 1e3:.1f} | {ratio:.2f}x | {work:.2f}x |"
        )
    return lines


# ----------------------------------------------------------------------------- main
def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark (tests/test_readme.py parses the documented commands)."""
    command_line = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = command_line.add_subparsers(dest="mode", required=True)
    memory = modes.add_parser("memory", help="the longest sequence that fits, compiled")
    memory.add_argument("--out", type=pathlib.Path, required=True, help="the rows, JSON lines")
    memory.add_argument("--model", default="gpt2-small", choices=list(compile_table.MODELS))
    memory.add_argument("--topology", default="v5e-8")
    memory.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS))
    memory.add_argument("--start", type=int, default=16384, help="tokens per chip tried first")
    memory.add_argument("--max-length", type=int, default=2**20)
    memory.add_argument("--budget-gib", type=float, help="fit within this, not the chip's HBM")
    memory.add_argument("--set", nargs="*", default=[], metavar="key=value")
    timing = modes.add_parser("time", help="context 8 against data 8 on 8 CPU devices")
    timing.add_argument("--preset", default="gpt2-tiny")
    timing.add_argument("--layers", type=int, default=2)
    timing.add_argument("--seq", type=int, default=512, help="tokens per data-parallel row")
    timing.add_argument("--rounds", type=int, default=7)
    timing.add_argument("--steps", type=int, default=3, help="steps per timed window")
    timing.add_argument("--quick", action="store_true", help="the tests' size: seconds")
    return command_line


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.mode == "memory":
        rows, longest = memory_rows(args)
        print("\n".join(memory_table(rows, longest, args.budget_gib)))
        summary = {"mode": "memory", "rows": rows, "longest": longest}
    else:
        if args.quick:
            args.layers, args.seq, args.rounds, args.steps = 1, 32, 2, 1
        if len(jax.devices("cpu")) < DEVICES:
            raise SystemExit(
                f"needs {DEVICES} CPU devices, has {len(jax.devices('cpu'))}: start with "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES}"
            )
        result = time_rows(args)
        print(f"jax {jax.__version__}, {DEVICES} simulated CPU devices, {args.preset}")
        print("\n".join(time_table(result)))
        summary = {"mode": "time", "jax": jax.__version__, **result}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
