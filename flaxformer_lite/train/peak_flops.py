"""The peak FLOP/s that MFU divides by: an accelerator's datasheet number, a CPU's measured
matmul (timed once per machine and kept)."""

from __future__ import annotations

import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp

from flaxformer_lite.process import user_cache_dir

# Dense peak FLOP/s per chip for bf16 matmuls, by jax's device_kind; other devices: n/a.
PEAK_FLOPS = {
    "NVIDIA H100 80GB HBM3": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-SXM4-40GB": 312e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
}


def matmul_peak_flops(n: int = 2048, repeats: int = 5) -> float:
    """float32 FLOP/s of XLA's ``n x n x n`` matmul on the default device, the best of ``repeats``.

    A CPU has no datasheet number to look up: this measured peak is what MFU is taken against
    there, by ``train.py`` and ``benchmarks/train_step.py`` alike.
    """
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    matmul = jax.jit(jnp.matmul).lower(a, a).compile()
    matmul(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def peak_flops() -> float | None:
    """Peak FLOP/s of all devices: :data:`PEAK_FLOPS` for accelerators (``None`` for a kind not
    in the table); on CPU :func:`cpu_peak_flops`, once per host (simulated CPU devices share the
    same cores), all hosts taken to be alike."""
    devices = jax.devices()
    if devices[0].platform != "cpu":
        peak = PEAK_FLOPS.get(devices[0].device_kind)
        return peak * len(devices) if peak else None
    return cpu_peak_flops() * jax.process_count()


def cpu_peak_flops() -> float:
    """This machine's :func:`matmul_peak_flops`, measured once and kept in
    ``cpu_peak_flops.json`` of :func:`~flaxformer_lite.process.user_cache_dir` under the
    CPU's name, its cores and jax's version. Timed at every start, the peak moved by 20% (a run
    read MFU 0.50, and 0.42 resumed): kept, every run on the machine divides by one number."""
    path = user_cache_dir() / "cpu_peak_flops.json"
    key = f"{_cpu_name()}, {len(os.sched_getaffinity(0))} cores, jax {jax.__version__}"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    value = known.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    peak = matmul_peak_flops()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}")
        partial.write_text(json.dumps({**known, key: peak}, indent=1) + "\n")
        partial.replace(path)  # whole or absent for another process reading it
    except OSError:  # no cache (a read-only home): measured again at the next start
        pass
    return peak


def _cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows of it."""
    import platform

    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
