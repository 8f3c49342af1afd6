"""Attention implementations side by side: compiled temp memory and median time.

    python benchmarks/attention.py                      # T = 512 ... 8192, the README table
    python benchmarks/attention.py --lengths 512 1024 --repeats 20

For every length (batch 1, 8 heads, head_dim 64, causal, float32) and for the forward pass and
forward+backward, it compiles each implementation, reads the temp buffer size from XLA's memory
analysis (deterministic, independent of the clock) and times the compiled call. Timing rounds
interleave the implementations so that machine noise hits them alike, each timed call right after
an untimed one of the same program; the median of the rounds is reported. The last lines check
the targets of the attention issue and print them as PASS/FAIL.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite import ops

IMPLEMENTATIONS = {
    "xla": functools.partial(ops.dot_product_attention, implementation="xla"),
    "chunked": functools.partial(ops.dot_product_attention, implementation="chunked"),
    "auto": functools.partial(ops.dot_product_attention, implementation=None),
    "jax.nn": jax.nn.dot_product_attention,
}


def build(attend, mode):
    """A jitted causal attention call: the output, or the gradients of a scalar loss."""

    def forward(q, k, v):
        return attend(q, k, v, is_causal=True)

    def forward_backward(q, k, v):
        return jax.grad(lambda q, k, v: jnp.sum(forward(q, k, v)), (0, 1, 2))(q, k, v)

    return jax.jit(forward if mode == "fwd" else forward_backward)


def measure(length, mode, repeats, names):
    shape = (1, length, 8, 64)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(3))
    compiled, temp = {}, {}
    for name in names:
        compiled[name] = build(IMPLEMENTATIONS[name], mode).lower(q, k, v).compile()
        temp[name] = compiled[name].memory_analysis().temp_size_in_bytes
        jax.block_until_ready(compiled[name](q, k, v))  # warm-up
    times = {name: [] for name in names}
    for _ in range(repeats):
        for name in names:
            # An untimed call first: the call after another program (the chunked while-loops
            # especially) runs measurably slower, and no implementation should pay for that.
            jax.block_until_ready(compiled[name](q, k, v))
            start = time.perf_counter()
            jax.block_until_ready(compiled[name](q, k, v))
            times[name].append(time.perf_counter() - start)
    return {name: (temp[name], statistics.median(times[name])) for name in names}


def parser() -> argparse.ArgumentParser:
    """The command line of this benchmark (tests/test_readme.py parses the documented commands)."""
    command_line = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    command_line.add_argument(
        "--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192]
    )
    command_line.add_argument("--repeats", type=int, default=0, help="timing rounds (0: by length)")
    return command_line


def main():
    command_line = parser()
    args = command_line.parse_args()
    names = list(IMPLEMENTATIONS)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.devices()[0].device_kind}")
    print("batch 1, 8 heads, head_dim 64, causal, float32; temp MiB / median ms\n")
    header = "| T | pass | " + " | ".join(f"{n} MiB | {n} ms" for n in names) + " |"
    print(header)
    print("|" + "---|" * (2 + 2 * len(names)))
    results = {}
    for length in args.lengths:
        repeats = args.repeats or max(3, min(30, 2**25 // length**2))
        for mode in ("fwd", "fwd+bwd"):
            row = measure(length, mode, repeats, names)
            results[length, mode] = row
            cells = " | ".join(f"{t / 2**20:.1f} | {s * 1e3:.1f}" for t, s in row.values())
            print(f"| {length} | {mode} | {cells} |", flush=True)
    print()
    report_targets(results)


def report_targets(results):
    def check(description, ok):
        print(f"{'PASS' if ok else 'FAIL'}: {description}")

    if (8192, "fwd+bwd") in results:
        row = results[8192, "fwd+bwd"]
        ratio = row["chunked"][0] / row["xla"][0]
        check(f"T=8192 fwd+bwd chunked temp / xla temp = {ratio:.4f} <= 1/16", ratio <= 1 / 16)
    if (2048, "fwd+bwd") in results:
        row = results[2048, "fwd+bwd"]
        ratio = row["chunked"][1] / row["xla"][1]
        check(f"T=2048 fwd+bwd chunked time / xla time = {ratio:.2f} <= 1.3", ratio <= 1.3)
    for (length, mode), row in sorted(results.items()):
        if length <= 1024:
            ratio = row["auto"][1] / row["jax.nn"][1]
            check(f"T={length} {mode} auto time / jax.nn time = {ratio:.2f} <= 1.1", ratio <= 1.1)


if __name__ == "__main__":
    main()
