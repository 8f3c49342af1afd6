"""LoRA against full fine-tuning at one model's shape: what trains, what the optimizer keeps, and
the cost of a train step, side by side.

    python benchmarks/lora.py                     # gpt2_small's shape, rank 8, batch 4 x 128
    python benchmarks/lora.py --config shakespeare_char --batch 12 --seq-len 64

The train step ``train.py`` runs (``build_train_state``, ``configured_train_step``) of
``--config``'s model with every weight training and with ``lora.rank=--rank`` adapters on every
attention and MLP projection (the base frozen), each compiled first, then ``--windows`` rounds
of ``--steps`` steps of one and of the other, so that a shared machine's noise hits both alike;
the median window gives milliseconds per step. Trainable parameters count the arrays the
optimizer updates, optimizer bytes its state (Adam's two moments and its count).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx

from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.program import (
    build_train_state,
    configured_train_step,
    resolve_mesh,
    tracing_layout,
)
from flaxformer_lite.train.step_numbers import step_numbers


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark (tests/test_readme.py parses the documented commands)."""
    command_line = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    command_line.add_argument("--config", default="gpt2_small", help="a recipe or YAML file")
    command_line.add_argument("--rank", type=int, default=8)
    command_line.add_argument("--batch", type=int, default=4, help="rows per step")
    command_line.add_argument("--seq-len", type=int, default=128)
    command_line.add_argument("--windows", type=int, default=3)
    command_line.add_argument("--steps", type=int, default=3, help="steps per window")
    return command_line


def prepared_step(config: str, overrides: list[str]) -> tuple[list, dict]:
    """The compiled step of ``config`` with ``overrides``, its arguments after one step, and
    what it trains and keeps."""
    cfg, mesh = resolve_mesh(load_config(config, [*overrides, "run_dir=unused"]))
    built = build_train_state(cfg, mesh, abstract=False)
    with tracing_layout(mesh, cfg.mesh.rules):
        step = configured_train_step(cfg, built.graphdef, built.shardings)
    numbers = jax.tree.map(jax.numpy.asarray, step_numbers(cfg, built.schedule))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.data.seq_len + 1))
    ids = ids.astype(np.int32)
    batch = {
        "inputs": ids[:, :-1],
        "targets": ids[:, 1:],
        "weights": np.ones(ids[:, 1:].shape, np.float32),
    }
    model, optimizer = nnx.merge(built.graphdef, built.state)
    sizes = {
        "parameters": sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))),
        "trainable": sum(x.size for x in jax.tree.leaves(nnx.state(model, optimizer.wrt))),
        "optimizer_bytes": sum(x.nbytes for x in jax.tree.leaves(nnx.state(optimizer))),
    }
    state, active = built.state, jax.numpy.bool_(True)
    state, metrics, active = step(state, batch, numbers, active)  # compiles
    jax.block_until_ready(metrics)
    return [step, state, batch, numbers, active], sizes


def compare(args) -> dict:
    """Sizes and milliseconds per step of full fine-tuning and of LoRA."""
    common = [
        f"train.batch_size={args.batch}",
        f"data.seq_len={args.seq_len}",
        "model.embedding_dropout=0",
        "model.attention_dropout=0",
        "model.residual_dropout=0",
    ]
    arms = {"full": common, "lora": [*common, f"lora.rank={args.rank}"]}
    programs, sizes = {}, {}
    for name, overrides in arms.items():
        programs[name], sizes[name] = prepared_step(args.config, overrides)
    times: dict[str, list[float]] = {name: [] for name in programs}
    for _ in range(args.windows):
        for name, program in programs.items():
            step, state, batch, numbers, active = program
            started = time.perf_counter()
            for _ in range(args.steps):
                state, metrics, active = step(state, batch, numbers, active)
            jax.block_until_ready(metrics)
            times[name].append((time.perf_counter() - started) / args.steps * 1e3)
            program[1], program[4] = state, active
    return {name: {**sizes[name], "step_ms": statistics.median(times[name])} for name in programs}


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    result = compare(args)
    full, lora = result["full"], result["lora"]
    print(
        f"{args.config}: {full['parameters']:,} parameters, batch {args.batch} x {args.seq_len}, "
        f"LoRA rank {args.rank} on attention and MLP; median of {args.windows} windows of "
        f"{args.steps} steps"
    )
    print("| | trainable parameters | optimizer state | step (ms) |")
    print("|---|---|---|---|")
    for name, row in result.items():
        print(
            f"| {name} | {row['trainable']:,} | {row['optimizer_bytes'] / 2**20:.1f} MiB | "
            f"{row['step_ms']:.0f} |"
        )
    print(
        f"| LoRA / full | {lora['trainable'] / full['trainable']:.2%} | "
        f"{lora['optimizer_bytes'] / full['optimizer_bytes']:.2%} | "
        f"{lora['step_ms'] / full['step_ms']:.2f}x |"
    )
    return result


if __name__ == "__main__":
    main()
