"""Faults and bad input of a sweep (flaxformer_lite/train/sweep.py, cli/sweep.py, the sweep's
summary read by compare and plot): each refused in one line with exit 2 before anything is
written, nothing of the user's touched, nothing followed out of the directory."""

import json
import math
import os
import subprocess
import sys

import pytest
from subprocess_env import subprocess_env
from tiny_runs import TINY

from flaxformer_lite.cli import main
from flaxformer_lite.data.config import DataConfig, MixtureSource
from flaxformer_lite.data.mixture import block_counts
from flaxformer_lite.train.config import load_config
from flaxformer_lite.train.run_dir import RunDir
from flaxformer_lite.train.sweep import sweep
from flaxformer_lite.train.sweep_members import NAME_BYTES, parse_vary, sweep_members

pytestmark = pytest.mark.fast_compile


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def a_sweep(directory, summary=None, members=("seed=0", "seed=1")):
    """A sweep directory as a finished sweep leaves it (its members' runs left out)."""
    directory.mkdir(parents=True)
    record = {
        "vary": {"seed": [name.split("=")[1] for name in members]},
        "config": {},
        "members": {name: {"seed": name.split("=")[1]} for name in members},
        "diverged": {},
    }
    if summary is not None:
        record["summary"] = summary
    (directory / "sweep.json").write_text(json.dumps(record))
    return directory


def test_fresh_refuses_while_another_process_trains_a_member(tmp_path, capsys):
    directory = a_sweep(tmp_path / "s")
    with RunDir(directory / "seed=0").locked():  # a member's run, its lock held by a trainer
        assert main(["sweep", "--fresh", "--vary", "seed=0,1", f"run_dir={directory}"]) == 2
    assert "seed=0 is in use by process" in one_line_error(capsys)
    assert not (tmp_path / "s.old1").exists() and (directory / "sweep.json").is_file()


@pytest.mark.parametrize("linked", [True, False])
def test_a_library_log_of_the_user_s_is_never_written(tmp_path, capsys, linked):
    """A link named library.log is followed by no write; a folder holding the user's own
    library.log (and nothing else) is not a sweep's."""
    directory, outside = tmp_path / "s", tmp_path / "mine.log"
    directory.mkdir()
    outside.write_text("mine\n")
    if linked:
        (directory / "library.log").symlink_to(outside)
    else:
        (directory / "library.log").write_text("mine\n")
    assert main(["sweep", "--vary", "seed=0,1", *TINY, f"run_dir={directory}"]) == 2
    said = one_line_error(capsys)
    assert ("holds symbolic links" if linked else "is not a sweep directory") in said
    assert outside.read_text() == "mine\n" and (directory / "library.log").read_text() == "mine\n"
    assert sorted(p.name for p in directory.iterdir()) == ["library.log"]


def test_every_member_s_data_is_checked_before_anything_is_written(tmp_path, capsys):
    """``--vary data.path`` needs no shared data.path, and a member's missing file is named
    before sweep.json or any member exists; the corrected command then starts afresh."""
    (tmp_path / "a.txt").write_text("some text to train on\n" * 50)
    command = ["sweep", "data.source=text", *TINY, f"run_dir={tmp_path / 's'}", "--vary"]
    paths = f"data.path={tmp_path / 'a.txt'},{tmp_path / 'missing.txt'}"
    assert main([*command, paths]) == 2
    said = one_line_error(capsys)
    assert "missing.txt" in said and "data.path" in said
    assert not (tmp_path / "s").exists()


def test_values_holding_commas_are_given_as_a_yaml_list():
    assert parse_vary(['data.path=["a,b.txt", c.txt]', "seed=0,1"]) == {
        "data.path": ["a,b.txt", "c.txt"],
        "seed": ["0", "1"],
    }
    cfg = load_config(None, ["run_dir=s", "data.source=text", "data.path=x.txt"])
    members = sweep_members(cfg, {"data.path": ["a,b.txt", "c.txt"]})
    assert [m.cfg.data.path for m in members] == ["a,b.txt", "c.txt"]


def test_a_member_name_too_long_for_a_file_system_is_shortened_by_a_hash(tmp_path):
    cfg = load_config(None, [f"run_dir={tmp_path / 's'}"])
    long_paths = ["x" * 300 + ".txt", "y" * 300 + ".txt"]
    members = sweep_members(cfg, {"data.path": long_paths, "seed": ["0"]})
    names = [member.name for member in members]
    assert all(len(name.encode()) <= NAME_BYTES for name in names) and len(set(names)) == 2
    assert names[0].startswith("path=xxx") and "~" in names[0]
    assert [m.settings["data.path"] for m in members] == long_paths  # sweep.json keeps them


@pytest.mark.parametrize(
    ("record", "says"),
    [
        ([], "not a sweep record"),
        ({}, "not a sweep record"),
        ({"members": [], "config": {}}, "members is not an object"),
    ],
)
def test_a_hand_edited_sweep_record_is_refused_in_one_line(tmp_path, capsys, record, says):
    directory = tmp_path / "s"
    directory.mkdir()
    (directory / "sweep.json").write_text(json.dumps(record))
    for command in (
        ["sweep", "--vary", "seed=0,1", f"run_dir={directory}"],
        ["compare", str(directory)],
        ["plot", str(directory)],
    ):
        assert main(command) == 2, command
        assert says in one_line_error(capsys), command
    assert json.loads((directory / "sweep.json").read_text()) == record


STATS = {"mean": 1.0, "std": 0.1, "n": 2}


@pytest.mark.parametrize(
    ("groups", "says"),
    [
        ("all", "its summary is not a sweep's"),
        ({"a": {"members": [], "eval_loss": {"mean": "low", "std": 0.1, "n": 2}}}, "eval_loss"),
        ({"a": {"members": [], "eval_loss": {"mean": 1.0, "std": None, "n": 0}}}, "eval_loss"),
        ({"a": {"members": ["seed=0"], "eval_loss": STATS}, "b": {"members": []}}, "no metric"),
    ],
)
def test_compare_and_plot_refuse_a_summary_of_another_shape(tmp_path, capsys, groups, says):
    """A string mean, a count of 0, a group whose members all diverged (no metric at all)."""
    directory = a_sweep(tmp_path / "s", {"members": {}, "groups": groups})
    assert main(["compare", str(directory)]) == 2
    assert says in one_line_error(capsys)


def test_a_mean_that_is_not_finite_gets_no_verdict(tmp_path, capsys):
    nan = {"mean": math.nan, "std": 0.1, "n": 2}
    groups = {
        "a": {"members": ["a0", "a1"], "loss": STATS},
        "b": {"members": ["b0", "b1"], "loss": nan},
    }
    values = {"a0": 0.9, "a1": 1.1, "b0": math.nan, "b1": 1.0}
    members = {name: {"settings": {}, "results": {"loss": value}} for name, value in values.items()}
    directory = a_sweep(tmp_path / "s", {"members": members, "groups": groups})
    assert main(["compare", str(directory)]) == 0
    assert "loss: difference +nan: a mean is not finite, no verdict" in capsys.readouterr().out


def test_a_thousand_members_ask_for_yes_before_anything(tmp_path, capsys):
    seeds = ",".join(str(seed) for seed in range(1000))
    assert main(["sweep", "--vary", f"seed={seeds}", f"run_dir={tmp_path / 's'}"]) == 2
    said = one_line_error(capsys)
    assert "makes 1,000 members" in said and "pass --yes" in said
    assert not (tmp_path / "s").exists()


def test_a_vmapped_sweep_with_a_context_axis_is_refused_before_compiling(tmp_path, capsys):
    command = ["sweep", "--vmap", "--vary", "seed=0,1", *TINY, "mesh.context=2", "mesh.data=4"]
    assert main([*command, f"run_dir={tmp_path / 's'}"]) == 2
    assert "--no-vmap" in one_line_error(capsys)
    assert not (tmp_path / "s").exists()


def test_mixture_weights_near_the_float_s_largest_share_the_rows():
    sources = {name: MixtureSource(path=f"{name}.txt", weight=1e308) for name in "ab"}
    DataConfig(source="text", mixture=sources)  # no overflow to a share of 0
    assert block_counts([1e308, 1e308]).tolist() == [512, 512]
    assert block_counts([3e307, 1e307]).tolist() == [768, 256]


def test_a_list_setting_takes_the_brackets_help_shows(tmp_path):
    cfg = load_config(None, ["model.local_window=[8,0]", f"run_dir={tmp_path}"])
    assert cfg.model.local_window == (8, 0)


@pytest.mark.parametrize("platforms", ["cuda", "nonsense"])
def test_a_platform_jax_cannot_start_is_one_line(tmp_path, platforms):
    environ = subprocess_env(1) | {"JAX_PLATFORMS": platforms}
    done = subprocess.run(
        [sys.executable, "-m", "flaxformer_lite.train", f"run_dir={tmp_path / 'r'}"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr[-2000:]
    assert err[0].startswith(f"error: JAX could not start JAX_PLATFORMS={platforms}")
    assert not (tmp_path / "r").exists() and os.path.isdir(tmp_path)


def test_a_mixture_source_s_weight_can_be_varied(tmp_path):
    for name in "xy":
        (tmp_path / f"{name}.txt").write_text(f"text of {name}\n" * 20)
    sources = [f"data.mixture.{name}.path={tmp_path / name}.txt" for name in "xy"]
    cfg = load_config(None, [f"run_dir={tmp_path / 's'}", "data.source=text", *sources])
    members = sweep_members(cfg, {"data.mixture.y.weight": ["1", "3"]})
    assert [m.name for m in members] == ["weight=1", "weight=3"]
    assert [m.cfg.data.mixture["y"].weight for m in members] == [1.0, 3.0]
    assert {m.cfg.data.mixture["x"].path for m in members} == {f"{tmp_path / 'x'}.txt"}


def test_members_whose_files_give_other_vocabularies_train_as_programs_of_their_own(tmp_path):
    """One program by their traces, but a character tokenizer fitted on each member's file
    gives each its own vocabulary: the members train apart, each to the end."""
    (tmp_path / "a.txt").write_text("abc abc\n" * 200)
    (tmp_path / "b.txt").write_text("xyz uvw xyz\n" * 200)
    paths = ",".join(str(tmp_path / name) for name in ("a.txt", "b.txt"))
    overrides = ["data.source=text", "data.tokenizer=char", "train.steps=2", "data.seq_len=16"]
    argv = ["sweep", *TINY, *overrides, f"run_dir={tmp_path / 's'}", "--vary", f"data.path={paths}"]
    assert main(argv) == 0
    record = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert [m["results"]["step"] for m in record["summary"]["members"].values()] == [2, 2]
    sizes = {
        load_config(path / "config.yaml").model.vocab_size
        for path in (tmp_path / "s").glob("path=*")
    }
    assert len(sizes) == 2


def test_a_sweep_recorded_under_the_old_member_names_resumes_in_its_directories(tmp_path):
    """Names were ``lr=0.001`` for a Python float before they read as the command line's
    ``lr=1e-3``: such a sweep resumes in its own directories, not refused as another."""
    directory = tmp_path / "s"
    settings = [*TINY, f"run_dir={directory}", "optimizer.schedule=constant"]
    vary = {"optimizer.lr": [1e-3, 3e-3]}
    sweep(load_config(None, [*settings, "train.steps=2"]), vary, vmap=False, log=lambda _: None)
    record = json.loads((directory / "sweep.json").read_text())
    for new, old in (("lr=1e-3", "lr=0.001"), ("lr=3e-3", "lr=0.003")):
        (directory / new).rename(directory / old)
        record["members"][old] = record["members"].pop(new)
    record.pop("summary")
    (directory / "sweep.json").write_text(json.dumps(record))
    lines = []
    sweep(load_config(None, [*settings, "train.steps=3"]), vary, vmap=False, log=lines.append)
    assert f"lr=0.001: resumed from step 2 of {directory / 'lr=0.001'}/checkpoints" in lines
    assert sorted(p.name for p in directory.iterdir() if p.name.startswith("lr")) == [
        "lr=0.001",
        "lr=0.003",
    ]
