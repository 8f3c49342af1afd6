"""benchmarks/lora.py at a tiny size: full fine-tuning and LoRA timed side by side, with what
each trains and keeps (against a count by hand)."""

import pytest
from benchmark_scripts import load_benchmark

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py


def test_both_steps_side_by_side_with_what_they_train_and_keep():
    argv = ["--config", "default", "--rank", "2", "--batch", "8", "--seq-len", "32"]
    result = load_benchmark("lora").main([*argv, "--windows", "1", "--steps", "1"])
    full, lora = result["full"], result["lora"]
    # gpt2-tiny, 2 layers of width 64: qkv 64 -> 192, out 64 -> 64, wi 64 -> 256, wo 256 -> 64
    assert lora["trainable"] == 2 * 2 * ((64 + 192) + (64 + 64) + (64 + 256) + (256 + 64))
    assert full["trainable"] == full["parameters"] == lora["parameters"] - lora["trainable"]
    # Adam's two float32 moments of each trained parameter, and its step counts
    for row in (full, lora):
        assert 8 * row["trainable"] <= row["optimizer_bytes"] <= 8 * row["trainable"] + 16
        assert row["step_ms"] > 0
