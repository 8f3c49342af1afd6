"""The scripts of benchmarks/ as modules, for the tests that run them at a tiny size."""

import importlib.util
import pathlib
import sys

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """``benchmarks/{name}.py``, imported (its ``main`` not run). The scripts import the modules
    beside them (``hf_gpt2``, ``matmuls``), as they do when run, from benchmarks/ on sys.path."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hf_available() -> bool:
    """Whether the benchmarks' Hugging Face peer (torch and transformers) can be imported."""
    return all(importlib.util.find_spec(name) for name in ("torch", "transformers"))
