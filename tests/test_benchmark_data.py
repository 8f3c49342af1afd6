"""benchmarks/data.py at a tiny size: every pipeline runs and the table, targets and JSON line
come out with the figures they claim; train.py's runs are paired with windows of the very step
the loop compiled, and their shares are computed from those two measurements."""

import json
import statistics

import jax
import pytest
from benchmark_scripts import load_benchmark

from flaxformer_lite.train.config import load_config

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

PIPELINES = ["--megabytes", "0.2", "--batches", "2", "--repeats", "1", "--vocab", "400"]
# One paired run of a few steps (after the compiling one); batch 8: the loop splits it over
# conftest.py's 8 devices.
TRAIN_PY = ["--windows", "1", "--default-steps", "2", "--bpe-steps", "2"]
TRAIN_PY += ["--bpe-seq", "16", "--bpe-batch", "8"]


@pytest.fixture(scope="module")
def run():
    benchmark = load_benchmark("data")
    return benchmark, benchmark.main(PIPELINES + ["--no-train-py"])


def test_every_pipeline_is_measured(run):
    _, summary = run
    for key in ("default", "encode_batch", "prepare_bpe", "prepare_byte", "memmap_sampler"):
        assert summary[key] > 0, key
    for rows in ("documents", "windows"):
        for processes in (1, 2, 8):
            assert summary[f"store_{rows}_{processes}"] > 0
    assert summary["store_tokens"] > 10_000 and summary["corpus_bytes"] > 0.15 * 2**20
    assert not any(key.startswith("train_py") for key in summary)


def test_table_and_targets_state_the_ratios(run):
    benchmark, summary = run
    lines = benchmark.table(summary) + benchmark.targets(summary)
    ratio = summary["prepare_bpe"] / summary["encode_batch"]
    assert any(f"{ratio:.2f}x" in line and line.startswith("| prepare, BPE") for line in lines)
    verdicts = [line for line in lines if line.startswith(("PASS", "FAIL"))]
    assert len(verdicts) == 7
    json.dumps(summary)  # the last line printed


@pytest.mark.slow
def test_train_py_against_its_step_alone(capsys):
    summary = load_benchmark("data").main(PIPELINES + TRAIN_PY)
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1]) == json.loads(json.dumps(summary))
    after_pipelines = out[next(i for i, line in enumerate(out) if line.startswith("train.py:")) :]
    runs = {"default": (2048, "embedded default"), "bpe": (8 * 16, "gpt2-tiny, prepared BPE 400")}
    for name, (tokens_per_step, description) in runs.items():
        measured = summary[f"train_py_{name}"]
        assert measured["description"].startswith(description)
        assert measured["tokens_per_step"] == tokens_per_step
        assert measured["steps_per_window"] == 2
        # The run between the step's windows right before and after it.
        logged, between = measured["logged_tokens_per_sec"], measured["step_seconds"]
        assert len(logged) == 1 and len(between) == 2 and min(logged + between) > 0
        shares = [logged[0] * (between[0] + between[1]) / 2 / tokens_per_step]
        assert measured["shares"] == pytest.approx(shares)
        assert measured["share"] == pytest.approx(statistics.median(shares))
        assert measured["train_py_tokens_per_sec"] == pytest.approx(statistics.median(logged))
        step = tokens_per_step / statistics.median(between)
        assert measured["step_tokens_per_sec"] == pytest.approx(step)
        start = f"| {measured['description']} |"
        row = next(line for line in after_pipelines if line.startswith(start))
        assert row.endswith(f"| {100 * measured['share']:.1f}% |")
        verdict = next(line for line in out if measured["description"] in line and ": " in line)
        assert verdict.startswith("PASS" if measured["share"] >= 0.95 else "FAIL")
        assert f"{100 * measured['share']:.1f}% of the step alone's >= 95%" in verdict
    assert len([line for line in out if line.startswith(("PASS", "FAIL"))]) == 9


def optimizer_step(run) -> int:
    """The optimizer's step count in the ``(model, optimizer)`` state of a ``LoopRun``."""
    state = run.treedef.unflatten(run.state)
    return int(jax.device_get(state[1]["step"][...]))


@pytest.mark.slow
def test_the_step_alone_is_the_loops_compiled_step(tmp_path):
    load_benchmark("data")  # puts benchmarks/ on sys.path
    from loop_vs_step import LoopRun, short_run_overrides

    overrides = short_run_overrides(tmp_path / "run", 2)
    run = LoopRun(load_config(None, [f"{key}={value}" for key, value in overrides.items()]))
    assert run.tokens_per_sec > 0 and optimizer_step(run) == 4
    # The same compiled step keeps training the loop's last state on its last batch.
    assert run.seconds_per_step(3, warmup=1) > 0
    assert optimizer_step(run) == 8
    # A batch of another shape needs another program: refused.
    run.batch = {key: value[:, :-1] for key, value in run.batch.items()}
    with pytest.raises(RuntimeError, match="not the loop's compiled step"):
        run.seconds_per_step(1, warmup=0)
