"""benchmarks/gpu.py at its CPU size: ours and the Hugging Face peer, each in its own process."""

import json

import pytest
from benchmark_scripts import hf_available, load_benchmark


@pytest.mark.slow
def test_gpu_benchmark_runs_at_tiny_size(capsys):
    peer = hf_available()  # without torch or transformers: ours alone, the peer skipped
    benchmark = load_benchmark("gpu")
    argv = ["--tiny", "--models", "gpt2-small", "--steps", "4", "--log-every", "2"]
    summary = benchmark.main(argv + ([] if peer else ["--no-hf"]))
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1]) == json.loads(json.dumps(summary))

    result = summary["models"]["gpt2-small"]
    ours = result["ours"]
    assert ours["logged_steps"] == [2, 4]  # one window per --log-every steps
    assert ours["tokens_per_sec"] == ours["window_tokens_per_sec"][1]  # the window after compiling
    assert ours["attention"] == "xla" and ours["device"] == "cpu"
    assert ours["peak_memory_bytes"] > 0 and ours["peak_memory_of"] == "process"
    # gpt2-small shrunk, its vocabulary the BPE's fitted on Tiny Shakespeare (--tiny: 320)
    assert ours["model"]["d_model"] == 64 and ours["model"]["vocab_size"] <= 320
    assert (ours["batch_size"], ours["seq_len"]) == (4, 64)
    table = [line for line in out if line.startswith("| gpt2-small")]
    assert f"| {ours['tokens_per_sec']:.0f} | {ours['mfu']:.1%} |" in table[0]
    if not peer:
        assert result["peer"] == {"skipped": "--no-hf"} and "skipped (--no-hf)" in table[1]
        return
    hf = result["peer"]
    assert hf["skipped"] is None and hf["attention"] == "sdpa" and hf["device"] == "cpu"
    assert len(hf["window_tokens_per_sec"]) == 2 and hf["peak_memory_bytes"] > 0
    assert result["ratio"] == pytest.approx(ours["tokens_per_sec"] / hf["tokens_per_sec"])
    assert hf["mfu"] == pytest.approx(ours["mfu"] * hf["tokens_per_sec"] / ours["tokens_per_sec"])
    assert f"gpt2-small: ours / Hugging Face tokens/s = {result['ratio']:.2f}" in out


def test_a_skipped_peer_is_a_line_of_the_table():
    ours = {
        "jax": "0.10.2",
        "device": "cpu",
        "attention": "xla",
        "tokens_per_sec": 1234.4,
        "mfu": None,  # a device whose peak is not known
        "peak_memory_bytes": 2**30,
        "peak_memory_of": "process",
        "batch_size": 4,
        "seq_len": 64,
    }
    summary = {"models": {"gpt2-small": {"ours": ours, "peer": {"skipped": "--no-hf"}}}}
    lines = load_benchmark("gpu").table(summary)
    assert lines[2] == (
        "| gpt2-small (B 4, T 64) | flaxformer_lite (JAX 0.10.2) | cpu | xla | 1234 | n/a "
        "| 1.00 (process) |"
    )
    assert lines[3] == "| gpt2-small (B 4, T 64) | Hugging Face: skipped (--no-hf) | | | | | |"


def test_too_few_steps_for_a_timed_window_are_refused():
    with pytest.raises(SystemExit, match="at least 2 x --log-every"):
        load_benchmark("gpu").main(["--tiny", "--steps", "3", "--log-every", "2"])
