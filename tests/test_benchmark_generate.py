"""benchmarks/generate.py at a tiny size: its JSON, its table, and cached greedy tokens equal to
the uncached ones (Hugging Face too when torch and transformers are installed)."""

import json

import numpy as np
import pytest
from benchmark_scripts import hf_available, load_benchmark

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

TINY = ["--layers", "2", "--d-model", "32", "--heads", "4", "--vocab", "64", "--max-length", "32"]


@pytest.mark.slow
def test_generate_benchmark_at_a_tiny_size(capsys):
    benchmark = load_benchmark("generate")
    argv = [
        *TINY,
        "--prompt-length",
        "6",
        "--new-tokens",
        "10",
        "--batch-sizes",
        "3",
        "--repeats",
        "2",
    ]
    if not hf_available():
        argv.append("--no-hf")
    summary = benchmark.main(argv)
    out = capsys.readouterr().out.strip().splitlines()

    assert json.loads(out[-1]) == json.loads(json.dumps(summary))
    assert summary["new_tokens"] == 10 and summary["repeats"] == 2
    assert summary["model"]["d_model"] == 32 and summary["model"]["num_decoder_layers"] == 2
    (row,) = summary["rows"]
    assert row["batch"] == 3
    assert row["tokens_identical"], row.get("first_difference")
    assert row["distinct_new_tokens"] > 1  # the scaled weights make the check non-trivial
    methods = ["cache", "no_cache"] + (["hf"] if hf_available() else [])
    assert (summary["hf_skipped"] is None) == hf_available()
    for name in methods:
        assert len(row[f"{name}_times_s"]) == 2
        assert row[f"{name}_s"] == pytest.approx(np.median(row[f"{name}_times_s"]))
        assert row[f"{name}_tokens_per_s"] == pytest.approx(3 * 10 / row[f"{name}_s"])
    ratio = row["cache_tokens_per_s"] / row["no_cache_tokens_per_s"]
    assert row["cache_over_no_cache"] == pytest.approx(ratio)
    assert row["cache_compile_s"] > 0 and row["no_cache_compile_s"] > 0

    # The markdown table: a header, a separator and the row, with the numbers of the JSON.
    table = [line for line in out if line.startswith("|")]
    assert len(table) == 3
    head = [cell.strip() for cell in table[0].split("|")[1:-1]]
    cells = dict(zip(head, (cell.strip() for cell in table[2].split("|")[1:-1]), strict=True))
    assert cells["batch"] == "3" and cells["same tokens"] == "yes"
    assert cells["cache tok/s"] == f"{row['cache_tokens_per_s']:.0f}"
    assert cells["cache / no cache"] == f"{row['cache_over_no_cache']:.1f}x"
    assert "PASS: batch 3: cached and uncached greedy tokens are identical" in out
    # No speed target at 10 new tokens: the cache / no cache target is for 256.
    assert not [line for line in out if "cache / no cache =" in line]


@pytest.mark.slow
def test_no_cache_path_equals_generate():
    """The benchmark's uncached greedy loop against flaxformer_lite.decode.generate."""
    import jax
    from flax import nnx

    from flaxformer_lite.decode import generate

    benchmark = load_benchmark("generate")
    args = benchmark.argparse.Namespace(
        layers=2, d_model=32, heads=4, d_ff=0, vocab=64, max_length=32
    )
    model = benchmark.build_model(benchmark.model_config(args), rngs=nnx.Rngs(1))
    model.eval()
    nnx.update(model, jax.tree.map(lambda x: x * 3, nnx.state(model, nnx.Param)))
    prompt = np.random.default_rng(1).integers(1, 64, (2, 5)).astype(np.int32)
    run, seconds = benchmark.compile_no_cache(model, 2, 5, 12)
    uncached = np.asarray(run(prompt))
    np.testing.assert_array_equal(uncached[:, :5], prompt)
    np.testing.assert_array_equal(uncached, np.asarray(generate(model, prompt, max_new_tokens=12)))
    assert seconds > 0 and len(np.unique(uncached[:, 5:])) > 1
