"""benchmarks/train_step.py at a tiny size: its JSON and table, the step it times is train.py's
(the loss goes down), and Hugging Face's step runs beside it when torch and transformers are
installed."""

import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from benchmark_scripts import hf_available, load_benchmark

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

# Batch 8: train.py's loop (--train-py) splits it over conftest.py's 8 simulated devices.
TINY = [
    "--layers",
    "1",
    "--d-model",
    "32",
    "--heads",
    "2",
    "--seq",
    "16",
    "--batch",
    "8",
    "--vocab",
    "64",
    "--steps",
    "3",
    "--windows",
    "2",
]


@pytest.mark.slow
def test_train_step_benchmark_at_a_tiny_size(capsys):
    benchmark = load_benchmark("train_step")
    argv = TINY + ["--train-py"] + ([] if hf_available() else ["--no-hf"])
    summary = benchmark.main(argv)
    out = capsys.readouterr().out.strip().splitlines()

    assert json.loads(out[-1]) == json.loads(json.dumps(summary))
    assert summary["model"]["d_model"] == 32 and summary["model"]["num_decoder_layers"] == 1
    assert summary["seq_len"] == 16 and summary["batch_size"] == 8
    assert len(summary["window_step_seconds"]) == 2
    assert summary["tokens_per_sec"] == pytest.approx(8 * 16 / summary["step_seconds"])
    mfu = summary["flops_per_token"] * summary["tokens_per_sec"] / summary["matmul_peak_flops"]
    assert summary["mfu"] == pytest.approx(mfu)
    assert 0 < summary["mfu"] < 1 and summary["compile_seconds"] > 0
    # The peak is the best of one measurement before the windows and one after each.
    assert len(summary["matmul_peaks_measured"]) == 3
    assert summary["matmul_peak_flops"] == max(summary["matmul_peaks_measured"])
    # Warm-up, two windows of three steps, and two more between train.py's runs, on one batch:
    # train.py's step learns it.
    assert len(summary["losses"]) == 5 and summary["losses"][-1] < summary["losses"][0]
    assert summary["page_faults_per_step"] >= 0 and summary["system_cpu_seconds_per_step"] >= 0
    table = [line for line in out if line.startswith("|")]
    assert table[2].startswith("| flaxformer_lite (JAX) | " + f"{summary['tokens_per_sec']:.0f}")
    assert table[2].endswith(
        f"| {summary['page_faults_per_step']:.0f} | {summary['system_cpu_seconds_per_step']:.3f} |"
    )
    # Two runs of train.py's loop, each paired with the step's windows right before and after it
    # (the last main window, then one after each run).
    logged = summary["train_py_window_tokens_per_sec"]
    between = summary["window_step_seconds_between_train_py"]
    assert len(logged) == 2 and min(logged) > 0
    assert summary["train_py_tokens_per_sec"] == pytest.approx(statistics.median(logged))
    assert len(between) == 3 and between[0] == summary["window_step_seconds"][-1]
    shares = [logged[i] * (between[i] + between[i + 1]) / 2 / (8 * 16) for i in range(2)]
    assert summary["train_py_window_shares"] == pytest.approx(shares)
    assert summary["train_py_share"] == pytest.approx(statistics.median(shares))
    assert table[4 if hf_available() else 3].startswith("| train.py's logged steady state (JAX) | ")
    # The step's 21 matmuls (below), timed alone once per window.
    assert summary["matmuls_per_step"] == 21 and len(summary["window_matmul_seconds"]) == 2
    assert summary["matmul_seconds"] == statistics.median(summary["window_matmul_seconds"])
    assert summary["matmul_while_loops"] == 0
    assert table[-2 if hf_available() else -1].startswith(
        f"| our step's matmuls alone, XLA | {8 * 16 / summary['matmul_seconds']:.0f} | "
    )
    assert [line for line in out if line.startswith("our step's")] == [
        benchmark.matmul_line(summary)
    ]
    checks = [line for line in out if line.startswith(("PASS", "FAIL"))]
    assert len(checks) == 1 and "train.py's logged tokens/s" in checks[0]  # not the default size
    if hf_available():
        assert summary["peer_skipped"] is None and len(table) == 7
        torch_matmul_seconds = summary["window_torch_matmul_seconds"]
        assert summary["torch_matmul_seconds"] == statistics.median(torch_matmul_seconds) > 0
        assert table[-1].startswith("| our step's matmuls alone, PyTorch (torch.einsum) | ")
        assert summary["peer_parameters"] == summary["parameters"]  # the same model shape
        ratio = summary["peer_step_seconds"] / summary["step_seconds"]
        assert summary["ratio"] == pytest.approx(ratio)
        assert summary["peer_losses"][-1] < summary["peer_losses"][0]
        assert summary["peer_page_faults_per_step"] >= 0
    else:
        assert summary["peer_skipped"] and summary["ratio"] is None and len(table) == 5


def test_the_timed_config_is_the_requested_gpt2():
    benchmark = load_benchmark("train_step")
    args = benchmark.argparse.Namespace(
        layers=12,
        d_model=768,
        heads=12,
        d_ff=0,
        seq=128,
        batch=4,
        vocab=50304,
        scan_layers=True,
        seed=0,
    )
    cfg = benchmark.train_config(args)
    m = cfg.model
    assert (m.num_decoder_layers, m.d_model, m.num_heads, m.d_ff) == (12, 768, 12, 3072)
    assert m.vocab_size == 50304 and m.scan_layers and m.kind == "decoder"
    assert (m.embedding_dropout, m.attention_dropout, m.residual_dropout) == (0, 0, 0)
    assert (cfg.data.seq_len, cfg.train.batch_size, m.dtype) == (128, 4, "float32")
    batch = benchmark.random_batch(cfg, 0)
    assert batch["inputs"].shape == batch["targets"].shape == (4, 128)
    assert (batch["inputs"][:, 1:] == batch["targets"][:, :-1]).all()


def test_measured_counts_the_pages_that_fresh_memory_costs():
    benchmark = load_benchmark("train_step")
    size = 64 * 2**20  # above glibc's largest mmap threshold: mapped afresh, touched by the fill
    seconds, faults, system = benchmark.measured(np.full, size // 8, 1.0)
    # One fault per 4 KiB page, or per 2 MiB where the allocator asks for transparent huge pages.
    assert faults >= size // 2**21 and seconds > 0 and system >= 0
    assert benchmark.measured(sum, [1, 2])[1] < size // 2**21  # a call that maps nothing


def test_the_matmuls_counted_are_the_steps_own():
    """The tiny GPT's step: 7 products forward (QKV, logits, weights x values, output
    projection, MLP in and out, the tied vocabulary projection), each with 2 in the backward."""
    benchmark = load_benchmark("train_step")
    args = benchmark.argparse.Namespace(
        layers=1, d_model=32, heads=2, d_ff=0, seq=16, batch=8, vocab=64, scan_layers=False, seed=0
    )
    cfg = benchmark.train_config(args)
    ours = benchmark.OurStep(cfg, benchmark.random_batch(cfg, 0))
    matmuls = load_benchmark("matmuls").StepMatmuls(ours.jaxpr)
    tokens, d, ff, heads, t, vocab = 8 * 16, 32, 128, 2, 16, 64
    forward = 2 * tokens * d * (3 * d + d + 2 * ff + vocab) + 2 * 2 * 8 * heads * t * t * (d // 2)
    assert sum(matmuls.counts.values()) == 21 and matmuls.flops == 3 * forward
    assert matmuls.while_loops == 0 and matmuls.seconds()[1] is None  # no PyTorch given


def test_step_matmuls_counts_scan_bodies_the_cheaper_branch_and_loops_once():
    matmuls = load_benchmark("matmuls")
    w, v = jnp.ones((5, 6)), jnp.ones((6, 5))

    def f(x):
        y, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w @ v), None), x, length=3)
        return jax.lax.cond(y.sum() > 0, lambda y: y @ w @ v, lambda y: y, y)

    x = jnp.ones((4, 5))
    counts, loops = matmuls.step_matmuls(jax.make_jaxpr(f)(x).jaxpr)
    assert sum(counts.values()) == 6 and loops == 0  # two per scan step; the branch without
    assert matmuls.matmul_flops(counts) == 3 * (2 * 4 * 5 * 6 + 2 * 4 * 6 * 5)
    grad_counts, _ = matmuls.step_matmuls(jax.make_jaxpr(jax.grad(lambda x: f(x).sum()))(x).jaxpr)
    assert sum(grad_counts.values()) == 6 + 3 * 2  # the backward of each product, x's side only

    def loop(x, n):  # a trip count known only at run time, as in chunked attention
        return jax.lax.fori_loop(0, n, lambda i, c: c @ w @ v, x)

    counts, loops = matmuls.step_matmuls(jax.make_jaxpr(loop)(x, 3).jaxpr)
    assert sum(counts.values()) == 2 and loops == 1


def test_matmul_line_sets_the_matmuls_against_both_steps_and_the_target():
    benchmark = load_benchmark("train_step")
    summary = {
        "matmuls_per_step": 99,
        "matmul_flops_per_step": 80e9,
        "matmul_while_loops": 0,
        "matmul_seconds": 0.8,
        "step_seconds": 1.0,
        "peer_skipped": None,
        "torch_matmul_seconds": 0.5,
        "peer_step_seconds": 1.25,
    }
    assert benchmark.matmul_line(summary) == (
        "our step's 99 matmuls (80.0 GFLOP), each at its best time alone: XLA 800.0 ms "
        "(100 GFLOP/s) = 0.80x our step; PyTorch 500.0 ms (160 GFLOP/s) = 0.40x Hugging "
        "Face's step; 1.25x Hugging Face's tokens/s is a step of 1000.0 ms = 1.25x XLA's matmuls"
    )
    summary |= {"peer_skipped": "--no-hf", "matmul_while_loops": 2}
    assert benchmark.matmul_line(summary) == (
        "our step's 99 matmuls (80.0 GFLOP, 2 while loops counted once), each at its best time "
        "alone: XLA 800.0 ms (100 GFLOP/s) = 0.80x our step"
    )


@pytest.mark.parametrize(
    "lhs, rhs, dims",
    [
        ((4, 5), (5, 6), (((1,), (0,)), ((), ()))),
        ((5, 4), (5, 6), (((0,), (0,)), ((), ()))),
        ((2, 3, 4, 5), (2, 4, 6, 5), (((3,), (3,)), ((0, 2), (0, 1)))),
        ((2, 7, 4), (7, 2, 4, 3), (((1, 2), (0, 2)), ((0,), (1,)))),
    ],
)
def test_einsum_spec_computes_the_dot_general(lhs, rhs, dims):
    matmuls = load_benchmark("matmuls")
    # Small integers: every product and sum is exact in float32, whatever the summation order.
    rng = np.random.default_rng(0)
    a, b = rng.integers(-4, 5, lhs).astype(np.float32), rng.integers(-4, 5, rhs).astype(np.float32)
    expected = jax.lax.dot_general(a, b, dims)
    spec = matmuls.einsum_spec(len(lhs), len(rhs), dims)
    np.testing.assert_array_equal(np.einsum(spec, a, b), expected)
