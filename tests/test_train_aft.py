"""Each AFT mixer trains on the embedded default task (shortened) through the training loop,
its held-out problems greedy-decoded by the running state at each evaluation."""

import json
from pathlib import Path

import pytest

from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.loop import run

SHORT = [
    "data.generator_options.max_digits=2",
    "train.steps=80",
    "optimizer.warmup_steps=10",
    "train.eval_every=80",
    "train.log_every=20",
    "train.decode_examples=16",
    "checkpoint.every=80",
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "mixer", ["aft_simple", "aft_full", "aft_local"], ids=lambda m: m.removeprefix("aft_")
)
def test_the_default_task_trains_with_each_aft_mixer(tmp_path, mixer):
    window = ["model.aft_window=8"] if mixer == "aft_local" else []
    overrides = [f"run_dir={tmp_path / 'run'}", f"model.mixer={mixer}", *window, *SHORT]
    last = run(load_config(None, overrides), progress=False, log=lambda line: None)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < 0.75 * losses[0], losses
    assert last["eval_loss"] < 0.75 * losses[0] and "eval_exact_match" in last


ABLATIONS = Path(__file__).parents[1] / "configs" / "ablations"


@pytest.mark.parametrize("mixer", ["attention", "aft_simple", "aft_full", "aft_local"])
def test_ablation_configs_change_only_the_mixer(mixer):
    cfg = load_config(ABLATIONS / f"{mixer}.yaml").to_dict()
    default = load_config(None).to_dict()
    assert cfg["run_dir"] == f"runs/ablations/{mixer}" and cfg["model"]["mixer"] == mixer
    window = {"aft_window": 8} if mixer == "aft_local" else {}
    default["model"].update(mixer=mixer, **window)
    assert {**cfg, "run_dir": None} == {**default, "run_dir": None}
