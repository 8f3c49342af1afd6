"""benchmarks/muon.py at a tiny size: the two steps timed side by side, and the steps to AdamW's
final eval loss read from a sweep's record and its members' metrics (against a count by hand)."""

import json

import pytest
from benchmark_scripts import load_benchmark

pytestmark = pytest.mark.fast_compile  # XLA's backend optimizations off: conftest.py

# member -> its eval losses at steps 100, 200, 300
EVALS = {
    "name=adamw,lr=1e-3,seed=0": [3.0, 2.5, 2.0],
    "name=adamw,lr=1e-3,seed=1": [3.1, 2.4, 2.2],
    "name=adamw,lr=3e-3,seed=0": [3.0, 2.8, 2.6],
    "name=adamw,lr=3e-3,seed=1": [3.0, 2.9, 2.7],
    "name=muon,lr=1e-3,seed=0": [2.5, 2.1, 1.8],
    "name=muon,lr=1e-3,seed=1": [2.6, 2.05, 1.9],
    "name=muon,lr=3e-3,seed=0": [2.9, 2.5, 2.3],
    "name=muon,lr=3e-3,seed=1": [2.9, 2.5, 2.4],
}


def test_step_times_both_optimizers_side_by_side():
    out = load_benchmark("muon").main(
        ["--step", "--sizes", "32", "--layers", "1", "--windows", "1", "--steps", "1"]
    )
    (row,) = out["step"]
    assert row["d_model"] == 32 and row["adamw_ms"] > 0 and row["muon_ms"] > 0
    assert row["ratio"] == pytest.approx(row["muon_ms"] / row["adamw_ms"])


def write_sweep(directory, names):
    """A sweep's record and its members' metrics, of the members ``names`` of :data:`EVALS`."""
    directory.mkdir()
    members, groups = {}, {}
    for name in names:
        losses = EVALS[name]
        settings = dict(pair.split("=") for pair in name.split(","))
        members[name] = {f"optimizer.{k}" if k != "seed" else k: v for k, v in settings.items()}
        group = name.rsplit(",", 1)[0]
        entry = groups.setdefault(group, {"members": [], "diverged": [], "finals": []})
        entry["members"].append(name)
        entry["finals"].append(losses[-1])
        (directory / name).mkdir()
        records = [{"step": 50, "loss": 3.0, "tokens_per_sec": 400.0}]
        records += [{"step": 100 * (i + 1), "eval_loss": v} for i, v in enumerate(losses)]
        (directory / name / "metrics.jsonl").write_text("\n".join(map(json.dumps, records)))
    for entry in groups.values():
        finals = entry.pop("finals")
        entry["eval_loss"] = {"mean": sum(finals) / 2, "std": 0.1, "n": 2}
    record = {
        "vary": {},
        "config": {"train": {"batch_size": 4}, "data": {"seq_len": 10}},
        "members": members,
        "diverged": {},
        "summary": {"members": {}, "groups": groups},
    }
    (directory / "sweep.json").write_text(json.dumps(record))
    return directory


@pytest.mark.parametrize("apart", [False, True])
def test_steps_to_adamws_final_loss_from_a_sweep(tmp_path, apart):
    """From one sweep, or from two that ran the rates apart: the same result."""
    if apart:
        sweeps = [
            write_sweep(tmp_path / "a", [n for n in EVALS if "lr=1e-3" in n]),
            write_sweep(tmp_path / "b", [n for n in EVALS if "lr=3e-3" in n]),
        ]
    else:
        sweeps = [write_sweep(tmp_path / "a", list(EVALS))]
    argv = ["--sweep", *map(str, sweeps)]
    result = load_benchmark("muon").main(argv)["sweep"]
    assert result["target"] == pytest.approx(2.1)  # AdamW at 1e-3: (2.0 + 2.2) / 2
    assert result["adamw"]["lr"] == "1e-3" and result["muon"]["lr"] == "1e-3"
    assert result["adamw"]["reached"] == "1/2" and result["adamw"]["steps"] == (300, 0.0)
    assert result["muon"]["reached"] == "2/2" and result["muon"]["steps"][0] == 200
    assert result["muon"]["seconds"][0] == pytest.approx(200 * 40 / 400.0)
    assert result["muon_over_adamw"] == pytest.approx(200 / 300)
