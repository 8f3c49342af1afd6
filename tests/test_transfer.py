"""The transfer check read from a sweep's record: each width's points are the means and sample
deviations of its seeds (against numpy), its best rate the lowest mean; the figure is written in
the sweep's plots/; a setting the sweep does not vary exits 2."""

import json

import numpy as np
import pytest

from flaxformer_lite.cli import main
from flaxformer_lite.train.transfer import transfer_table

LOSSES = {  # (d_model, lr) -> eval_loss of seeds 0 and 1
    ("64", "1e-3"): [2.9, 3.0],
    ("64", "3e-3"): [2.6, 2.8],
    ("64", "1e-2"): [2.7, 2.75],
    ("128", "1e-3"): [2.5, 2.52],
    ("128", "3e-3"): [2.55, 2.6],
    ("128", "1e-2"): [3.1, 3.3],
}


def stats(values):
    return {"mean": float(np.mean(values)), "std": float(np.std(values, ddof=1)), "n": 2}


@pytest.fixture
def sweep(tmp_path):
    members, groups = {}, {}
    for (width, lr), losses in LOSSES.items():
        names = [f"d_model={width},lr={lr},seed={seed}" for seed in (0, 1)]
        for name, seed in zip(names, (0, 1), strict=True):
            members[name] = {"model.d_model": width, "optimizer.lr": lr, "seed": str(seed)}
        groups[f"d_model={width},lr={lr}"] = {
            "members": names,
            "diverged": [],
            "eval_loss": stats(losses),
        }
    record = {
        "vary": {"model.d_model": ["64", "128"], "optimizer.lr": ["1e-3", "3e-3", "1e-2"]},
        "config": {},
        "members": members,
        "diverged": {},
        "summary": {"members": {}, "groups": groups},
    }
    (tmp_path / "sweep.json").write_text(json.dumps(record))
    return tmp_path


def test_each_width_gets_its_seeds_mean_and_spread_and_its_best_rate(sweep):
    table = transfer_table([sweep])
    assert list(table) == [64, 128]  # widths as numbers, in order
    for width, entry in table.items():
        lrs = [point[0] for point in entry["points"]]
        assert lrs == [1e-3, 3e-3, 1e-2]
        for lr_text, (_, mean, std, n) in zip(
            ("1e-3", "3e-3", "1e-2"), entry["points"], strict=True
        ):
            values = LOSSES[(str(width), lr_text)]
            assert (mean, n) == (pytest.approx(np.mean(values)), 2)
            assert std == pytest.approx(np.std(values, ddof=1))
    assert table[64]["best"][0] == 3e-3 and table[128]["best"][0] == 1e-3


def test_the_command_prints_the_best_rates_and_draws_in_the_sweep(sweep, capsys):
    assert main(["transfer", str(sweep)]) == 0
    out = capsys.readouterr().out
    assert "best optimizer.lr" in out and (sweep / "plots" / "transfer.png").stat().st_size > 0
    rows = [line.split()[:2] for line in out.splitlines() if line[:1].isdigit()]
    assert rows == [["64", "0.003"], ["128", "0.001"]]


def test_a_setting_the_sweep_does_not_vary_exits_2(sweep, capsys):
    assert main(["transfer", str(sweep), "--curves", "model.num_heads"]) == 2
    assert "does not vary model.num_heads" in capsys.readouterr().err
    assert not (sweep / "plots").exists()


def test_sweeps_run_apart_make_one_table_and_a_point_in_two_is_refused(sweep, tmp_path):
    wide = tmp_path / "wide"
    wide.mkdir()
    record = json.loads((sweep / "sweep.json").read_text())
    groups = record["summary"]["groups"]
    record["summary"]["groups"] = {
        name.replace("128", "256"): {
            **group,
            "members": [m.replace("128", "256") for m in group["members"]],
        }
        for name, group in groups.items()
        if "d_model=128" in name
    }
    record["members"] = {
        name.replace("128", "256"): {**s, "model.d_model": "256"}
        for name, s in record["members"].items()
        if s["model.d_model"] == "128"
    }
    (wide / "sweep.json").write_text(json.dumps(record))
    assert list(transfer_table([sweep, wide])) == [64, 128, 256]
    with pytest.raises(ValueError, match="is in two of the sweeps"):
        transfer_table([sweep, sweep])


def test_a_plots_link_out_of_the_sweep_is_refused(sweep, tmp_path, capsys):
    outside = tmp_path.parent / f"{tmp_path.name}_outside"
    outside.mkdir()
    (sweep / "plots").symlink_to(outside)
    assert main(["transfer", str(sweep)]) == 2
    assert "plots" in capsys.readouterr().err
    assert list(outside.iterdir()) == []
