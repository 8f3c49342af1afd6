"""Muon against AdamW: the cost of a train step side by side, and, from a sweep of both over
learning rates and seeds, the steps each takes to reach AdamW's final eval loss.

    python benchmarks/muon.py --step                      # the step's cost, two model sizes
    python benchmarks/muon.py --sweep runs/muon runs/muon8  # sweeps' steps to AdamW's loss

``--step``: the train step ``train.py`` runs (``build_train_state``, ``configured_train_step``: the
optimizer's numbers as arguments) of the Tiny Shakespeare recipe's model (``--sizes 128``; 4
layers, batch 12 x 64) under ``optimizer.name=adamw`` and ``muon``, each compiled first, then
``--windows`` rounds of ``--steps`` steps of one and of the other, so that a shared machine's
noise hits both alike; the median window gives milliseconds per step, and their ratio what
Newton-Schulz costs on top of AdamW's arithmetic.

``--sweep DIR [DIR ...]``: finished ``flaxformer-lite sweep --vary optimizer.name=adamw,muon
--vary optimizer.lr=... --vary seed=...`` (several: more rates run apart). Each optimizer's best
rate is the one of lowest mean final
eval loss over its seeds; the target is AdamW's mean final eval loss at its best rate. For each
member at its optimizer's best rate: the first evaluation step whose eval loss is at or below
the target (none: the member never reached it), and the seconds to it (that step over its
logged tokens per second); mean ± std over the seeds, and Muon's steps as a share of AdamW's.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax
import numpy as np

from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.metrics import read_metrics
from flaxformer_lite.train.program import (
    build_train_state,
    configured_train_step,
    resolve_mesh,
    tracing_layout,
)
from flaxformer_lite.train.step_numbers import step_numbers
from flaxformer_lite.train.sweep_dir import SweepDir
from flaxformer_lite.train.sweep_summary import read_summary


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark (tests/test_readme.py parses the documented commands)."""
    command_line = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    command_line.add_argument("--step", action="store_true", help="time the two steps")
    command_line.add_argument("--sizes", type=int, nargs="+", default=[128, 512])
    command_line.add_argument("--layers", type=int, default=4)
    command_line.add_argument("--windows", type=int, default=5)
    command_line.add_argument("--steps", type=int, default=10, help="steps per window")
    command_line.add_argument(
        "--sweep", type=pathlib.Path, nargs="+", help="sweeps of both optimizers"
    )
    return command_line


def step_cost(size: int, layers: int, windows: int, steps: int) -> dict:
    """Milliseconds per step of AdamW and Muon on the recipe's model at width ``size``."""
    programs = {}
    for name in ("adamw", "muon"):
        overrides = [
            f"optimizer.name={name}",
            f"model.d_model={size}",
            "model.d_ff=null",
            f"model.num_decoder_layers={layers}",
            "run_dir=unused",
        ]
        cfg, mesh = resolve_mesh(load_config("shakespeare_char", overrides))
        built = build_train_state(cfg, mesh, abstract=False)
        with tracing_layout(mesh, cfg.mesh.rules):
            step = configured_train_step(cfg, built.graphdef, built.shardings)
        numbers = jax.tree.map(jax.numpy.asarray, step_numbers(cfg, built.schedule))
        rng = np.random.default_rng(0)
        ids = rng.integers(0, cfg.model.vocab_size, (cfg.train.batch_size, 65), np.int32)
        batch = {
            "inputs": ids[:, :-1],
            "targets": ids[:, 1:],
            "weights": np.ones(ids[:, 1:].shape, np.float32),
        }
        state, active = built.state, jax.numpy.bool_(True)
        state, metrics, active = step(state, batch, numbers, active)  # compiles
        jax.block_until_ready(metrics)
        programs[name] = [step, state, batch, numbers, active]
    times: dict[str, list[float]] = {name: [] for name in programs}
    for _ in range(windows):
        for name, program in programs.items():
            step, state, batch, numbers, active = program
            started = time.perf_counter()
            for _ in range(steps):
                state, metrics, active = step(state, batch, numbers, active)
            jax.block_until_ready(metrics)
            times[name].append((time.perf_counter() - started) / steps * 1e3)
            program[1], program[4] = state, active
    ms = {name: statistics.median(values) for name, values in times.items()}
    return {
        "d_model": size,
        **{f"{k}_ms": v for k, v in ms.items()},
        "ratio": ms["muon"] / ms["adamw"],
    }


def steps_to_target(directories: list[pathlib.Path]) -> dict:
    """Each optimizer's best rate, the target, and its members' steps and seconds to it."""
    best, groups = {}, {}
    for directory in directories:
        record = SweepDir(directory).read()
        config = record["config"]
        tokens = config["train"]["batch_size"] * config["data"]["seq_len"]  # a step's positions
        for name, group in read_summary(directory)["groups"].items():
            if not group["members"] or "eval_loss" not in group:  # every member diverged
                continue
            settings = record["members"][group["members"][0]]
            optimizer, loss = settings["optimizer.name"], group["eval_loss"]["mean"]
            groups[(directory, name)] = group
            if optimizer not in best or loss < best[optimizer][1]:
                best[optimizer] = ((directory, name), loss, settings["optimizer.lr"])
    if set(best) != {"adamw", "muon"}:
        raise SystemExit(f"{directories}: sweeps of both optimizers, found {sorted(best)}")
    target = best["adamw"][1]
    result = {"target": target}
    for optimizer, ((directory, name), loss, lr) in sorted(best.items()):
        reached, seconds = [], []
        members = groups[(directory, name)]["members"]
        for member in members:
            records = read_metrics(directory / member, log=lambda _: None)
            evals = [r for r in records if r.get("eval_loss") is not None]
            hits = [r["step"] for r in evals if r["eval_loss"] <= target]
            rates = [r["tokens_per_sec"] for r in records if r.get("tokens_per_sec")]
            if hits:
                reached.append(hits[0])
                seconds.append(hits[0] * tokens / statistics.median(rates))
        result[optimizer] = {
            "lr": lr,
            "final_eval_loss": loss,
            "reached": f"{len(reached)}/{len(members)}",
            "steps": _mean_std(reached),
            "seconds": _mean_std(seconds),
        }
    if result["adamw"]["steps"][0] and result["muon"]["steps"][0]:
        result["muon_over_adamw"] = result["muon"]["steps"][0] / result["adamw"]["steps"][0]
    return result


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    out: dict = {}
    if args.step:
        out["step"] = [step_cost(s, args.layers, args.windows, args.steps) for s in args.sizes]
        print("d_model  adamw ms/step  muon ms/step  muon / adamw")
        for row in out["step"]:
            print(
                f"{row['d_model']:<8} {row['adamw_ms']:<14.2f} {row['muon_ms']:<13.2f} "
                f"{row['ratio']:.2f}x"
            )
    if args.sweep is not None:
        out["sweep"] = steps_to_target(args.sweep)
        print(f"target: AdamW's final eval loss at its best rate, {out['sweep']['target']:.4f}")
        for name in ("adamw", "muon"):
            row = out["sweep"].get(name)
            if row:
                print(
                    f"{name}: lr {row['lr']}, final {row['final_eval_loss']:.4f}, reached "
                    f"{row['reached']}, steps {row['steps']}, seconds {row['seconds']}"
                )
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
