"""benchmarks/gpu.py at its CPU size: ours and the Hugging Face peer, each in its own process."""

import json
import subprocess

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


def test_a_failed_peer_is_reported_and_ours_stands(monkeypatch):
    benchmark = load_benchmark("gpu")
    ours = {key: 1 for key in ("model", "optimizer", "seed", "batch_size", "seq_len")}
    ours |= {"window_tokens_per_sec": [1.0, 2.0, 3.0], "window_mfu": [0.1, 0.2, 0.3]}

    def in_own_process(function, job, directory):
        if function == "hf_gpt2.train_bf16":  # the peer runs out of memory, say
            raise subprocess.CalledProcessError(137, ["python"])
        return dict(ours)

    monkeypatch.setattr(benchmark, "in_own_process", in_own_process)
    monkeypatch.setattr(benchmark, "table", lambda summary: [])
    summary = benchmark.main(["--models", "default", "--steps", "6", "--log-every", "2"])
    result = summary["models"]["default"]
    assert result["peer"] == {"skipped": "failed, exit 137"} and "ratio" not in result
    assert (result["ours"]["tokens_per_sec"], result["ours"]["mfu"]) == (2.5, 0.25)


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
    for steps in ("2", "5"):  # one window only; a window cut short
        with pytest.raises(SystemExit, match="a multiple of --log-every, at least 2 x"):
            load_benchmark("gpu").main(["--tiny", "--steps", steps, "--log-every", "2"])
