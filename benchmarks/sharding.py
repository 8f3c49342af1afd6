"""Sharding layouts side by side: bytes per device and the collectives of the compiled train step.

    python benchmarks/sharding.py                       # gpt2-small on 8 devices, the README table
    python benchmarks/sharding.py --preset gpt2-tiny --seq 32 --layouts data=8 fsdp=8

Every layout is a mesh of 8 simulated CPU devices (``--xla_force_host_platform_device_count=8``,
set here unless ``XLA_FLAGS`` already names a device count), written ``data=2,tensor=4``; axes
left out have size 1. Rule overrides follow the mesh axes, as in ``mesh.rules.<name>`` of the
train config: ``tensor=8,heads=none`` replicates the attention heads, ``mlp=fsdp+tensor`` shards
the MLP's hidden units over two axes.

For each layout the model and its AdamW state are built abstractly
(:func:`flaxformer_lite.parallel.abstract_sharded`: shapes and shardings, nothing allocated), the
real train step (:func:`flaxformer_lite.train.step.make_train_step`, dropout on) is traced under
the mesh and the rules as the training loop traces it, for an abstract ``lm`` batch laid out by
:func:`flaxformer_lite.parallel.batch_sharding`, then lowered and compiled. Reported per layout:

* the parameter and optimizer-state bytes that one device holds, and their sum as a fraction of
  the unsharded sum;
* the collectives of the compiled program (``compiled.as_text()``): instructions by opcode,
  an async ``*-start``/``*-done`` pair counted once (as its start). A collective inside a loop
  body is one instruction; when loops (``scan_layers``, gradient accumulation) run some of them
  several times per step, the cell also gives the executed count, ``n (m/step)``, from the
  loops' known trip counts (a conditional's branches count once each);
* XLA's temp buffer per device (``compiled.memory_analysis()``), the compile time, and the
  number of "Involuntary full rematerialization" warnings of XLA's SPMD partitioner (a tensor
  the partitioner had to replicate to change its layout), which are also passed on to stderr.

A layout that does not fit the model (a dimension that does not divide over its mesh axes)
becomes a row with the reason. The output is a markdown table, notes, PASS/FAIL checks of what
the rules imply, and as the last line one JSON object with every row.

Counts and bytes are the CPU backend's: XLA's CPU pipeline has no reduce-scatter creator, so a
gradient that ends sharded is an all-reduce followed by a slice there, where GPU and TPU
compilers emit a reduce-scatter; the CPU's all-reduce combiner also merges independent
all-reduces into one instruction of many operands (the JSON counts the operands too).
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from flaxformer_lite import parallel  # noqa: E402
from flaxformer_lite.aot import COLLECTIVES, collective_counts  # noqa: E402
from flaxformer_lite.data.tasks import TASKS
from flaxformer_lite.models import ModelConfig, build_model  # noqa: E402
from flaxformer_lite.train.config import task_of  # noqa: E402
from flaxformer_lite.train.optim import make_optimizer
from flaxformer_lite.train.program import train_and_eval_graphdefs  # noqa: E402
from flaxformer_lite.train.sections import OptimizerConfig  # noqa: E402
from flaxformer_lite.train.step import make_train_step  # noqa: E402

DEVICES = 8
LAYOUTS = [
    "data=8",
    "fsdp=8",
    "data=2,tensor=4",
    "fsdp=4,tensor=2",
    "data=2,fsdp=2,tensor=2",
    "tensor=8",
    "tensor=8,heads=none",
]
REMAT_WARNING = "Involuntary full rematerialization"
MIB = 2**20


# ----------------------------------------------------------------------------- layouts
def parse_layout(text: str) -> tuple[dict[str, int], dict[str, tuple[str, ...]]]:
    """``"data=2,tensor=4,heads=none"`` -> ``({"data": 2, "fsdp": 1, "tensor": 4}, rules)``:
    mesh axis sizes (1 when left out) and ``DEFAULT_RULES`` with the overrides."""
    sizes = dict.fromkeys(parallel.MESH_AXES, 1)
    rules = dict(parallel.DEFAULT_RULES)
    for item in filter(None, re.split(r"[,\s]+", text)):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"layout {text!r}: {item!r} is not name=value")
        if key in parallel.MESH_AXES:
            sizes[key] = int(value)
        else:
            rules[key] = () if value.lower() in ("", "none") else tuple(value.split("+"))
    parallel.check_rules(rules, parallel.MESH_AXES)
    return sizes, rules


def layout_label(text: str) -> str:
    return " ".join(filter(None, re.split(r"[,\s]+", text)))


# ----------------------------------------------------------------------------- stderr
@contextlib.contextmanager
def stderr_lines():
    """Collects what is written to file descriptor 2 (XLA's C++ logging included) into the
    yielded list of lines, and passes it on to stderr afterwards."""
    lines: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield lines
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode(errors="replace")
            lines.extend(text.splitlines())
            sys.stderr.write(text)
            sys.stderr.flush()


# ----------------------------------------------------------------------------- one layout
def model_config(preset: str, vocab_multiple: int, scan_layers: bool | None) -> ModelConfig:
    cfg = ModelConfig.from_preset(preset)
    changes = {}
    if vocab_multiple > 1 and cfg.vocab_size % vocab_multiple:
        changes["vocab_size"] = -(-cfg.vocab_size // vocab_multiple) * vocab_multiple
    if scan_layers is not None:
        changes["scan_layers"] = scan_layers
    return cfg.replace(**changes) if changes else cfg


def _part_bytes(state, shardings) -> tuple[int, int]:
    layouts = parallel.array_layouts(state, shardings)
    return sum(x.device_bytes for x in layouts), sum(x.total_bytes for x in layouts)


def measure(cfg: ModelConfig, layout: str, batch_size: int, seq_len: int, devices) -> dict:
    """The row of one layout (see the module docstring); ``error`` instead when the layout does
    not fit the model or the batch."""
    row: dict = {"layout": layout_label(layout)}
    tx, _ = make_optimizer(OptimizerConfig(), cfg, total_steps=1000)

    def create():  # as the training loop creates its state
        model = build_model(cfg, rngs=nnx.Rngs(params=0, dropout=1))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    sizes, rules = parse_layout(layout)
    try:
        mesh = parallel.make_mesh(**sizes, devices=devices)
        parallel.check_batch_size(batch_size, mesh, rules)
        graphdef, state, shardings = parallel.abstract_sharded(create, mesh, rules)
    except ValueError as error:
        return row | {"error": str(error)}

    graphdef, _ = train_and_eval_graphdefs(graphdef, state)  # the training graph: dropout on

    params, params_total = _part_bytes(
        nnx.filter_state(state[0], nnx.Param), nnx.filter_state(shardings[0], nnx.Param)
    )
    opt, opt_total = _part_bytes(state[1], shardings[1])
    batch_sharding = parallel.batch_sharding(mesh, rules)
    dtypes = {"inputs": jnp.int32, "targets": jnp.int32, "weights": jnp.float32}
    batch = {
        key: jax.ShapeDtypeStruct((batch_size, seq_len), dtype, sharding=batch_sharding)
        for key, dtype in dtypes.items()
    }
    batch_bytes = sum(
        parallel.shard_bytes(x.shape, x.dtype, batch_sharding) for x in batch.values()
    )

    step = make_train_step(graphdef, task=TASKS["lm"], state_shardings=shardings)
    with (
        stderr_lines() as log,
        jax.set_mesh(mesh),
        nnx.logical_axis_rules(parallel.rule_pairs(rules)),
    ):
        started = time.perf_counter()
        lowered = step.lower(state, batch)
        lowered_at = time.perf_counter()
        compiled = lowered.compile()
        compiled_at = time.perf_counter()
    try:
        memory = compiled.memory_analysis()
    except Exception:  # not every backend implements it
        memory = None
    return row | {
        "mesh": sizes,
        "rules": {k: list(v) for k, v in rules.items() if v != parallel.DEFAULT_RULES.get(k)},
        "param_bytes": params,
        "opt_bytes": opt,
        "total_bytes": params + opt,
        "unsharded_bytes": params_total + opt_total,
        "fraction": (params + opt) / (params_total + opt_total),
        "state_bytes": parallel.device_bytes(state, shardings),  # + RNG keys and counters
        "batch_bytes": batch_bytes,
        "collectives": collective_counts(compiled.as_text(), len(devices)),
        "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
        "argument_bytes": getattr(memory, "argument_size_in_bytes", None),
        "lower_s": lowered_at - started,
        "compile_s": compiled_at - lowered_at,
        "remat_warnings": sum(REMAT_WARNING in line for line in log),
    }


# ----------------------------------------------------------------------------- output
def _cell(counts: dict) -> str:
    n, executed = counts["instructions"], counts["executed"]
    text = str(n) if executed == n else f"{n} ({executed}/step)"
    return text if counts["exact"] else text + "?"


def table(rows: list[dict]) -> list[str]:
    head = [
        "layout",
        "params MiB",
        "optimizer MiB",
        "total MiB",
        "of unsharded",
        *COLLECTIVES,
        "temp MiB",
        "compile s",
        "remat warnings",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        if "error" in row:
            cells = [row["layout"], "does not fit (see notes)", *[""] * (len(head) - 2)]
        else:
            temp = row["temp_bytes"]
            cells = [
                row["layout"],
                f"{row['param_bytes'] / MIB:.1f}",
                f"{row['opt_bytes'] / MIB:.1f}",
                f"{row['total_bytes'] / MIB:.1f}",
                f"{row['fraction']:.3f}",
                *[_cell(row["collectives"][op]) for op in COLLECTIVES],
                "n/a" if temp is None else f"{temp / MIB:.0f}",
                f"{row['compile_s']:.1f}",
                str(row["remat_warnings"]),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def checks(rows: list[dict]) -> list[str]:
    """PASS/FAIL lines for what the rules imply, for the layouts that were measured."""
    by_layout = {row["layout"]: row for row in rows if "error" not in row}
    lines = []

    def check(description, ok):
        lines.append(f"{'PASS' if ok else 'FAIL'}: {description}")

    if "data=8" in by_layout:
        row = by_layout["data=8"]
        check(
            f"data=8 keeps everything replicated: fraction {row['fraction']:.3f} == 1",
            row["fraction"] == 1.0,
        )
        n = row["collectives"]["all-reduce"]["instructions"]
        check(f"data=8 all-reduces the gradients: {n} all-reduce(s)", n >= 1)
    if "fsdp=8" in by_layout:
        row = by_layout["fsdp=8"]
        check(
            f"fsdp=8 shards the state: fraction {row['fraction']:.3f} <= 1/8 + 2%",
            row["fraction"] <= 1 / 8 + 0.02,
        )
        n = row["collectives"]["all-gather"]["instructions"]
        check(f"fsdp=8 gathers the parameters: {n} all-gather(s)", n >= 1)
    for row in by_layout.values():
        if row["argument_bytes"] is not None:
            expected = row["state_bytes"] + row["batch_bytes"]
            check(
                f"{row['layout']}: XLA's arguments per device {row['argument_bytes'] / MIB:.1f}"
                f" MiB = state + batch shards {expected / MIB:.1f} MiB (within 0.1%)",
                abs(row["argument_bytes"] - expected) <= 1e-3 * expected,
            )
    return lines


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark (tests/test_readme.py parses the documented commands)."""
    command_line = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    command_line.add_argument("--preset", default="gpt2-small")
    command_line.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    command_line.add_argument("--seq", type=int, default=1024, help="sequence length")
    command_line.add_argument(
        "--layouts", nargs="+", default=LAYOUTS, help="e.g. data=2,tensor=4 or tensor=8,heads=none"
    )
    command_line.add_argument(
        "--vocab-multiple",
        type=int,
        default=64,
        help="pad the vocabulary to a multiple of this (nanoGPT: 50257 -> 50304)",
    )
    command_line.add_argument(
        "--scan-layers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="override the preset's scan_layers",
    )
    return command_line


def main(argv=None) -> list[dict]:
    command_line = parser()
    args = command_line.parse_args(argv)

    devices = jax.devices("cpu")
    if len(devices) < DEVICES:
        raise SystemExit(
            f"needs {DEVICES} CPU devices, has {len(devices)}: start with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES}"
        )
    devices = devices[:DEVICES]
    cfg = model_config(args.preset, args.vocab_multiple, args.scan_layers)
    if task_of(cfg).name != "lm":
        raise SystemExit(f"{args.preset} is not a decoder LM; this benchmark feeds lm batches")
    preset_vocab = ModelConfig.from_preset(args.preset).vocab_size
    vocab = (
        f"vocab {preset_vocab} padded to {cfg.vocab_size}"
        if cfg.vocab_size != preset_vocab
        else f"vocab {cfg.vocab_size}"
    )

    print(f"jax {jax.__version__}, {DEVICES} simulated CPU devices")
    print(
        f"{args.preset} ({vocab}, scan_layers={cfg.scan_layers}, {cfg.param_dtype} parameters), "
        f"AdamW + clipping, train step with dropout, batch {args.batch} x {args.seq} tokens"
    )
    print("bytes per device; collectives: instructions in the compiled HLO\n", flush=True)
    rows = []
    for layout in args.layouts:
        row = measure(cfg, layout, args.batch, args.seq, devices)
        rows.append(row)
        if "error" not in row:
            print(
                f"[{row['layout']}] compiled in {row['lower_s']:.1f} + {row['compile_s']:.1f} s",
                file=sys.stderr,
                flush=True,
            )

    measured = [row for row in rows if "error" not in row]
    if measured:
        unsharded = measured[0]["unsharded_bytes"]
        print(f"unsharded parameters + optimizer state: {unsharded / MIB:.1f} MiB\n")
    print("\n".join(table(rows)))
    notes = [f"- {row['layout']}: {row['error']}" for row in rows if "error" in row]
    for row in measured:
        operands = {op: c["operands"] for op, c in row["collectives"].items() if c["instructions"]}
        if any(operands[op] > row["collectives"][op]["instructions"] for op in operands):
            text = ", ".join(
                f"{op} {row['collectives'][op]['instructions']} carrying {n}"
                for op, n in operands.items()
            )
            notes.append(f"- {row['layout']}: arrays per collective kind: {text}")
    if notes:
        print("\nnotes:\n" + "\n".join(notes))
    print()
    print("\n".join(checks(rows)))
    summary = {
        "jax": jax.__version__,
        "preset": args.preset,
        "vocab_size": cfg.vocab_size,
        "scan_layers": cfg.scan_layers,
        "batch": args.batch,
        "seq": args.seq,
        "rows": rows,
    }
    print(json.dumps(summary), flush=True)
    return rows


if __name__ == "__main__":
    main()
