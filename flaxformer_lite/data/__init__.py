"""Data: tokenizers and built-in synthetic tasks, plain Python (no JAX), deterministic by seed."""
